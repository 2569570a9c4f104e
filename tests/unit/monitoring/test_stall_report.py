"""The stall report: after a configured time without a train step, the run says what it
waits for (pool groups against their size, the batch, the busy workers, the last error)."""

from __future__ import annotations

from nexrl.config.schema import TrajectoryPoolConfig
from nexrl.monitoring.progress import StallReporter, task_summary
from nexrl.pools import TrajectoryPool


def traj(uid: str) -> dict:
    return {"uid": uid, "prompt_ids": [1], "response_ids": [2], "response_logprobs": [0.0]}


def test_the_pool_names_its_incomplete_groups_against_their_size():
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=8, group_size=4))
    assert pool.describe_wait() == "pool: no trajectory has arrived yet"
    pool.put_trajectory(traj("a"))
    pool.put_trajectory_group([traj("b")] * 4)
    line = pool.describe_wait()
    assert line == (
        "pool [default]: 4 of 8 trajectories ready for a batch; 1 incomplete group(s) (a: 1 of 4)"
    )


def test_a_report_after_the_configured_time_on_one_step_then_every_as_many_seconds():
    now = [0.0]
    reporter = StallReporter(10.0, lambda: "pool [default]: 0 of 8", clock=lambda: now[0])
    assert reporter.observe(3) is None
    now[0] = 9.0
    assert reporter.observe(3) is None
    now[0] = 10.5
    message = reporter.observe(3)
    assert message is not None and message.startswith("no train step for 10s (at step 3)")
    assert "pool [default]: 0 of 8" in message and "stall_report_s=10" in message
    now[0] = 15.0
    assert reporter.observe(3) is None  # not again before another 10 s
    now[0] = 16.0
    assert reporter.observe(4) is None  # progress resets the clock
    now[0] = 25.0
    assert reporter.observe(4) is None


def test_zero_turns_it_off():
    now = [0.0]
    reporter = StallReporter(0.0, lambda: "x", clock=lambda: now[0])
    reporter.observe(1)
    now[0] = 1e6
    assert reporter.observe(1) is None


def test_the_task_summary_accounts_for_every_task():
    counters = {
        "tasks_in/train": 10,
        "tasks_trained": 6,
        "tasks_failed/train": 1,
        "groups_dropped/dynamic_sampling": 1,
        "groups_dropped/end_of_data": 1,
        "rollout/released/fail": 3,
        "rollout/released/abort": 2,
        "rollout/released/dynamic_sampling": 1,
        "staleness/dropped": 1,
    }
    assert task_summary(counters) == (
        "tasks: 10 handed out; 6 trained, 1 failed, 2 dropped (dynamic_sampling 1, "
        "end_of_data 1), 1 not finished at the end; 6 re-queued on the way (abort 2, "
        "fail 3, stale 1)"
    )
