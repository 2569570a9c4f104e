"""The built-in rollout workers.

`SingleTurnRolloutWorker` generates a group of `group_size` samples for one
prompt, scores each with a plain reward function
`reward(prompt, completion, **row) -> float`, and hands the group on as one
unit. `SimpleRolloutWorker` is the same without a reward (for pipelines that
score later). Both are a `BaseRolloutWorker` plus a `GroupSampler`
(composition): the sampler owns generation, aborts and partial rollout.
"""

from __future__ import annotations

import time
from functools import cached_property
from typing import TYPE_CHECKING

from nexrl.config.schema import RolloutWorkerConfig
from nexrl.execute import execute
from nexrl.rollout.base import BaseRolloutWorker, RolloutContext, wired
from nexrl.rollout.partial import aborted, continue_aborted, split_choices
from nexrl.types import JSONDict, StepResult, Task, Trajectory

if TYPE_CHECKING:
    from nexrl.inference.client import LLMServiceClient
    from nexrl.inference.protocol import CompletionResult, SamplingKwargs

_PUSH_POLL_S = 0.001
Prompt = str | list[JSONDict]


def chat_prompt(row: JSONDict, prompt_key: str, system_prompt: str | None) -> Prompt:
    """The row's prompt: text, or chat messages (a list of {role, content}); with a
    `system_prompt`, a text prompt becomes [system, user] and a chat gains the system
    message unless it has one."""
    prompt = row.get(prompt_key)
    where = f"task {row.get('uid')!r}: column {prompt_key!r} (data.prompt_key)"
    if isinstance(prompt, str):
        if system_prompt is None:
            return prompt
        prompt = [{"role": "user", "content": prompt}]
    if not isinstance(prompt, list) or not prompt:
        raise ValueError(f"{where} is {type(prompt).__name__}, expected text or chat messages")
    messages: list[JSONDict] = []
    for i, msg in enumerate(prompt):
        if (
            not isinstance(msg, dict)
            or not isinstance(msg.get("role"), str)
            or "content" not in msg
        ):
            raise ValueError(f"{where}: message {i} needs a string 'role' and a 'content'")
        messages.append(msg)
    if system_prompt is not None and messages[0]["role"] != "system":
        messages = [{"role": "system", "content": system_prompt}, *messages]
    return messages


def make_trajectory(
    task: JSONDict, result: CompletionResult, reward: float | None, model_tag: str
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


class GroupSampler:
    """Samples one group for a task; aborted samples are continued, re-queued or deferred
    (xtuner's partial rollout and tail batch; docs/async.md)."""

    def __init__(self, worker: BaseRolloutWorker) -> None:
        self._worker = worker

    def sampling_kwargs(self, validate: bool) -> SamplingKwargs:
        """The group's request options. One turn, no follow-up: the engine need not keep
        the samples in its prefix cache (`cache_output`; the prompt is kept)."""
        cfg, ctx = self._worker._config, self._worker._context
        if validate:
            return {
                "n": ctx.validate_samples,
                "max_tokens": cfg.max_tokens,
                "temperature": ctx.validate_temperature,
                "cache_output": False,
            }
        return {
            "n": cfg.group_size,
            "max_tokens": cfg.max_tokens,
            "temperature": cfg.temperature,
            "top_p": cfg.top_p,
            "top_k": cfg.top_k,
            "cache_output": False,
        }

    def first_request(self, prompt: Prompt, kwargs: SamplingKwargs) -> CompletionResult:
        """Text prompts go as text; chat prompts are rendered with the tokenizer's chat
        template once, here, and sent as token ids (nothing is re-tokenized later)."""
        client = self._worker._llm_client
        if isinstance(prompt, str):
            return client.completion(prompt, **kwargs)
        ids = client.tokenizer.apply_chat_template(
            prompt, add_generation_prompt=True, tokenize=True, return_dict=False
        )
        return {**client.completion(prompt_ids=list(ids), **kwargs), "prompt": prompt}

    def sample(self, task: Task, prompt: Prompt) -> list[CompletionResult] | StepResult:
        """The group's samples, or ABORTED / DEFERRED with `task` updated for its next try."""
        worker, ctx = self._worker, self._worker._context
        client, tracker = worker._llm_client, worker.tracker
        kwargs = self.sampling_kwargs(task.is_validate)
        saved, task.partial = task.partial, None
        if saved:
            choices = [c.copy() for c in saved]
        else:
            choices = split_choices(self.first_request(prompt, kwargs))
            if choices:
                worker.warn_unknown_tokens(choices[0].get("prompt_ids") or [], task)
        while aborted(choices):
            if not saved:  # a restored partial was counted when it was aborted
                task.aborts += 1
                tracker.increment("rollout/aborted_groups")
            saved = None
            protected = task.is_validate or task.tail
            keep = protected or ctx.enable_partial_rollout
            limit = ctx.tail_batch_candidate_steps
            if not protected and limit and task.aborts > limit:
                task.partial = choices if keep else None
                return StepResult.DEFERRED
            if not keep:
                return StepResult.ABORTED
            n = len(aborted(choices))
            self._wait_for_push()
            choices = continue_aborted(client, choices, kwargs)
            tracker.increment("rollout/partial_continuations", n)
        return choices

    def _wait_for_push(self) -> None:
        """Continue as soon as the new weights serve: the engine idles until then, so
        this polls faster than the client's generic weight-sync wait."""
        tag = self._worker._model_tag()
        wsc = wired(self._worker._weight_sync_controller, "weight-sync controller")
        while execute(wsc.check_rollout_service_status, tag) == "block":
            time.sleep(_PUSH_POLL_S)


class SingleTurnRolloutWorker(BaseRolloutWorker):
    """Generate a group, score each sample with `reward_fn` (None: no reward, the
    `simple` worker), drop uninformative groups under DAPO dynamic sampling."""

    concurrent_steps = True  # per-task state lives in `step` and `current_task`

    @cached_property
    def sampler(self) -> GroupSampler:
        return GroupSampler(self)

    def _prompt(self, row: JSONDict) -> Prompt:
        return chat_prompt(row, self._context.prompt_key, self._context.system_prompt)

    def step(self, task: Task) -> StepResult:
        row = task.data
        choices = self.sampler.sample(task, self._prompt(row))
        if isinstance(choices, StepResult):
            return choices
        tag = self._model_tag()
        scored = self._reward_fn is not None
        rewards = self.score_group(row, choices) if scored else [None] * len(choices)
        group = []
        for c, reward in zip(choices, rewards, strict=True):
            traj = make_trajectory(row, c, reward, tag)
            if c.get("scores"):
                traj["scores"] = c["scores"]
            traj["rollout_aborts"] = task.aborts
            traj["continuations"] = int(c.get("continuations", 0))
            group.append(traj)
        if self._drop_uninformative(group):
            return StepResult.DROPPED
        return self._put_trajectory_group(group)

    def _drop_uninformative(self, group: list[Trajectory]) -> bool:
        """DAPO dynamic sampling: a training group with one reward value teaches nothing."""
        if self.is_validating_task or not self._context.dynamic_sampling:
            return False
        return len({t["reward"] for t in group}) == 1


class SimpleRolloutWorker(SingleTurnRolloutWorker):
    """Generate a group per task; no reward (a later stage scores it)."""

    def __init__(
        self, config: RolloutWorkerConfig, llm_client: LLMServiceClient, context: RolloutContext
    ) -> None:
        super().__init__(config, llm_client, context, reward_fn=None)
