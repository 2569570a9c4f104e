"""Reward functions: plain `reward(prompt, completion, **row) -> float`.

`REWARD_FUNCTIONS` is the explicit registry; `get_reward_fn` also accepts an
import path "pkg.module:function" for user code. `row` is the dataset row
(e.g. `answer`), so a reward needs no framework object. A reward that raises
is NOT turned into 0 here: the exception propagates and the rollout worker
reports and counts it (a silent 0 would look like a learnable signal).

Around the functions (docs/rewards.md):
- `runner.RewardRunner`: both signatures (also the seed's
  `reward_fn(prompt, completion, prompt_ids, completion_ids, **kwargs)`), sync
  or async, timeouts, an optional process pool, failures as outcomes;
- `math` (numeric + math-verify), `code` (unit tests in `sandbox.Sandbox`,
  bubblewrap), `judge.JudgeReward` (an LLM over an OpenAI-compatible server),
  `reward_model.RewardModelScorer` (HF sequence classifier, batched).
"""

from __future__ import annotations

from collections.abc import Callable

from nexrl.registry import Registry
from nexrl.rewards.calls import inline_reward

RewardFn = Callable[..., float]


@inline_reward
def shift_letters(prompt: str, completion: str, answer: str, **row: object) -> float:
    """Per-position partial credit for the shift-letters task.

    score = #(i: completion[i] == answer[i]) / max(len(answer), len(completion)),
    with `completion` stripped of surrounding whitespace. Dividing by the longer
    length penalises rambling: "bcde" -> 1.0, "bcdx" -> 0.75, "bcdexxxx" -> 0.5.
    """
    text = completion.strip()
    answer = str(answer)
    denom = max(len(answer), len(text))
    if denom == 0:
        return 1.0
    return sum(a == b for a, b in zip(text, answer, strict=False)) / denom


@inline_reward
def exact_match(prompt: str, completion: str, answer: str, **row: object) -> float:
    """1.0 if the stripped completion equals the stripped answer, else 0.0."""
    return float(completion.strip() == str(answer).strip())


REWARD_FUNCTIONS: Registry[RewardFn] = Registry("reward function", "rollout_worker.reward_fn")
"""name -> reward; `REWARD_FUNCTIONS.add("mine", fn)` (or `@REWARD_FUNCTIONS.register(
"mine")`) makes `rollout_worker.reward_fn=mine` pick it."""
REWARD_FUNCTIONS.add("shift_letters", shift_letters)
REWARD_FUNCTIONS.add("exact_match", exact_match)
# the heavier built-ins live in their own modules, imported on first use
REWARD_FUNCTIONS.add("math", "nexrl.rewards.math:math_reward")
REWARD_FUNCTIONS.add("gsm8k", "nexrl.rewards.math:gsm8k_reward")
REWARD_FUNCTIONS.add("code", "nexrl.rewards.code:code_reward")


def get_reward_fn(name: str) -> RewardFn:
    """A registered reward by name, or a function given as "pkg.module:function"."""
    fn = REWARD_FUNCTIONS.get(name)
    if not callable(fn):
        raise ValueError(f"rollout_worker.reward_fn: reward function {name!r} is not callable")
    return fn


__all__ = [
    "REWARD_FUNCTIONS",
    "RewardFn",
    "exact_match",
    "get_reward_fn",
    "inline_reward",
    "shift_letters",
]
