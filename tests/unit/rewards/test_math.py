"""Math reward: answer extraction, numeric compare, math-verify on and off the main thread."""

from __future__ import annotations

import threading

import pytest

from nexrl.rewards import get_reward_fn
from nexrl.rewards.math import (
    extract_answer,
    gsm8k_reward,
    last_boxed,
    math_reward,
    reference_answer,
    symbolic_equal,
    to_number,
)


@pytest.mark.parametrize(
    ("text", "answer"),
    [
        ("so the total is \\boxed{42}.", "42"),
        ("\\boxed{1} then \\boxed{\\frac{a^{2}}{b_{1}}}", "\\frac{a^{2}}{b_{1}}"),
        ("Step 1 ... 3 + 4 = 7\n#### 1,234", "1,234"),
        ("I had 12 apples, ate 3.5, so 8.5 remain", "8.5"),
        ("negative: -17", "-17"),
        ("no digits here", None),
        ("\\boxed{unclosed {", None),  # unbalanced braces: the model stopped mid-answer
    ],
)
def test_extract_answer(text: str, answer: str | None) -> None:
    if "unclosed" in text:
        assert last_boxed(text) is None
        return
    assert extract_answer(text) == answer


@pytest.mark.parametrize(
    ("text", "value"),
    [("1,234", 1234.0), ("$1,234.50", 1234.5), ("12 apples", 12.0), ("50%", 50.0)]
    + [("3 \\text{ cm}", 3.0), ("-7.", -7.0), ("\\frac{1}{2}", None), ("x+1", None)],
)
def test_to_number(text: str, value: float | None) -> None:
    assert to_number(text) == value


def test_reference_answer_keeps_the_gsm8k_final_line() -> None:
    assert reference_answer("Natalia sold 48/2 = 24 clips...\n#### 72") == "72"
    assert reference_answer("\\boxed{\\pi}") == "\\pi"


def test_numeric_and_symbolic_rewards() -> None:
    assert math_reward("q", "The answer is \\boxed{72}", "#### 72")["reward"] == 1.0
    assert math_reward("q", "It is 72.0 dollars", "72")["reward"] == 1.0
    out = math_reward("q", "I think 71", "72")
    assert out == {"reward": 0.0, "scores": {"format": 1.0, "symbolic": 0.0}}
    assert math_reward("q", "no idea", "72")["scores"]["format"] == 0.0
    sym = math_reward("q", "\\boxed{\\frac{2}{4}}", "\\frac{1}{2}")
    assert sym == {"reward": 1.0, "scores": {"format": 1.0, "symbolic": 1.0}}
    assert math_reward("q", "\\boxed{x^2+2x+1}", "(x+1)^2")["reward"] == 1.0
    assert math_reward("q", "\\boxed{x^2+1}", "(x+1)^2")["reward"] == 0.0


def test_gsm8k_reward_and_registry() -> None:
    assert gsm8k_reward("q", "#### 1,000", answer="... #### 1000") == 1.0
    assert gsm8k_reward("q", "1001", answer="1000") == 0.0
    with pytest.raises(ValueError, match="not a number"):
        gsm8k_reward("q", "1", answer="\\pi")
    assert get_reward_fn("math") is math_reward
    assert get_reward_fn("gsm8k") is gsm8k_reward


def test_math_verify_off_the_main_thread() -> None:
    """math-verify alone refuses a timeout in a thread; symbolic_equal moves it to a process."""
    from math_verify import parse, verify

    results: dict[str, object] = {}

    def work() -> None:
        try:
            verify(parse("$1/2$"), parse("$0.5$"), timeout_seconds=2)
            results["raw"] = "ran"
        except ValueError as exc:
            results["raw"] = exc
        results["ours"] = symbolic_equal("\\frac{1}{\\sqrt{2}}", "\\frac{\\sqrt{2}}{2}", 5)
        results["ours_false"] = symbolic_equal("\\frac{1}{3}", "0.5", 5)

    thread = threading.Thread(target=work)
    thread.start()
    thread.join(120)
    assert isinstance(results["raw"], ValueError)  # why the pool exists
    assert results["ours"] is True and results["ours_false"] is False


def _score_off_the_main_thread(box) -> None:  # runs in a spawned child process
    result: list[bool] = []
    thread = threading.Thread(target=lambda: result.append(symbolic_equal("1/2", "0.5", 5)))
    thread.start()
    thread.join(60)
    box.put(result)


def test_a_child_process_that_used_the_verify_pool_exits() -> None:
    """The pool's worker processes must not keep a multiprocessing child from ending:
    multiprocessing joins a child's own children when it exits, before `atexit`."""
    import multiprocessing

    ctx = multiprocessing.get_context("spawn")
    box = ctx.Queue()
    child = ctx.Process(target=_score_off_the_main_thread, args=(box,))
    child.start()
    assert box.get(timeout=120) == [True]  # it scored through the pool
    child.join(60)
    alive = child.is_alive()
    if alive:
        child.kill()
    assert not alive and child.exitcode == 0
