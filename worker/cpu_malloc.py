"""A CPU worker keeps the memory its steps free, for the next layer and step to reuse.

glibc serves an allocation over 32 MiB (smaller ones too, until its threshold adapts) with a fresh mmap, unmaps
it on free, and trims the heap's free top. A step's large activations (64 MiB out of each gate_up matmul in a
2048-token prefill of the Llama-3.2-1B shape) were then mapped, page-faulted and zeroed again in every layer of every
step: 9% of that step's time, most of it inside the matmuls' first writes. With mmap off (the heap grows instead) and
trimming off, freed activations stay mapped and are reused, as tcmalloc or jemalloc would keep them. It is turned on
once the model is loaded (what loading freed, 0.7 GiB on that shape, would otherwise stay too). The cost: the worker
holds its peak activation memory (on that shape about 0.13 GiB more resident between steps). Without glibc's mallopt
it is left as it is, said at debug level."""

import ctypes
import logging

logger = logging.getLogger(__name__)
M_TRIM_THRESHOLD = -1  # glibc's mallopt parameters (malloc.h)
M_MMAP_MAX = -4


def keep_freed_memory() -> bool:
    """Turn glibc's mmap of large blocks and heap trimming off in this process; whether that took effect."""
    try:
        mallopt = ctypes.CDLL(None).mallopt  # the C library this process already runs on
    except (OSError, AttributeError):
        logger.debug("no glibc mallopt here: freed memory goes back to the OS as the C library decides")
        return False
    mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    if not (mallopt(M_MMAP_MAX, 0) and mallopt(M_TRIM_THRESHOLD, -1)):
        logger.warning("mallopt refused: a step's large activations are mapped and zeroed again every step")
        return False
    logger.info("malloc: freed activations stay mapped for the next step's reuse (glibc mmap and trim off)")
    return True
