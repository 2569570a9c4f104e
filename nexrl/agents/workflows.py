"""Built-in `RolloutWorkflow`s: one chat turn, and a multi-turn tool-using episode.

Both render the row's prompt (`prompt_key`: text or chat messages) with the
engine's chat template, sample token-exact, and score the final answer with
`reward_fn(prompt, completion, **row)` when they have one (otherwise the
rollout worker's `reward_fn` scores the trajectory's `response`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

if TYPE_CHECKING:
    from omegaconf import DictConfig

from nexrl.agents.loop import run_tool_episode
from nexrl.agents.tokens import MultiTurnTokens
from nexrl.config.schema import DataConfig, RolloutWorkerConfig
from nexrl.envs.local import LocalToolingEnv
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.tool_parsers import get_parser
from nexrl.registry import import_object
from nexrl.rewards.calls import RewardFn
from nexrl.rollout.workflow import RolloutWorkflow, Row, sample_to_trajectory
from nexrl.types import Trajectory


def _messages(data: Row, prompt_key: str) -> list[dict[str, object]]:
    prompt = data.get(prompt_key)
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt:
        return [dict(m) for m in prompt]
    raise ValueError(f"row {data.get('uid')!r}: column {prompt_key!r} is not text or messages")


def _reward(value: Any, traj: Trajectory) -> float:
    """A reward function's answer: a number, or a dict with `reward` (and `scores`)."""
    if isinstance(value, Mapping):
        if value.get("scores"):
            traj["scores"] = dict(value["scores"])
        return float(value["reward"])
    return float(value)


_ROLLOUT_DEFAULTS = RolloutWorkerConfig()


def _rollout_option(config: RolloutWorkerConfig | DictConfig | None, name: str) -> Any:
    """`config.<name>` (the `rollout_worker` section), or the schema's default when the
    workflow is built without one: the defaults are written once, in the schema."""
    return getattr(config, name, getattr(_ROLLOUT_DEFAULTS, name))


class _Base(RolloutWorkflow):
    """Shared options: `prompt_key` (the row's text or chat column), `system_prompt` (a
    system message when the prompt has none; the worker passes `data.system_prompt`),
    `prefix_messages` (messages put before every prompt, after the system message:
    instructions, worked examples), `max_tokens` and `temperature` per turn."""

    def __init__(
        self,
        config: RolloutWorkerConfig | DictConfig | None = None,
        reward_fn: RewardFn | None = None,
        prompt_key: str = DataConfig.prompt_key,
        max_tokens: int | None = None,
        temperature: float | None = None,
        system_prompt: str | None = None,
        prefix_messages: Sequence[Mapping[str, object]] = (),
    ) -> None:
        self.reward_fn = reward_fn
        self.prompt_key = prompt_key
        self.system_prompt = system_prompt
        self.prefix_messages = [dict(m) for m in prefix_messages]
        self.sampling = SamplingParams(
            max_new_tokens=max_tokens or _rollout_option(config, "max_tokens"),
            temperature=(
                temperature if temperature is not None else _rollout_option(config, "temperature")
            ),
            top_p=_rollout_option(config, "top_p"),
            top_k=_rollout_option(config, "top_k"),
        )

    def messages(self, data: Row) -> list[dict[str, object]]:
        """The opening chat of an episode: system message, prefix messages, the row's prompt."""
        prompt = _messages(data, self.prompt_key)
        system = [m for m in (*self.prefix_messages, *prompt) if m["role"] == "system"][:1]
        if not system and self.system_prompt is not None:
            system = [{"role": "system", "content": self.system_prompt}]
        rest = [m for m in (*self.prefix_messages, *prompt) if m["role"] != "system"]
        return [*system, *(dict(m) for m in rest)]

    async def _finish(self, traj: Trajectory, data: Row, completion: str | None) -> Trajectory:
        """Score the completion off the event loop: a slow reward (a symbolic check, code
        run against tests) must not hold up the other episodes on the loop. An async
        reward (one that answers an awaitable) is awaited."""
        traj["response"] = completion
        if self.reward_fn is not None:
            rest = {k: v for k, v in data.items() if k != "prompt"}
            prompt = data.get(self.prompt_key)
            value = await asyncio.to_thread(self.reward_fn, prompt, completion, **rest)
            if inspect.isawaitable(value):
                value = await value
            traj["reward"] = _reward(value, traj)
        return traj


def engine_tokenizer(engine: InferenceEngine) -> Any:
    """The engine's HF tokenizer (chat template, decode); a clear error when it has none."""
    tokenizer = getattr(engine, "tokenizer", None)
    if tokenizer is None:
        raise TypeError(f"{type(engine).__name__} has no `tokenizer`: agent workflows need one")
    return tokenizer


class SingleTurnWorkflow(_Base):
    """One assistant turn from the row's chat prompt."""

    async def arun_episode(self, engine: InferenceEngine, data: Row) -> Trajectory:
        tokens = MultiTurnTokens(engine_tokenizer(engine), self.messages(data))
        resp = await engine.agenerate(GenerationRequest(tokens.prompt_ids(), self.sampling))
        out = resp.outputs[0]
        tokens.add_assistant(out.output_ids, out.output_logprobs, out.output_versions)
        traj = sample_to_trajectory(tokens.samples()[0], finish_reason=out.finish_reason)
        return await self._finish(traj, data, out.text)


class ToolWorkflow(_Base):
    """A tool-using episode (`run_tool_episode`) with Python functions as tools.

    tools: import paths `pkg.module:function` registered in a `LocalToolingEnv`.
    parser: tool-call format (`hermes`, ...); max_turns: assistant turns per episode.
    on_rewrite: "error" or "split" when the template rewrites history (nexrl.agents.tokens).
    """

    def __init__(
        self,
        config: RolloutWorkerConfig | DictConfig | None = None,
        reward_fn: RewardFn | None = None,
        tools: list[str] | tuple[str, ...] = (),
        parser: str = "hermes",
        max_turns: int = 4,
        on_rewrite: Literal["error", "split"] = "error",
        system_prompt: str | None = None,
        **kwargs: Any,
    ) -> None:
        super().__init__(config, reward_fn, system_prompt=system_prompt, **kwargs)
        self.tools = [import_object(t) if isinstance(t, str) else t for t in tools]
        self.parser = get_parser(parser)
        self.max_turns = max_turns
        if on_rewrite not in ("error", "split"):
            raise ValueError(
                f"ToolWorkflow on_rewrite must be 'error' or 'split', got {on_rewrite!r}"
            )
        self.on_rewrite = on_rewrite

    async def arun_episode(self, engine: InferenceEngine, data: Row) -> list[Trajectory]:
        env = LocalToolingEnv(self.tools)
        episode = await run_tool_episode(
            engine,
            engine_tokenizer(engine),
            self.messages(data),
            env,
            self.parser,
            self.sampling,
            max_turns=self.max_turns,
            on_rewrite=self.on_rewrite,
        )
        last = next((m for m in reversed(episode.messages) if m["role"] == "assistant"), None)
        content = last["content"] if last else ""
        completion = content if content is None or isinstance(content, str) else str(content)
        finish = "abort" if episode.finish == "abort" else "stop"
        out = []
        for sample in episode.samples:
            traj = sample_to_trajectory(sample, finish_reason=finish, agent_finish=episode.finish)
            traj["agent_metrics"] = dict(episode.metrics)
            out.append(await self._finish(traj, data, completion))
        return out
