"""The local disk tier's on-disk layout and shared index, read by the engine core (which blocks are there) and
written by the workers (which move the data). Standard library only: no torch, so the engine core reads it."""
