"""`HelperThreads`: rounds of one function on parked threads."""

import threading

import pytest

from nexrl.rollout.helpers import HelperThreads


def test_each_start_runs_the_work_once_on_every_thread_together():
    meet = threading.Barrier(3, timeout=10)  # breaks unless all three run at once
    names: list[str] = []

    def work():
        meet.wait()
        names.append(threading.current_thread().name)

    helpers = HelperThreads("h", 3, work)
    for round_ in (1, 2):
        helpers.start()
        assert helpers.wait(10) and not helpers.busy
        assert len(names) == 3 * round_
    assert len(set(names)) == 3  # the same three threads, parked between rounds
    assert helpers.error is None
    helpers.close()
    with pytest.raises(RuntimeError, match="closed"):
        helpers.start()


def test_a_raising_round_is_kept_for_the_health_check_and_ends_the_round():
    def work():
        raise ValueError("bad task")

    helpers = HelperThreads("h", 2, work)
    helpers.start()
    assert helpers.wait(10)
    assert isinstance(helpers.error, ValueError)
    helpers.close()


def test_busy_until_every_thread_is_done():
    release = threading.Event()
    helpers = HelperThreads("h", 2, lambda: release.wait(10))
    helpers.start()
    assert helpers.busy and not helpers.wait(0.05)
    release.set()
    assert helpers.wait(10) and not helpers.busy
    helpers.close()


def test_a_new_round_waits_for_one_left_running():
    release, rounds = threading.Event(), []

    def work():
        rounds.append(len(rounds))
        release.wait(10)

    helpers = HelperThreads("h", 1, work)
    helpers.start()
    second = threading.Thread(target=helpers.start)
    second.start()
    second.join(0.2)
    assert second.is_alive() and rounds == [0]  # held until the first round ends
    release.set()
    second.join(10)
    assert helpers.wait(10) and rounds == [0, 1] and not helpers.busy
    helpers.close()
