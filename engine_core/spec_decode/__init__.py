"""Speculative decoding in the engine core: n-gram drafts, their scheduling and their statistics."""
