"""worker/cpu_malloc.py: once a CPU worker keeps freed memory, a large block freed, then one of about its size
allocated, is the same mapped memory (its old bytes still there), not a fresh zeroed mapping. Each case runs in a
fresh interpreter: mallopt changes the whole process."""

import subprocess
import sys

import pytest

REUSE = """
import sys, torch
from worker.cpu_malloc import keep_freed_memory
if sys.argv[1] == "keep":
    assert keep_freed_memory()
n = 24 << 20  # 96 MiB of int32: over glibc's 32 MiB mmap ceiling
a = torch.full((n,), 7, dtype=torch.int32)
ptr = a.data_ptr()
del a
b = torch.empty(n - (1 << 20), dtype=torch.int32)  # a little smaller: malloc's alignment slack fits in a's place
inside = ptr <= b.data_ptr() < ptr + (1 << 20)
print(inside, bool((b[1024:] == 7).all()), int(b[1024:].abs().sum()) == 0)
"""


def reuse(mode: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", REUSE, mode], capture_output=True, text=True, check=True)
    return out.stdout.split()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_a_freed_large_block_is_reused_mapped_once_kept():
    assert reuse("keep") == ["True", "True", "False"]  # the same address, its old contents: no new pages


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's mallopt")
def test_without_it_the_same_block_comes_back_as_fresh_zeroed_pages():
    assert reuse("default")[1:] == ["False", "True"]  # what the worker avoids: the kernel zeroed every page again
