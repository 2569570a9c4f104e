"""Math rewards: numeric answer extraction first, math-verify for symbolic answers.

Order of the check (the first that decides wins):

1. Extract the model's answer: the last `\\boxed{...}` (nested braces), else a
   GSM8K `#### n` line, else the last number in the text.
2. If both the extracted answer and the reference read as numbers (commas,
   `$`, `%` and trailing units stripped), compare them numerically.
3. Otherwise ask math-verify (sympy) whether the two are equivalent.

math-verify bounds its own work with `signal.alarm`, which only works on a
process's main thread. A reward runs in rollout threads, so off the main thread
the comparison goes to a small pebble process pool instead (math-verify's
alarm works there, and a call that outlives `timeout_s` is killed). A call that
is killed raises `TimeoutError` (the RewardRunner counts it); math-verify's
own timeout inside the budget means "not equal", as the library defines it.
"""

from __future__ import annotations

import math
import re
import threading
from typing import TYPE_CHECKING

from nexrl.rewards.calls import RewardDict

_NUMBER = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:[eE][-+]?\d+)?|-?\.\d+")
_GSM8K = re.compile(r"####\s*([^\n]+)")
_UNITS = re.compile(r"^[\s$€£]*(.*?)[\s%]*(?:[a-zA-Z][a-zA-Z .]*)?$")


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` / `\\fbox{...}`, nested braces balanced."""
    start = max(text.rfind("\\boxed{"), text.rfind("\\fbox{"))
    if start < 0:
        return None
    i = text.index("{", start) + 1
    depth, begin = 1, i
    while i < len(text):
        if text[i] == "{":
            depth += 1
        elif text[i] == "}":
            depth -= 1
            if depth == 0:
                return text[begin:i].strip()
        i += 1
    return None  # unbalanced: the model stopped mid-answer


def extract_answer(text: str) -> str | None:
    """The model's final answer as a string: boxed, then `#### n`, then the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    numbers = _NUMBER.findall(text)
    return numbers[-1] if numbers else None


def to_number(text: str) -> float | None:
    """`"$1,234.50"` -> 1234.5, `"12 apples"` -> 12, `"\\frac{1}{2}"` -> None (symbolic)."""
    stripped = text.strip().rstrip(".")
    stripped = re.sub(r"\\(?:text|mathrm)\{[^}]*\}", "", stripped)  # \text{cm}
    stripped = stripped.replace("\\$", "").replace("\\%", "").replace("\\!", "")
    match = _UNITS.match(stripped)
    core = (match.group(1) if match else stripped).replace(",", "").strip()
    try:
        value = float(core)
    except ValueError:
        return None
    return value if math.isfinite(value) else None


def numbers_equal(a: float, b: float, rel_tol: float = 1e-6) -> bool:
    return math.isclose(a, b, rel_tol=rel_tol, abs_tol=1e-9)


# -- math-verify, with a timeout that works off the main thread ------------------

if TYPE_CHECKING:
    from pebble import ProcessPool

_pool_lock = threading.Lock()
_pool: ProcessPool | None = None


def _verify_here(gold: str, pred: str, timeout_s: float) -> bool:
    """math-verify in the current thread (must be a main thread when timeout_s > 0)."""
    from math_verify import parse, verify

    budget = max(1, math.ceil(timeout_s))
    gold_parsed = parse(_as_latex(gold), parsing_timeout=budget)
    pred_parsed = parse(_as_latex(pred), parsing_timeout=budget)
    if not gold_parsed or not pred_parsed:
        return False
    return bool(verify(gold_parsed, pred_parsed, timeout_seconds=budget))


def _as_latex(text: str) -> str:
    """math-verify looks for math delimiters; a bare answer gets `$...$`."""
    return text if ("$" in text or "\\boxed" in text) else f"${text}$"


def _verify_pool() -> ProcessPool:
    global _pool
    with _pool_lock:
        if _pool is None:
            import multiprocessing.util

            from pebble import ProcessPool

            _pool = ProcessPool(max_workers=2, context=multiprocessing.get_context("forkserver"))
            # stopped before multiprocessing joins a process's children at its exit: a
            # multiprocessing child that scored a sample otherwise hangs when it ends
            multiprocessing.util.Finalize(_pool, _stop_pool, exitpriority=10)
        return _pool


def _stop_pool() -> None:
    if _pool is not None:
        _pool.stop()
        _pool.join(10)


def symbolic_equal(gold: str, pred: str, timeout_s: float = 5.0) -> bool:
    """math-verify equivalence of two answers, bounded by `timeout_s` on any thread."""
    if threading.current_thread() is threading.main_thread():
        return _verify_here(gold, pred, timeout_s)
    future = _verify_pool().schedule(
        _verify_here, args=(gold, pred, timeout_s), timeout=timeout_s + 5
    )
    try:
        return future.result()
    except TimeoutError as exc:
        raise TimeoutError(f"math-verify exceeded {timeout_s} s on {pred[:80]!r}") from exc


# -- the rewards ----------------------------------------------------------------


def reference_answer(answer: object) -> str:
    """The reference from a dataset's `answer` field (a GSM8K solution keeps only `#### n`)."""
    text = str(answer)
    gsm = _GSM8K.findall(text)
    if gsm:
        return gsm[-1].strip()
    boxed = last_boxed(text)
    return boxed if boxed is not None else text.strip()


def math_reward(
    prompt: str, completion: str, answer: object, timeout_s: float = 5.0, **row: object
) -> RewardDict:
    """1.0 if the completion's final answer equals `answer`, numerically or symbolically.

    Components: `format` (an answer could be extracted) and `symbolic` (math-verify
    was needed), logged separately by the runner.
    """
    gold = reference_answer(answer)
    pred = extract_answer(completion)
    if pred is None:
        return {"reward": 0.0, "scores": {"format": 0.0, "symbolic": 0.0}}
    gold_num, pred_num = to_number(gold), to_number(pred)
    if gold_num is not None and pred_num is not None:
        correct = numbers_equal(gold_num, pred_num)
        return {"reward": float(correct), "scores": {"format": 1.0, "symbolic": 0.0}}
    correct = symbolic_equal(gold, pred, timeout_s)
    return {"reward": float(correct), "scores": {"format": 1.0, "symbolic": 1.0}}


def gsm8k_reward(prompt: str, completion: str, answer: object, **row: object) -> float:
    """Numeric-only GSM8K check (no sympy): the fast path for integer answers."""
    gold, pred = to_number(reference_answer(answer)), extract_answer(completion)
    pred_num = to_number(pred) if pred is not None else None
    if gold is None:
        raise ValueError(f"gsm8k reward: reference answer {answer!r} is not a number")
    return float(pred_num is not None and numbers_equal(gold, pred_num))
