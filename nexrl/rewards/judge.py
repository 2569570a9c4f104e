"""Generative judge: an LLM behind any OpenAI-compatible server grades each completion.

The judge renders `template` with the prompt, the completion and the dataset
row, asks the server (nexrl's own `nexrl serve`, vLLM, SGLang, ...) through the
official `openai` async client, and parses a score out of the reply with
`score_pattern` (default: "Score: 7/10" or "Score: 7" -> 0.7 with
`max_score=10`). An unparseable reply or a failed request raises: the
RewardRunner counts it as a failed reward, never as a 0.

Concurrency: the client lives on one private event-loop thread, so the judge
can be awaited from any event loop or called from any thread; up to
`max_concurrency` requests are in flight at once and the server batches them.
"""

from __future__ import annotations

import asyncio
import re
import threading
from collections.abc import Mapping
from dataclasses import dataclass

from nexrl.aio import EventLoopThread
from nexrl.rewards.calls import RewardDict

DEFAULT_TEMPLATE = (
    "You are grading an answer to a question.\n\n"
    "Question:\n{prompt}\n\nAnswer:\n{completion}\n\n"
    "Rate the answer from 0 to 10 and end with a line 'Score: N/10'."
)


class JudgeParseError(ValueError):
    """The judge's reply holds no score matching `score_pattern`."""


@dataclass(frozen=True)
class JudgeConfig:
    """Where the judge runs and how its reply becomes a reward in [0, 1]."""

    base_url: str
    """OpenAI-compatible endpoint, e.g. http://127.0.0.1:8000/v1."""
    model: str = "default"
    """Served model name of the judge."""
    api_key: str = "EMPTY"
    template: str = DEFAULT_TEMPLATE
    """str.format template; fields: {prompt}, {completion} and any dataset-row key."""
    score_pattern: str = r"Score:\s*(-?\d+(?:\.\d+)?)(?:\s*/\s*(\d+(?:\.\d+)?))?"
    """Regex; group 1 is the score, optional group 2 the scale (else `max_score`)."""
    max_score: float = 10.0
    """Scale when the reply gives no denominator; the reward is score / scale, clipped."""
    chat: bool = True
    """Use /chat/completions (the judge's chat template) instead of /completions."""
    max_tokens: int = 256
    temperature: float = 0.0
    max_concurrency: int = 64
    """Requests in flight at once."""
    request_timeout_s: float = 120.0


def parse_score(text: str, pattern: str, max_score: float) -> float:
    """The last score in `text` as a fraction of its scale, clipped to [0, 1]."""
    matches = list(re.finditer(pattern, text))
    if not matches:
        raise JudgeParseError(f"no score matching {pattern!r} in judge reply {text[-200:]!r}")
    match = matches[-1]
    score = float(match.group(1))
    scale = (
        float(match.group(2))
        if match.lastindex and match.lastindex >= 2 and match.group(2)
        else max_score
    )
    if scale <= 0:
        raise JudgeParseError(f"judge reply has a non-positive scale {scale}: {match.group(0)!r}")
    return min(1.0, max(0.0, score / scale))


class JudgeReward:
    """`await judge(prompt, completion, **row)` -> {"reward", "scores"}; also `judge.score(...)`."""

    def __init__(self, config: JudgeConfig) -> None:
        from openai import AsyncOpenAI

        self.config = config
        re.compile(config.score_pattern)  # a bad pattern fails here, not per call
        self._loop = EventLoopThread("judge")
        self._client = AsyncOpenAI(
            base_url=config.base_url,
            api_key=config.api_key,
            timeout=config.request_timeout_s,
            max_retries=0,
        )
        self._slots = asyncio.Semaphore(config.max_concurrency)
        self.stats = {"requests": 0, "parsed": 0, "unparseable": 0, "request_errors": 0}
        self._lock = threading.Lock()

    async def __call__(self, prompt: str, completion: str, **row: object) -> RewardDict:
        return await asyncio.wrap_future(self._loop.submit(self._judge(prompt, completion, row)))

    def score(self, prompt: str, completion: str, **row: object) -> RewardDict:
        """Blocking form, for code without an event loop."""
        return self._loop.run(self._judge(prompt, completion, row))

    def close(self) -> None:
        self._loop.run(self._client.close(), timeout=10)
        self._loop.close(timeout=10)

    def render(self, prompt: str, completion: str, row: Mapping[str, object]) -> str:
        try:
            return self.config.template.format(
                **{**row, "prompt": prompt, "completion": completion}
            )
        except KeyError as exc:
            raise KeyError(
                f"judge template field {exc} is neither prompt, completion nor a row key "
                f"(row keys: {sorted(row)})"
            ) from None

    async def _judge(self, prompt: str, completion: str, row: Mapping[str, object]) -> RewardDict:
        text = self.render(prompt, completion, row)
        self._count("requests")
        try:
            async with self._slots:
                reply = await self._request(text)
        except Exception:
            self._count("request_errors")
            raise
        try:
            reward = parse_score(reply, self.config.score_pattern, self.config.max_score)
        except JudgeParseError:
            self._count("unparseable")
            raise
        self._count("parsed")
        return {"reward": reward, "scores": {"judge": reward}}

    async def _request(self, text: str) -> str:
        cfg = self.config
        if cfg.chat:
            chat = await self._client.chat.completions.create(
                model=cfg.model,
                messages=[{"role": "user", "content": text}],
                max_tokens=cfg.max_tokens,
                temperature=cfg.temperature,
            )
            return chat.choices[0].message.content or ""
        resp = await self._client.completions.create(
            model=cfg.model, prompt=text, max_tokens=cfg.max_tokens, temperature=cfg.temperature
        )
        return resp.choices[0].text

    def _count(self, key: str) -> None:
        with self._lock:
            self.stats[key] += 1
