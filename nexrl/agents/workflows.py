"""Built-in `RolloutWorkflow`s: one chat turn, and a multi-turn tool-using episode.

Both render the row's prompt (`prompt_key`: text or chat messages) with the
engine's chat template, sample token-exact, and score the final answer with
`reward_fn(prompt, completion, **row)` when they have one (otherwise the
rollout worker's `reward_fn` scores the trajectory's `response`).
"""

from __future__ import annotations

from typing import Any

from nexrl.agents.loop import run_tool_episode
from nexrl.agents.tokens import MultiTurnTokens
from nexrl.envs.local import LocalToolingEnv
from nexrl.inference.protocol import GenerationRequest, InferenceEngine, SamplingParams
from nexrl.inference.tool_parsers import get_parser
from nexrl.registry import import_object
from nexrl.rollout.workflow import RolloutWorkflow, sample_to_trajectory
from nexrl.types import Trajectory


def _messages(data: dict[str, Any], prompt_key: str) -> list[dict[str, Any]]:
    prompt = data.get(prompt_key)
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and prompt:
        return [dict(m) for m in prompt]
    raise ValueError(f"row {data.get('uid')!r}: column {prompt_key!r} is not text or messages")


class _Base(RolloutWorkflow):
    def __init__(
        self,
        config: Any = None,
        reward_fn: Any = None,
        prompt_key: str = "prompt",
        max_tokens: int | None = None,
        temperature: float | None = None,
    ) -> None:
        self.reward_fn = reward_fn
        self.prompt_key = prompt_key
        self.sampling = SamplingParams(
            max_new_tokens=max_tokens or getattr(config, "max_tokens", 64),
            temperature=(
                temperature if temperature is not None else getattr(config, "temperature", 1.0)
            ),
            top_p=getattr(config, "top_p", 1.0),
            top_k=getattr(config, "top_k", -1),
        )

    def _finish(self, traj: Trajectory, data: dict[str, Any], completion: str) -> Trajectory:
        traj["response"] = completion
        if self.reward_fn is not None:
            rest = {k: v for k, v in data.items() if k != "prompt"}
            traj["reward"] = float(self.reward_fn(data.get(self.prompt_key), completion, **rest))
        return traj


class SingleTurnWorkflow(_Base):
    """One assistant turn from the row's chat prompt."""

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> Trajectory:
        tokens = MultiTurnTokens(engine.tokenizer, _messages(data, self.prompt_key))
        resp = await engine.agenerate(GenerationRequest(tokens.prompt_ids(), self.sampling))
        out = resp.outputs[0]
        tokens.add_assistant(out.output_ids, out.output_logprobs, out.output_versions)
        traj = sample_to_trajectory(tokens.samples()[0], finish_reason=out.finish_reason)
        return self._finish(traj, data, out.text)


class ToolWorkflow(_Base):
    """A tool-using episode (`run_tool_episode`) with Python functions as tools.

    tools: import paths `pkg.module:function` registered in a `LocalToolingEnv`.
    parser: tool-call format (`hermes`, ...); max_turns: assistant turns per episode.
    on_rewrite: "error" or "split" when the template rewrites history (nexrl.agents.tokens).
    """

    def __init__(
        self,
        config: Any = None,
        reward_fn: Any = None,
        tools: list[str] | tuple[str, ...] = (),
        parser: str = "hermes",
        max_turns: int = 4,
        on_rewrite: str = "error",
        **kwargs: Any,
    ) -> None:
        super().__init__(config, reward_fn, **kwargs)
        self.tools = [import_object(t) if isinstance(t, str) else t for t in tools]
        self.parser = get_parser(parser)
        self.max_turns = max_turns
        self.on_rewrite = on_rewrite

    async def arun_episode(self, engine: InferenceEngine, data: dict[str, Any]) -> list[Trajectory]:
        env = LocalToolingEnv(self.tools)
        episode = await run_tool_episode(
            engine,
            engine.tokenizer,
            _messages(data, self.prompt_key),
            env,
            self.parser,
            self.sampling,
            max_turns=self.max_turns,
            on_rewrite=self.on_rewrite,
        )
        last = next((m for m in reversed(episode.messages) if m["role"] == "assistant"), None)
        completion = last["content"] if last else ""
        finish = "abort" if episode.finish == "abort" else "stop"
        out = []
        for sample in episode.samples:
            traj = sample_to_trajectory(sample, finish_reason=finish, agent_finish=episode.finish)
            traj["agent_metrics"] = dict(episode.metrics)
            out.append(self._finish(traj, data, completion))
        return out
