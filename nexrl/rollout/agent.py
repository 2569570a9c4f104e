"""`AgentRolloutWorker`: a `RolloutWorkflow` inside the nexrl pipeline (seed 000's agent worker).

For each task the worker runs `group_size` episodes of the configured workflow
concurrently (the GRPO group) on one event loop and hands their trajectories
on as one group. The engine the workflow talks to is a `ClientEngine`: the
worker's `LLMServiceClient` behind the `InferenceEngine` interface, so every
turn goes through the weight-sync block, the retries and the in-process or
remote backend of the run, and every policy token carries the weight version
that sampled it (a push between two turns shows in `token_versions`).

A turn aborted by a weight push is continued from where it stopped once the
new weights serve when `weight.enable_partial_rollout` is on (the turn's
tokens then carry both versions); otherwise the episode is ABORTED and the
task goes back to the front of its loader. An episode answering None drops
the task (StepResult.DROPPED).

All of a worker's episodes run on one event loop of its own, which lives as long as
the worker: a group's episodes, and while validating the episodes of several
validation tasks at once (`validate.concurrency`; the helper threads only wait for
them). A workflow therefore sees what AReaL-lite's workflows see, many concurrent
episodes on one loop, and may keep loop-bound state (an MCP session, an async HTTP
client) from one task to the next.
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import replace
from typing import TYPE_CHECKING

from omegaconf import OmegaConf

from nexrl.aio import EventLoopThread
from nexrl.config.schema import RolloutWorkerConfig
from nexrl.execute import execute
from nexrl.inference.protocol import (
    Decoder,
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    SampleResult,
    SamplingParams,
    WeightUpdateMeta,
)
from nexrl.registry import import_object
from nexrl.rollout.base import BaseRolloutWorker, RewardFn, RolloutContext
from nexrl.rollout.workflow import RolloutWorkflow, as_trajectories, close_workflow
from nexrl.types import JSONDict, StepResult, Task, Trajectory

if TYPE_CHECKING:
    from nexrl.inference.client import LLMServiceClient

DEFAULT_WORKFLOW = "nexrl.agents.workflows:ToolWorkflow"
_PUSH_POLL_S = 0.001


class ClientEngine:
    """An `InferenceEngine` over an `LLMServiceClient` (see the module docstring).

    continue_aborted: continue a turn a weight push aborted (partial rollout within a turn).
    wait_for_push: blocks until the new weights serve (the worker's weight-sync check).
    temperature: overrides every request's temperature (validation rollouts are greedy).
    executor: runs the blocking client calls of `agenerate`, from whichever loop awaits it
        (the worker's, or a proxy server's); None: that loop's default executor.
    """

    def __init__(
        self,
        client: LLMServiceClient,
        *,
        continue_aborted: bool = False,
        wait_for_push: Callable[[], object] | None = None,
        temperature: float | None = None,
        executor: Executor | None = None,
    ) -> None:
        self.client = client
        self._executor = executor
        self.continue_aborted = continue_aborted
        self._wait_for_push = wait_for_push
        self.temperature = temperature

    @property
    def version(self) -> int:
        return self.client.version

    @property
    def tokenizer(self) -> Decoder:
        return self.client.tokenizer

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await asyncio.get_running_loop().run_in_executor(
            self._executor, self.generate, request
        )

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        sampling = request.sampling
        if self.temperature is not None:
            sampling = replace(sampling, temperature=self.temperature)
        result = self.client.completion(prompt_ids=list(request.input_ids), **sampling.to_kwargs())
        outputs = [_output(c) for c in result["choices"]]
        if self.continue_aborted:
            outputs = [self._finish(request.input_ids, o, sampling) for o in outputs]
        return GenerationResponse(list(result["prompt_ids"]), outputs, rid=request.rid)

    def _finish(
        self, prompt: list[int], out: GenerationOutput, sampling: SamplingParams
    ) -> GenerationOutput:
        """Continue an aborted sample with the new weights until it really finishes."""
        while out.finish_reason == "abort" and len(out.output_ids) < sampling.max_new_tokens:
            if self._wait_for_push is not None:
                self._wait_for_push()
            rest = replace(
                sampling, n=1, max_new_tokens=sampling.max_new_tokens - len(out.output_ids)
            )
            more = self.client.completion(prompt_ids=[*prompt, *out.output_ids], **rest.to_kwargs())
            nxt = _output(more)
            out = GenerationOutput(
                out.output_ids + nxt.output_ids,
                out.output_logprobs + nxt.output_logprobs,
                out.output_versions + nxt.output_versions,
                nxt.finish_reason,
                out.text + nxt.text,
            )
        return out

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self.client.update_weights(meta)

    def pause(self) -> None:
        self.client.pause()

    def resume(self) -> None:
        self.client.resume()

    def abort(self, rid: str | None = None) -> None:
        self.client.abort(rid)

    def health(self) -> bool:
        target = getattr(self.client, "_engine", None) or getattr(self.client, "_remote", None)
        return bool(target.health()) if target is not None else True

    def shutdown(self) -> None:
        """The client's engine is shared by the run: it is not this adapter's to stop."""


def _output(choice: SampleResult) -> GenerationOutput:
    ids = list(choice["response_ids"])
    versions = list(choice.get("token_versions") or [])
    return GenerationOutput(
        ids,
        list(choice["response_logprobs"]),
        versions,
        choice["finish_reason"],
        choice["response"],
    )


def build_workflow(
    config: RolloutWorkerConfig, reward_fn: RewardFn | None, system_prompt: str | None = None
) -> RolloutWorkflow:
    """The configured workflow: `rollout_worker.workflow` (an import path; empty: the built-in
    tool workflow) called with `rollout_worker.workflow_kwargs`, plus `config` (this section),
    `reward_fn` and `system_prompt` (`data.system_prompt`) when its constructor takes
    parameters with those names."""
    spec = config.workflow or DEFAULT_WORKFLOW
    try:
        cls = import_object(spec)
    except Exception as exc:
        raise ValueError(f"rollout_worker.workflow={spec!r}: {exc}") from exc
    kwargs = dict(config.workflow_kwargs or {})
    if isinstance(kwargs.get("config"), dict):  # seed 004's `self.config.num_turns`
        kwargs["config"] = OmegaConf.create(kwargs["config"])
    params = inspect.signature(cls).parameters
    if "config" in params:
        kwargs.setdefault("config", config)
    if "reward_fn" in params:
        kwargs.setdefault("reward_fn", reward_fn)
    if "system_prompt" in params and system_prompt is not None:
        kwargs.setdefault("system_prompt", system_prompt)
    try:
        workflow = cls(**kwargs)
    except TypeError as exc:
        raise TypeError(f"rollout_worker.workflow={spec!r}: {exc} (workflow_kwargs)") from exc
    if not callable(getattr(workflow, "arun_episode", None)):
        raise TypeError(f"rollout_worker.workflow={spec!r} has no async arun_episode(engine, data)")
    return workflow


class AgentRolloutWorker(BaseRolloutWorker):
    """Runs `group_size` episodes of a workflow per task (see the module docstring)."""

    concurrent_steps = True  # a step only waits for its episodes on the worker's loop

    def __init__(
        self,
        config: RolloutWorkerConfig,
        llm_client: LLMServiceClient,
        context: RolloutContext,
        reward_fn: RewardFn | None = None,
        workflow: RolloutWorkflow | None = None,
    ) -> None:
        super().__init__(config, llm_client, context, reward_fn)
        self.workflow = workflow or build_workflow(config, reward_fn, context.system_prompt)
        self._episodes: EventLoopThread | None = None
        self._episodes_lock = threading.Lock()

    def engine(self, validate: bool) -> ClientEngine:
        return ClientEngine(
            self._llm_client,
            continue_aborted=validate or self._context.enable_partial_rollout,
            wait_for_push=self._block_until_pushed,
            temperature=self._context.validate_temperature if validate else None,
            executor=self._episode_loop().executor,
        )

    def step(self, task: Task) -> StepResult:
        validate = task.is_validate
        n = 1 if validate else self._config.group_size
        episodes = self._episode_loop().run(self._run_group(task.data, n, self.engine(validate)))
        kept = [e for e in episodes if e]
        if len(kept) < len(episodes):  # an episode answered None (or nothing): rejected
            return StepResult.DROPPED
        group = [t for e in kept for t in e]
        if any(t.get("finish_reason") == "abort" for t in group):
            task.aborts += 1
            self.tracker.increment("rollout/aborted_groups")
            return StepResult.ABORTED
        for t in group:
            t.setdefault("model_tag", self._model_tag())
            t.setdefault("loss_mask", [1] * len(t.get("response_ids") or []))
        return self._put_episodes(kept)

    async def _run_group(
        self, row: JSONDict, n: int, engine: ClientEngine
    ) -> list[list[Trajectory] | None]:
        version = engine.version
        runs = [self.workflow.arun_episode(engine, dict(row)) for _ in range(n)]
        results = await asyncio.gather(*runs)
        return [as_trajectories(r, engine.tokenizer, version) for r in results]

    def _episode_loop(self) -> EventLoopThread:
        """The worker's event loop (made on first use). Its executor has a thread for
        every episode that can be in a blocking call (a generation, a sync tool) at once."""
        with self._episodes_lock:
            if self._episodes is None:
                in_flight = max(self._config.group_size, self._context.validate_tasks_per_worker)
                threads = max(in_flight, min(32, (os.cpu_count() or 1) + 4))
                self._episodes = EventLoopThread(f"{self._module_name}-episodes", threads)
            return self._episodes

    def stop(self) -> None:
        """Stop the loop, close the workflow on its episodes' loop (its close hook), then
        stop that loop."""
        super().stop()
        with self._episodes_lock:
            episodes, self._episodes = self._episodes, None
        if episodes is not None:
            try:
                episodes.run(close_workflow(self.workflow))
            finally:
                episodes.close()

    def _block_until_pushed(self) -> None:
        wsc, tag = self._weight_sync_controller, self._model_tag()
        if wsc is None:
            return
        while execute(wsc.check_rollout_service_status, tag) == "block":
            time.sleep(_PUSH_POLL_S)
