"""The built-in rollout workers.

`SimpleRolloutWorker` generates and forwards (no reward: for pipelines that
score later). `SingleTurnRolloutWorker` generates a group of `group_size`
samples for one prompt, scores each with a plain reward function
`reward(prompt, completion, **row) -> float`, and hands the group on as one
unit so that a weight sync can never split it.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from nexrl.rollout.base import BaseRolloutWorker
from nexrl.types import DEFAULT_MODEL_TAG, Trajectory

TASK_META_SKIP = ("prompt",)


def make_trajectory(
    task: dict[str, Any], result: dict[str, Any], reward: float | None, model_tag: str
) -> Trajectory:
    """One trajectory from a task row and one sample of the client's result."""
    response_ids = list(result["response_ids"])
    return {
        "uid": task.get("uid"),
        "index": task.get("index"),
        "prompt": result.get("prompt", task.get("prompt")),
        "response": result["response"],
        "prompt_ids": list(result["prompt_ids"]),
        "response_ids": response_ids,
        "response_logprobs": list(result["response_logprobs"]),
        "loss_mask": [1] * len(response_ids),
        "reward": reward,
        "finish_reason": result["finish_reason"],
        "model_tag": model_tag,
        "model_version": result["model_version"],
        "token_versions": list(result.get("token_versions") or []),
    }


class SimpleRolloutWorker(BaseRolloutWorker):
    """Generate once per task; no reward."""

    def _sampling_kwargs(self) -> dict[str, Any]:
        cfg = self._config
        if self.is_validating_task:
            return {
                "n": 1,
                "max_tokens": int(cfg.get("max_tokens", 64)),
                "temperature": float(cfg.get("validate_temperature", 0.0)),
            }
        return {
            "n": int(cfg.get("group_size", 1)),
            "max_tokens": int(cfg.get("max_tokens", 64)),
            "temperature": float(cfg.get("temperature", 1.0)),
            "top_p": float(cfg.get("top_p", 1.0)),
            "top_k": int(cfg.get("top_k", -1)),
        }

    def _model_tag(self) -> str:
        return getattr(self._llm_client, "model_tag", DEFAULT_MODEL_TAG)

    def _prompt(self, task: dict[str, Any]) -> str | None:
        prompt = task.get(self._config.get("prompt_key", "prompt"))
        return prompt if isinstance(prompt, str) else None

    def score(self, task: dict[str, Any], result: dict[str, Any]) -> float | None:
        return None

    def step(self, task: dict[str, Any]) -> str | None:
        prompt = self._prompt(task)
        if prompt is None:
            return None
        out = self._llm_client.completion(prompt, **self._sampling_kwargs())
        shared = {k: v for k, v in out.items() if k != "choices"}
        choices = [{**shared, **c} for c in out.get("choices") or [{}]]
        tag = self._model_tag()
        group = [make_trajectory(task, c, self.score(task, c), tag) for c in choices]
        return self._put_trajectory_group(group)


class SingleTurnRolloutWorker(SimpleRolloutWorker):
    """Generate a group, score each sample with `reward_fn`."""

    def __init__(self, config: Mapping[str, Any], llm_client: Any, reward_fn: Any) -> None:
        super().__init__(config, llm_client)
        self._reward_fn = reward_fn

    def score(self, task: dict[str, Any], result: dict[str, Any]) -> float:
        row = {k: v for k, v in task.items() if k not in TASK_META_SKIP and not k.startswith("_")}
        return float(self._reward_fn(self._prompt(task), result["response"], **row))
