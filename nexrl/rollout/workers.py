"""The built-in rollout workers.

`SimpleRolloutWorker` generates and forwards (no reward: for pipelines that
score later). `SingleTurnRolloutWorker` generates a group of `group_size`
samples for one prompt, scores each with a plain reward function
`reward(prompt, completion, **row) -> float`, and hands the group on as one
unit so that a weight sync can never split it.
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

from nexrl.distributed import execute
from nexrl.rollout.base import BaseRolloutWorker
from nexrl.rollout.partial import aborted, continue_aborted, split_choices
from nexrl.types import Trajectory
from nexrl.weight_sync import TAIL_KEY

ABORTS_KEY = "_nexrl_aborts"  # times this task's generation was aborted by a weight push
PARTIAL_KEY = "_nexrl_partial"  # samples kept from an aborted generation (partial rollout)

TASK_META_SKIP = ("prompt",)
_PUSH_POLL_S = 0.001


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

    def _prompt(self, task: dict[str, Any]) -> str | None:
        prompt = task.get(self._config.get("prompt_key", "prompt"))
        return prompt if isinstance(prompt, str) else None

    def score(self, task: dict[str, Any], result: dict[str, Any]) -> float | None:
        return None

    def step(self, task: dict[str, Any]) -> str | None:
        prompt = self._prompt(task)
        if prompt is None:
            return None
        choices = self._generate(task, prompt)
        if isinstance(choices, str):  # "aborted" or "deferred"
            return choices
        tag = self._model_tag()
        aborts = int(task.get(ABORTS_KEY, 0))
        group = [make_trajectory(task, c, self.score(task, c), tag) for c in choices]
        for traj, c in zip(group, choices, strict=True):
            traj["rollout_aborts"] = aborts
            traj["continuations"] = int(c.get("continuations", 0))
        if self._drop_uninformative(group):
            return "dropped"
        return self._put_trajectory_group(group)

    def _generate(self, task: dict[str, Any], prompt: str) -> list[dict[str, Any]] | str:
        """The group's samples; aborted ones are continued, re-queued or deferred (xtuner)."""
        kwargs = self._sampling_kwargs()
        saved = task.get(PARTIAL_KEY)
        if saved is None:
            choices = split_choices(self._llm_client.completion(prompt, **kwargs))
        else:
            choices = [dict(c) for c in saved]
        aborts = int(task.get(ABORTS_KEY, 0))
        while aborted(choices):
            if saved is None:  # a restored partial was counted when it was aborted
                aborts += 1
                self._activity_tracker.increment("rollout/aborted_groups")
            saved = None
            protected = self.is_validating_task or bool(task.get(TAIL_KEY))
            keep = protected or self._config.get("enable_partial_rollout", False)
            limit = int(self._config.get("tail_batch_candidate_steps", 0) or 0)
            if not protected and limit and aborts > limit:
                self._defer_to_tail(task, aborts, choices if keep else None)
                return "deferred"
            if not keep:
                task[ABORTS_KEY] = aborts
                task.pop(PARTIAL_KEY, None)
                return "aborted"
            n = len(aborted(choices))
            self._wait_for_push()
            choices = continue_aborted(self._llm_client, choices, kwargs)
            self._activity_tracker.increment("rollout/partial_continuations", n)
        task[ABORTS_KEY] = aborts
        task.pop(PARTIAL_KEY, None)  # a re-queue after a stale drop starts afresh
        return choices

    def _wait_for_push(self) -> None:
        """Continue as soon as the new weights serve: the engine idles until then, so
        this polls faster than the client's generic weight-sync wait."""
        if self._weight_sync_controller is None:
            return
        check, tag = self._weight_sync_controller.check_rollout_service_status, self._model_tag()
        while execute(check, tag) == "block":
            time.sleep(_PUSH_POLL_S)

    def _defer_to_tail(
        self, task: dict[str, Any], aborts: int, partial: list[dict[str, Any]] | None
    ) -> None:
        clean = {k: v for k, v in task.items() if not k.startswith("_nexrl_validate")}
        clean = {**clean, ABORTS_KEY: aborts, PARTIAL_KEY: partial}
        if partial is None:
            clean.pop(PARTIAL_KEY)
        execute(self._weight_sync_controller.add_tail_candidate, self._model_tag(), clean)

    def _drop_uninformative(self, group: list[Trajectory]) -> bool:
        """DAPO dynamic sampling: a training group with one reward value teaches nothing."""
        if self.is_validating_task or not self._config.get("dynamic_sampling", False):
            return False
        if len({t["reward"] for t in group}) > 1:
            return False
        self._activity_tracker.increment("groups_dropped/dynamic_sampling")
        return True


class SingleTurnRolloutWorker(SimpleRolloutWorker):
    """Generate a group, score each sample with `reward_fn`."""

    def __init__(self, config: Mapping[str, Any], llm_client: Any, reward_fn: Any) -> None:
        super().__init__(config, llm_client)
        self._reward_fn = reward_fn

    def score(self, task: dict[str, Any], result: dict[str, Any]) -> float:
        row = {k: v for k, v in task.items() if k not in TASK_META_SKIP and not k.startswith("_")}
        return float(self._reward_fn(self._prompt(task), result["response"], **row))
