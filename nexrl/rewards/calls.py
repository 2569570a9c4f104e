"""The call shape of a reward: what it may return, how it is called, and the mark of
a reward that may run without a timeout.

A reward is `reward(prompt, completion, **row)` or the AReaL-lite seed's
`reward_fn(prompt, completion, prompt_ids, completion_ids, **kwargs)`, sync or async;
`PreparedReward` works out which once, and `normalize_result` turns what it returned
into `(reward, scores)`. `RewardRunner` (nexrl/rewards/runner.py) calls them.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import TypeAlias, TypedDict, TypeVar

from nexrl.types import JSONValue

RewardFn: TypeAlias = "Callable[..., object]"
"""A reward: `fn(prompt, completion, **row)` (or the seed's shape with token ids), sync or
async, returning a float, a `RewardDict` or a `RewardResult` (`normalize_result` checks)."""
_F = TypeVar("_F", bound=Callable[..., object])


class RewardDict(TypedDict):
    """A reward with its named components (logged apart by the runner)."""

    reward: float
    scores: dict[str, float]


_INLINE_MARK = "__nexrl_inline_reward__"


def inline_reward(fn: _F) -> _F:
    """Mark a synchronous reward that always returns quickly (no I/O, no solver, time
    bounded by the size of its input): `RewardRunner` then calls it in the caller's
    thread, with no timeout, instead of hopping to a thread that can time it out. The
    built-in string rewards are marked; leave anything that may hang unmarked."""
    if _is_async(fn):
        raise TypeError(f"inline_reward marks synchronous rewards; {fn!r} is async")
    setattr(fn, _INLINE_MARK, True)
    return fn


@dataclass
class RewardResult:
    """What a reward may return instead of a float: the reward and its named components."""

    reward: float
    scores: dict[str, float] = field(default_factory=dict)


def _is_async(fn: RewardFn) -> bool:
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(
        getattr(fn, "__call__", None)  # noqa: B004 - an object with `async def __call__`
    )


def normalize_result(value: object) -> tuple[float, dict[str, float]]:
    """(reward, scores) from what a reward returned; a clear error for anything else."""
    if isinstance(value, (int, float)):  # bool included: True -> 1.0. First: the usual
        reward, scores = value, {}  # answer, and a Mapping check (an ABC) costs ~1 us
    elif isinstance(value, RewardResult):
        reward, scores = value.reward, value.scores
    elif isinstance(value, Mapping):
        if "reward" not in value:
            raise ValueError(f"reward returned a dict without 'reward': keys {sorted(value)}")
        reward, scores = value["reward"], value.get("scores") or {}
    else:
        raise TypeError(
            f"reward returned {type(value).__name__}; expected a float, a dict with "
            "'reward' (and optional 'scores') or a RewardResult"
        )
    reward = float(reward)
    if not math.isfinite(reward):
        raise ValueError(f"reward returned a non-finite value {reward}")
    return reward, {str(k): float(v) for k, v in scores.items()}


@dataclass(frozen=True)
class PreparedReward:
    """A reward with its call shape worked out once.

    Why: `inspect.signature` costs ~15 µs, ten times a cheap reward's body, and
    the shape never changes, so `RewardRunner` inspects at construction and a
    call is one dict comprehension plus the call. Picklable when `fn` is (it is
    what the process pool receives).
    """

    fn: RewardFn
    seed_signature: bool
    """Takes `(prompt, completion, prompt_ids, completion_ids, **kwargs)` (the seed's shape)."""
    row_keys: frozenset[str] | None
    """The row keys `fn` names; None: it takes `**row` and gets every key. Why: `exact_match(
    prompt, completion, answer)` should not fail because the row also carries `index`."""
    is_async: bool
    inline: bool = False
    """Marked `@inline_reward`: called in the caller's thread even under a timeout."""

    @classmethod
    def of(cls, fn: RewardFn) -> PreparedReward:
        params = inspect.signature(fn).parameters
        var_kw = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
        named = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
        return cls(
            fn=fn,
            seed_signature="prompt_ids" in params or "completion_ids" in params,
            row_keys=None if var_kw else frozenset(n for n, p in params.items() if p.kind in named),
            is_async=_is_async(fn),
            inline=bool(getattr(fn, _INLINE_MARK, False)),
        )

    def __call__(
        self,
        prompt: JSONValue,
        completion: str,
        prompt_ids: list[int],
        completion_ids: list[int],
        row: Mapping[str, object],
    ) -> object:
        """What `fn` returns (a coroutine for an async reward)."""
        keys = self.row_keys
        kwargs = dict(row) if keys is None else {k: v for k, v in row.items() if k in keys}
        if self.seed_signature:
            return self.fn(prompt, completion, prompt_ids, completion_ids, **kwargs)
        return self.fn(prompt, completion, **kwargs)


def call_reward(
    fn: RewardFn,
    prompt: JSONValue,
    completion: str,
    prompt_ids: list[int],
    completion_ids: list[int],
    row: Mapping[str, object],
) -> object:
    """Call `fn` once in the shape its signature asks for (coroutine for an async reward).

    Inspects `fn` on every call; for repeated calls keep a `PreparedReward.of(fn)`.
    """
    return PreparedReward.of(fn)(prompt, completion, prompt_ids, completion_ids, row)
