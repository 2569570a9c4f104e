"""`release_freed_memory`: freed heap pages go back to the OS (glibc's malloc_trim)."""

import os
import platform

import pytest

from nexrl.run_setup import release_freed_memory


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_freed_heap_memory_goes_back_to_the_os():
    blocks = [bytes(1024) for _ in range(200_000)]  # ~200 MB of malloc'd 1 KiB blocks
    pin = bytes(1024)  # allocated after them: the heap's top cannot shrink past it
    del blocks
    held = rss()
    assert release_freed_memory()
    assert held - rss() > 100 * 2**20
    del pin
