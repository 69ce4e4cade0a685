"""Compiled attention kernels (C++ extensions built on first use)."""
