"""Process memory around a run: freed heap pages go back to the OS (glibc's malloc_trim),
and the setup's objects are kept out of the cyclic collector's walks while a run trains."""

import gc
import json
import os
import platform
import subprocess
import sys
import weakref

import pytest

from nexrl.run_setup import frozen_setup_heap, release_freed_memory


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="malloc_trim is glibc's")
def test_freed_heap_memory_goes_back_to_the_os():
    blocks = [bytes(1024) for _ in range(200_000)]  # ~200 MB of malloc'd 1 KiB blocks
    pin = bytes(1024)  # allocated after them: the heap's top cannot shrink past it
    del blocks
    held = rss()
    assert release_freed_memory()
    assert held - rss() > 100 * 2**20
    del pin


class Node:
    pass


def test_the_setup_heap_is_frozen_for_a_run_then_handed_back():
    setup = Node()
    setup.me = setup  # a cycle: only the collector can free it
    ref = weakref.ref(setup)
    with frozen_setup_heap() as frozen:
        assert frozen > 10_000
        assert not any(o is setup for o in gc.get_objects())  # full collections skip it
        made_in_run = Node()
        assert any(o is made_in_run for o in gc.get_objects())
        del setup
        gc.collect()
        assert ref() is not None  # a frozen cycle waits for the unfreeze
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert ref() is None


def test_a_run_collects_its_young_objects_less_often_then_restores_the_thresholds():
    from nexrl.run_setup import RUN_GC_THRESHOLD0

    before = gc.get_threshold()
    with frozen_setup_heap():
        assert gc.get_threshold() == (max(before[0], RUN_GC_THRESHOLD0), *before[1:])
    assert gc.get_threshold() == before
    gc.set_threshold(0, *before[1:])  # collection by threshold turned off stays off
    try:
        with frozen_setup_heap():
            assert gc.get_threshold()[0] == 0
    finally:
        gc.set_threshold(*before)


FAULTS_PER_ROUND = """
import resource, sys
import numpy as np
if sys.argv[1] == "retain":
    from nexrl.run_setup import retain_freed_heap
    assert retain_freed_heap()
faults = []
for _ in range(4):
    start = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    blocks = [np.ones(5 << 18, dtype=np.float32) for _ in range(20)]  # a step's 100 MiB
    del blocks
    faults.append(resource.getrusage(resource.RUSAGE_SELF).ru_minflt - start)
print(faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_a_run_keeps_what_a_step_freed_for_the_next_step():
    """By default glibc trims the heap's free top after each round, and the next round
    faults every page in again; a run's processes keep it (`freeze_setup_heap`)."""

    def rounds(mode: str) -> list[int]:
        cmd = [sys.executable, "-c", FAULTS_PER_ROUND, mode]
        return json.loads(subprocess.run(cmd, check=True, capture_output=True, text=True).stdout)

    default, retained = rounds("default"), rounds("retain")
    # measured on Zen 4: ~10,250 faults each round by default, 0 after the first retained
    assert max(retained[1:]) * 10 < min(default[1:])
    assert max(retained[1:]) * 10 < retained[0]  # only the first round faults it in
