"""RewardRunner: both signatures, sync/async, failures counted by kind, pool isolation."""

from __future__ import annotations

import asyncio
import concurrent.futures
import os
import threading
import time
from collections import Counter

import pytest

from nexrl.rewards import exact_match, shift_letters
from nexrl.rewards import executors as executors_module
from nexrl.rewards.runner import (
    PreparedReward,
    RewardCall,
    RewardResult,
    RewardRunner,
    call_reward,
    inline_reward,
)


def seed_reward(prompt, completion, prompt_ids, completion_ids, **kwargs):
    return float(len(completion_ids) == kwargs["n"])


def components(prompt, completion, **row):
    return {"reward": 0.5, "scores": {"format": 1.0, "correct": 0.0}}


async def async_reward(prompt, completion, answer, **row):
    await asyncio.sleep(0)
    return RewardResult(float(completion == answer), {"len": len(completion)})


def hangs(prompt, completion, **row):
    time.sleep(60)
    return 1.0


def dies_if_asked(prompt, completion, **row):
    if row.get("die"):
        os._exit(3)
    return components(prompt, completion)


def raises(prompt, completion, **row):
    raise KeyError("answer")


def returns_text(prompt, completion, **row):
    return "1.0"


def test_seed_signature_gets_token_ids() -> None:
    with RewardRunner(seed_reward, timeout_s=5) as runner:
        assert runner.seed_signature
        out = runner.score("p", "c", [1, 2], [3, 4, 5], {"n": 3})
        assert out.ok and out.reward == 1.0
        assert runner.score("p", "c", [1], [3], {"n": 3}).reward == 0.0


def test_row_keys_filtered_for_functions_without_kwargs() -> None:
    def strict(prompt, completion, answer):
        return float(completion == answer)

    with RewardRunner(strict, timeout_s=5) as runner:
        assert runner.score("p", "x", row={"answer": "x", "index": 4}).reward == 1.0
    with RewardRunner(exact_match, timeout_s=5) as runner:
        assert runner.score("p", " y ", row={"answer": "y", "index": 4}).reward == 1.0


def test_components_and_async() -> None:
    with RewardRunner(components, timeout_s=5) as runner:
        out = runner.score("p", "c")
        assert (out.reward, out.scores) == (0.5, {"format": 1.0, "correct": 0.0})
    with RewardRunner(async_reward, timeout_s=5) as runner:
        assert runner.is_async
        out = runner.score("p", "ab", row={"answer": "ab"})
        assert (out.reward, out.scores) == (1.0, {"len": 2.0})
        out = asyncio.run(runner.ascore("p", "ab", row={"answer": "x"}))
        assert (out.reward, out.scores) == (0.0, {"len": 2.0})


def test_failures_are_outcomes_not_exceptions() -> None:
    with RewardRunner(raises, timeout_s=5) as runner:
        out = runner.score("p", "c")
        assert out.error == "exception" and out.reward is None and "KeyError" in out.detail
    with RewardRunner(returns_text, timeout_s=5) as runner:
        out = asyncio.run(runner.ascore("p", "c"))
        assert out.error == "exception" and "expected a float" in out.detail
        assert runner.stats == {"calls": 1, "timeout": 0, "crash": 0, "exception": 1}


def test_inline_timeout_unblocks_the_caller() -> None:
    def slow(prompt, completion, **row):
        time.sleep(1.0)
        return 1.0

    with RewardRunner(slow, timeout_s=0.1) as runner:
        assert runner.score("p", "c").error == "timeout"
        assert asyncio.run(runner.ascore("p", "c")).error == "timeout"
        assert runner.stats["timeout"] == 2


@pytest.mark.slow
def test_process_pool_kills_hangs_and_survives_crashes() -> None:
    with RewardRunner(hangs, timeout_s=0.5, use_process_pool=True, max_workers=2) as runner:
        outs = [runner.score("p", "c") for _ in range(2)]
        assert [o.error for o in outs] == ["timeout", "timeout"]
    runner = RewardRunner(dies_if_asked, timeout_s=10, use_process_pool=True, max_workers=1)
    try:
        out = runner.score("p", "c", row={"die": True})
        assert out.error == "crash" and "3" in out.detail
        out = asyncio.run(runner.ascore("p", "c"))  # the pool replaced its dead worker
        assert out.ok and out.scores == {"format": 1.0, "correct": 0.0}
        assert runner.stats == {"calls": 2, "timeout": 0, "crash": 1, "exception": 0}
    finally:
        runner.close()


@pytest.mark.slow
def test_process_pool_async_and_seed_rewards() -> None:
    with RewardRunner(async_reward, timeout_s=10, use_process_pool=True) as runner:
        assert runner.score("p", "ab", row={"answer": "ab"}).reward == 1.0

        async def many():
            return await asyncio.gather(
                *(runner.ascore("p", str(i % 2), row={"answer": "1"}) for i in range(8))
            )

        assert [o.reward for o in asyncio.run(many())] == [0.0, 1.0] * 4


def _fields(outcomes):
    return [(o.reward, o.scores, o.error) for o in outcomes]


def _group(n: int = 6) -> list[RewardCall]:
    """Items that score differently under every test reward (n = completion_ids length)."""
    return [
        RewardCall("abcd>", "bcde"[: i % 5], [1], list(range(i % 3)), {"answer": "bcd", "n": 1})
        for i in range(n)
    ]


@pytest.mark.parametrize("fn", [shift_letters, exact_match, seed_reward, async_reward])
@pytest.mark.parametrize("timeout_s", [5.0, None])
def test_score_many_equals_score_per_item(fn, timeout_s) -> None:
    items = _group()
    with RewardRunner(fn, timeout_s=timeout_s) as runner:
        alone = [runner.score(*item) for item in items]
        assert all(o.ok for o in alone) and len({o.reward for o in alone}) > 1
        assert _fields(runner.score_many(items)) == _fields(alone)
        assert runner.score_many([]) == []
        assert runner.stats["calls"] == 2 * len(items)


def test_both_signatures_through_the_prepared_call() -> None:
    def strict(prompt, completion, answer):
        return float(completion == answer)

    seed = PreparedReward.of(seed_reward)
    assert seed.seed_signature and seed.row_keys is None and not seed.is_async
    assert PreparedReward.of(strict).row_keys == frozenset({"prompt", "completion", "answer"})
    row = {"answer": "x", "n": 2, "index": 4}
    assert call_reward(strict, "p", "x", [], [], row) == 1.0
    assert call_reward(seed_reward, "p", "x", [1], [7, 8], row) == 1.0
    with RewardRunner(strict, timeout_s=5) as a, RewardRunner(seed_reward, timeout_s=5) as b:
        items = [RewardCall("p", c, [1], [7] * len(c), row) for c in ("x", "yy")]
        assert [o.reward for o in a.score_many(items)] == [1.0, 0.0]
        assert [o.reward for o in b.score_many(items)] == [0.0, 1.0]
    with pytest.raises(AttributeError):
        a.fn = seed_reward  # the call shape is fixed at construction


def test_without_timeout_a_sync_reward_runs_in_the_callers_thread() -> None:
    threads = []

    def where(prompt, completion, **row):
        threads.append(threading.get_ident())
        return 1.0

    with RewardRunner(where, timeout_s=None) as runner:
        runner.score("p", "c")
        runner.score_many(_group(3))
    assert threads == [threading.get_ident()] * 4


def _threads_of(marked: bool, **runner_kwargs) -> set[int]:
    """The threads that ran a reward (marked `@inline_reward` or not) for one `score`
    and one `score_many` of 3 items."""
    threads = set()

    def where(prompt, completion, **row):
        threads.add(threading.get_ident())
        return 1.0

    with RewardRunner(inline_reward(where) if marked else where, **runner_kwargs) as runner:
        assert runner.score("p", "c").reward == 1.0
        assert [o.reward for o in runner.score_many([RewardCall("p", "c")] * 3)] == [1.0] * 3
        assert runner.stats["calls"] == 4
    return threads


def test_a_marked_reward_runs_in_the_callers_thread_despite_a_timeout() -> None:
    assert _threads_of(True, timeout_s=30.0) == {threading.get_ident()}


def test_an_unmarked_reward_under_a_timeout_runs_in_another_thread() -> None:
    assert threading.get_ident() not in _threads_of(False, timeout_s=30.0)
    assert _threads_of(False, timeout_s=None) == {threading.get_ident()}


@pytest.mark.parametrize("reward", [shift_letters, exact_match])
def test_the_builtin_string_rewards_run_inline(reward) -> None:
    """They cannot outlive a timeout: no hop to a timing thread."""
    with RewardRunner(reward, timeout_s=30.0) as runner:
        assert runner.runs_inline
        assert runner.score("abcd>", "bcde", row={"answer": "bcde"}).reward == 1.0


@pytest.mark.parametrize("name", ["math", "gsm8k", "code"])
def test_rewards_that_may_hang_keep_their_timeout(name) -> None:
    from nexrl.rewards import REWARD_FUNCTIONS

    with RewardRunner(REWARD_FUNCTIONS[name]) as runner:
        assert not runner.runs_inline


def test_inline_reward_refuses_an_async_reward_and_the_pool_ignores_the_mark() -> None:
    class AsyncJudge:
        async def __call__(self, prompt, completion, **row):
            return 1.0

    for reward in (async_reward, AsyncJudge()):
        with pytest.raises(TypeError, match="synchronous"):
            inline_reward(reward)
    with RewardRunner(shift_letters, use_process_pool=True, max_workers=1) as pooled:
        assert not pooled.runs_inline


def _gated(release: threading.Event, calls: Counter):
    """A sync reward that blocks on items with `hang` until `release` is set."""

    def reward(prompt, completion, **row):
        calls[completion] += 1
        if row.get("hang"):
            release.wait(60)
        if row.get("fail"):
            raise ZeroDivisionError(completion)
        return float(len(completion))

    return reward


def test_hung_item_times_out_and_the_rest_are_still_scored() -> None:
    release, calls = threading.Event(), Counter()
    items = [RewardCall("p", c, row={"hang": c == "bb"}) for c in ("a", "bb", "ccc", "dddd")]
    with RewardRunner(_gated(release, calls), timeout_s=0.3) as runner:
        start = time.monotonic()
        outs = runner.score_many(items)
        elapsed = time.monotonic() - start
        release.set()
        time.sleep(0.2)  # the stuck job wakes up: it must not score "ccc" and "dddd" again
    assert [o.error for o in outs] == [None, "timeout", None, None]
    assert [o.reward for o in outs] == [1.0, None, 3.0, 4.0]
    assert 0.3 <= elapsed < 20.0  # far below the 60 s hang: the item timed out
    assert calls == {"a": 1, "bb": 1, "ccc": 1, "dddd": 1}
    assert runner.stats == {"calls": 4, "timeout": 1, "crash": 0, "exception": 0}


@pytest.mark.parametrize("timeout_s", [5.0, None])
def test_one_raising_item_does_not_affect_the_others(timeout_s) -> None:
    release, calls = threading.Event(), Counter()
    items = [RewardCall("p", c, row={"fail": c == "bb"}) for c in ("a", "bb", "ccc")]
    with RewardRunner(_gated(release, calls), timeout_s=timeout_s) as runner:
        outs = runner.score_many(items)
    assert [o.error for o in outs] == [None, "exception", None]
    assert [o.reward for o in outs] == [1.0, None, 3.0]
    assert "ZeroDivisionError: bb" in outs[1].detail


def test_async_group_one_loop_with_per_item_failures() -> None:
    loops = set()

    async def slow_or_failing(prompt, completion, **row):
        loops.add(id(asyncio.get_running_loop()))
        if completion == "hang":
            await asyncio.sleep(60)
        if completion == "fail":
            raise KeyError(completion)
        return float(len(completion))

    items = [RewardCall("p", c) for c in ("a", "hang", "fail", "dddd")]
    with RewardRunner(slow_or_failing, timeout_s=0.3) as runner:
        start = time.monotonic()
        outs = runner.score_many(items)
        assert time.monotonic() - start < 20.0  # the 60 s hang timed out
    assert [o.error for o in outs] == [None, "timeout", "exception", None]
    assert [o.reward for o in outs] == [1.0, None, None, 4.0]
    assert len(loops) == 1


def test_closing_iter_scores_early_cancels_the_items_not_started() -> None:
    release, calls = threading.Event(), Counter()
    rows = {"a": {"fail": True}, "bb": {"hang": True}}
    items = [RewardCall("p", c, row=rows.get(c, {})) for c in ("a", "bb", "ccc", "dddd")]
    with RewardRunner(_gated(release, calls), timeout_s=5) as runner:
        outcomes = runner.iter_scores(items)
        assert next(outcomes).error == "exception"  # a failure comes at once
        while not calls["bb"]:  # the job is inside item "bb"
            time.sleep(0.01)
        outcomes.close()  # as the rollout worker does after a failure
        release.set()
        time.sleep(0.2)
    assert calls == {"a": 1, "bb": 1}


class _CountingCondition(threading.Condition):
    def __init__(self) -> None:
        super().__init__()
        self.wakeups = 0

    def wait(self, timeout: float | None = None) -> bool:
        woken = super().wait(timeout)
        self.wakeups += 1
        return woken


def test_a_group_wakes_its_caller_once(monkeypatch) -> None:
    # a wake-up per result was a thread switch per sample (256 a step by default)
    conds: list[_CountingCondition] = []
    init = executors_module.InOrderJob.__init__

    def counting_init(self, calls: int) -> None:
        init(self, calls)
        self._cond = _CountingCondition()
        conds.append(self._cond)

    def slow(prompt, completion, **row):
        time.sleep(0.005)  # the caller is waiting before each result
        return float(len(completion))

    monkeypatch.setattr(executors_module.InOrderJob, "__init__", counting_init)
    with RewardRunner(slow, timeout_s=5) as runner:
        outs = runner.score_many(_group(16))
    assert [o.reward for o in outs] == [float(len(c.completion)) for c in _group(16)]
    assert len(conds) == 1 and conds[0].wakeups == 1


@pytest.mark.timeout(30)  # before the fix, the items waited forever
def test_closing_the_runner_fails_an_async_group_still_queued() -> None:
    runner = RewardRunner(async_reward, timeout_s=None)
    runner._threads.shutdown()
    runner._threads = concurrent.futures.ThreadPoolExecutor(max_workers=1)
    busy = threading.Event()
    runner._threads.submit(busy.wait)  # the group's job waits behind this one
    closer = threading.Timer(0.3, runner.close)
    closer.start()
    outcomes = list(runner.iter_scores(_group(3)))
    busy.set()
    closer.join()
    assert [o.error for o in outcomes] == ["exception"] * 3
    assert all("CancelledError" in o.detail for o in outcomes)


@pytest.mark.slow
def test_process_pool_score_many() -> None:
    items = [RewardCall("p", "ab", row={"answer": a}) for a in ("ab", "x", "ab")]
    with RewardRunner(async_reward, timeout_s=10, use_process_pool=True) as runner:
        assert _fields(runner.score_many(items)) == _fields([runner.score(*i) for i in items])
    with RewardRunner(seed_reward, timeout_s=10, use_process_pool=True) as runner:
        group = _group(4)
        assert _fields(runner.score_many(group)) == _fields([runner.score(*i) for i in group])
    crashy = [RewardCall("p", "c", row={"die": i == 1}) for i in range(3)]
    with RewardRunner(dies_if_asked, timeout_s=10, use_process_pool=True) as runner:
        assert [o.error for o in runner.score_many(crashy)] == [None, "crash", None]


def test_bad_arguments() -> None:
    with pytest.raises(TypeError, match="not callable"):
        RewardRunner(3)
    with pytest.raises(ValueError, match="timeout_s"):
        RewardRunner(components, timeout_s=0)


@pytest.mark.parametrize("pool", [False, pytest.param(True, marks=pytest.mark.slow)])
def test_a_raising_reward_names_its_file_and_line(pool) -> None:
    with RewardRunner(raises, timeout_s=5, use_process_pool=pool, max_workers=1) as runner:
        out = runner.score("p", "c")
    line = raises.__code__.co_firstlineno + 1
    assert out.error == "exception" and f"(at {__file__}:{line} in raises)" in out.detail
