"""Rollout workflows and the executor that runs them (AReaL-lite's API, seed 004).

A `RolloutWorkflow` is the user's episode: `async arun_episode(engine, data)`
talks to an `InferenceEngine` (token ids in, ids + logprobs + per-token
versions out) as many turns as it likes and returns one trajectory, several
(a split episode), or None to reject the sample.

`WorkflowExecutor` wraps any `InferenceEngine` (the built-in engine, a
`RemoteBackend` against `nexrl serve`, or the pipeline's `ClientEngine`) and
adds the seed's batch API: `submit` / `wait` / `rollout` / `prepare_batch`.
Episodes run concurrently on one event loop in a background thread, so a
synchronous training script can drive them; the engine's own `agenerate`,
`update_weights` and `check_health` pass through.

Names that differ from the seed: the request is nexrl's `GenerationRequest`
(token ids; the seed's `LLMRequest` carries text), `rollout` is the seed's
`rollout_batch`, and results are lists of trajectory dicts, not a TensorDict
(the algorithm processor pads them).
"""

from __future__ import annotations

import asyncio
import inspect
import queue
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping
from concurrent.futures import Future
from typing import SupportsFloat, TypeAlias

from nexrl.agents.tokens import TokenSample
from nexrl.aio import EventLoopThread
from nexrl.inference.protocol import (
    Decoder,
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    WeightUpdateMeta,
)
from nexrl.types import Trajectory

# the list members are spelled out because `list` is invariant: an override may return
# `list[Trajectory]`, which is not a `list[Trajectory | TokenSample]`
EpisodeResult = (
    Trajectory
    | TokenSample
    | list[Trajectory]
    | list[TokenSample]
    | list[Trajectory | TokenSample]
    | None
)
Row: TypeAlias = Mapping[str, object]
"""An episode's data row, opaque to the runner (the workflow reads what it needs)."""


class RolloutWorkflow(ABC):
    """One episode of interaction with the policy (subclass and implement `arun_episode`).

    `aclose` is the close hook: the runner (the agent rollout worker at its stop, the
    `WorkflowExecutor` at `shutdown`) awaits it once, on the event loop the episodes ran
    on, so that what the workflow opened there (an MCP session, an HTTP client, a proxy
    server) is closed by the loop that owns it instead of leaking until exit."""

    @abstractmethod
    async def arun_episode(self, engine: InferenceEngine, data: Row) -> EpisodeResult:
        """Run one episode for the data row; None rejects it (nothing is trained)."""

    async def aclose(self) -> None:  # noqa: B027 (a hook: overriding it is optional)
        """Release what the episodes opened (default: nothing)."""


async def close_workflow(workflow: object) -> None:
    """Await a workflow's close hook; a workflow written without the base class (seed 004
    shows plain classes) may have none, or a plain `close()`."""
    hook = getattr(workflow, "aclose", None) or getattr(workflow, "close", None)
    if hook is not None:
        result = hook()
        if inspect.isawaitable(result):
            await result


def sample_to_trajectory(
    sample: TokenSample, tokenizer: Decoder | None = None, **extra: object
) -> Trajectory:
    """A `TokenSample` (a whole multi-turn sequence with its loss mask) as a pool trajectory:
    the tokens before the first policy token are the prompt, the rest the response (tool
    and user tokens inside it keep `loss_mask` 0)."""
    cut = sample.prompt_len
    traj: Trajectory = {
        "prompt_ids": sample.input_ids[:cut],
        "response_ids": sample.input_ids[cut:],
        "response_logprobs": sample.logprobs[cut:],
        "loss_mask": sample.loss_mask[cut:],
        "token_versions": sample.versions[cut:],
        "finish_reason": "stop",
    }
    fill_masked_versions(traj)
    if tokenizer is not None:
        traj["response"] = tokenizer.decode(traj["response_ids"], skip_special_tokens=True)
    traj.update(extra)
    return traj


def fill_masked_versions(traj: Trajectory) -> Trajectory:
    """Give environment tokens (loss_mask 0, version -1) the oldest policy version.

    The pool counts a trajectory's staleness from its oldest token version, so a -1 on a
    tool token would make every multi-turn trajectory look infinitely stale; the oldest
    version of a policy token is the trajectory's `model_version` (when not set)."""
    versions = traj.get("token_versions")
    mask = traj.get("loss_mask")
    if not versions or mask is None or len(mask) != len(versions):
        return traj
    policy = [v for v, m in zip(versions, mask, strict=True) if m and v >= 0]
    oldest = min(policy) if policy else max(int(traj.get("model_version") or 0), 0)
    traj["token_versions"] = [v if v >= 0 else oldest for v in versions]
    traj.setdefault("model_version", oldest)
    return traj


def _row(value: object) -> list[float] | None:
    """A tensor / array / list of one sequence as a list (a leading batch dim of 1 dropped)."""
    if value is None:
        return None
    if hasattr(value, "tolist"):
        rows = value.tolist()
    elif isinstance(value, Iterable):
        rows = list(value)
    else:
        raise TypeError(f"an episode's token field is {type(value).__name__}, not a sequence")
    if rows and isinstance(rows[0], list):
        if len(rows) != 1:
            raise ValueError(f"an episode's tensors hold {len(rows)} sequences; return one each")
        rows = rows[0]
    return rows


def from_tensor_dict(item: Row) -> Trajectory:
    """AReaL-lite's episode output (seed 004: `input_ids`, `loss_mask`, `logprobs`,
    `versions`, `rewards`, optional `attention_mask`; tensors of shape (1, L) or (L,)) as a
    trajectory: the tokens before the first loss-mask 1 are the prompt."""
    ids, mask = _row(item.get("input_ids")), _row(item.get("loss_mask"))
    if ids is None:
        raise ValueError("arun_episode returned a tensor dict whose `input_ids` is None")
    if mask is None:
        raise ValueError(
            "arun_episode returned `input_ids` without `loss_mask`: give loss_mask (1 on the "
            "tokens the policy sampled) so that the prompt and the response can be told apart"
        )
    keep = _row(item.get("attention_mask")) or [1] * len(ids)
    pick = [i for i, a in enumerate(keep) if a]
    ids, mask = [ids[i] for i in pick], [int(mask[i]) for i in pick]
    logprobs = _row(item.get("logprobs"))
    versions = _row(item.get("versions"))
    cut = mask.index(1) if 1 in mask else len(ids)
    traj: Trajectory = {
        "prompt_ids": [int(x) for x in ids[:cut]],
        "response_ids": [int(x) for x in ids[cut:]],
        "response_logprobs": [float(logprobs[i]) for i in pick][cut:]
        if logprobs is not None
        else None,
        "loss_mask": mask[cut:],
        "finish_reason": item.get("finish_reason", "stop"),
    }
    if versions is not None:
        traj["token_versions"] = [int(versions[i]) for i in pick][cut:]
    reward = item.get("rewards", item.get("reward"))
    if reward is not None:
        value = reward.tolist() if hasattr(reward, "tolist") else reward
        while isinstance(value, list):  # a (1,) or (1, 1) tensor
            value = value[0]
        if not isinstance(value, SupportsFloat | str):
            raise TypeError(f"an episode's reward is {type(value).__name__}, not a number")
        traj["reward"] = float(value)
    return traj


def as_trajectories(
    result: EpisodeResult, tokenizer: Decoder | None = None, version: int | None = None
) -> list[Trajectory] | None:
    """An episode's answer as a list of trajectory dicts (None stays None: rejected).

    A dict may be a trajectory or AReaL-lite's tensor dict (`from_tensor_dict`). Keys a
    trajectory may leave out are filled: `loss_mask` (all 1), `model_version` (`version`,
    the engine's when the episode started) when it has no per-token versions, and
    `response` (decoded with `tokenizer`)."""
    if result is None:
        return None
    items = result if isinstance(result, list) else [result]
    out = []
    for item in items:
        if isinstance(item, TokenSample):
            out.append(sample_to_trajectory(item, tokenizer))
            continue
        if not isinstance(item, dict):
            raise TypeError(
                f"arun_episode returned {type(item).__name__}; expected a trajectory dict, "
                "a TokenSample, a list of them, or None"
            )
        traj = from_tensor_dict(item) if _is_tensor_dict(item) else dict(item)
        if traj.get("loss_mask") is None and traj.get("response_ids") is not None:
            traj["loss_mask"] = [1] * len(traj["response_ids"])
        if traj.get("model_version") is None and not traj.get("token_versions"):
            traj["model_version"] = version
        if traj.get("response") is None and tokenizer is not None and "response_ids" in traj:
            traj["response"] = tokenizer.decode(traj["response_ids"], skip_special_tokens=True)
        out.append(fill_masked_versions(traj))
    return out


def _is_tensor_dict(item: Row) -> bool:
    return "input_ids" in item and "response_ids" not in item


class WorkflowExecutor:
    """The seed's rollout API on top of any `InferenceEngine` (see the module docstring).

    max_concurrent: episodes in flight at once (`prepare_batch` keeps this many running).
    """

    def __init__(self, engine: InferenceEngine, max_concurrent: int = 64) -> None:
        if max_concurrent < 1:
            raise ValueError(f"max_concurrent must be >= 1, got {max_concurrent}")
        self.engine = engine
        self.max_concurrent = max_concurrent
        self._results: queue.Queue[list[Trajectory] | None | BaseException] = queue.Queue()
        self._workflows: dict[int, RolloutWorkflow] = {}  # closed at `shutdown`
        self._pending = 0
        self._lock = threading.Lock()
        self._loop = EventLoopThread("workflow-executor")
        self._row_source: object = None  # the dataloader `_row_iter` reads (`_rows`)
        self._row_iter: Iterator[Row] = iter(())

    # -- the engine's own API ----------------------------------------------------------------
    @property
    def version(self) -> int:
        return self.engine.version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await self.engine.agenerate(request)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        self.engine.update_weights(meta)

    def check_health(self) -> bool:
        """The seed's name for `InferenceEngine.health`."""
        return self.engine.health()

    # -- batch API -------------------------------------------------------------------------
    def submit(self, data: Row, workflow: RolloutWorkflow) -> Future[None]:
        """Start one episode now; its result is collected by `wait`."""
        with self._lock:
            self._pending += 1
            self._workflows.setdefault(id(workflow), workflow)
        coro = self._episode(dict(data), workflow)
        return self._loop.submit(coro)

    async def _episode(self, data: Row, workflow: RolloutWorkflow) -> None:
        try:
            version = self.engine.version
            result = await workflow.arun_episode(self.engine, data)
            tokenizer = getattr(self.engine, "tokenizer", None)
            self._results.put(as_trajectories(result, tokenizer, version))
        except asyncio.CancelledError:
            raise
        except BaseException as exc:  # handed to the caller of wait()
            self._results.put(exc)

    def wait(
        self,
        count: int,
        timeout: float | None = None,
        should_accept: Callable[[list[Trajectory]], bool] | None = None,
    ) -> list[Trajectory]:
        """The trajectories of `count` accepted episodes (rejected ones do not count);
        TimeoutError if they are not done within `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        accepted: list[Trajectory] = []
        done = 0
        while done < count:
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = self._results.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"{done} of {count} episodes finished in {timeout}s") from None
            with self._lock:
                self._pending -= 1
            if isinstance(item, BaseException):
                raise item
            if item is None or (should_accept is not None and not should_accept(item)):
                continue
            accepted.extend(item)
            done += 1
        return accepted

    def rollout(self, data: Iterable[Row], workflow: RolloutWorkflow) -> list[Trajectory]:
        """Run one episode per row and wait for all (the seed's `rollout_batch`); rejected
        episodes are left out."""
        rows = list(data)
        for row in rows:
            self.submit(row, workflow)
        out: list[Trajectory] = []
        for _ in rows:
            out.extend(self._wait_any())
        return out

    def _wait_any(self) -> list[Trajectory]:
        item = self._results.get()
        with self._lock:
            self._pending -= 1
        if isinstance(item, BaseException):
            raise item
        return item or []

    def prepare_batch(
        self,
        dataloader: Iterable[Row] | Iterable[list[Row]],
        workflow: RolloutWorkflow,
        should_accept: Callable[[list[Trajectory]], bool] | None = None,
        batch_size: int | None = None,
    ) -> list[Trajectory]:
        """Asynchronous rollout with filtering: keep up to `max_concurrent` episodes running
        from `dataloader` (rows, or batches of rows) until `batch_size` episodes (default:
        the dataloader's `batch_size`) are accepted. Episodes still running when the batch
        is full count toward the next call (AReaL-lite's overlap of rollout and training)."""
        size = batch_size or getattr(dataloader, "batch_size", None)
        if not size:
            raise ValueError("prepare_batch needs batch_size (the dataloader has none)")
        rows = self._rows(dataloader)
        accepted: list[Trajectory] = []
        done = 0
        while done < size:
            while self._pending < self.max_concurrent:
                row = next(rows, None)
                if row is None:
                    break
                self.submit(row, workflow)
            if self._pending == 0:
                raise ValueError(f"the dataloader ran out after {done} of {size} episodes")
            item = self._wait_any()
            if item and (should_accept is None or should_accept(item)):
                accepted.extend(item)
                done += 1
        return accepted

    def _rows(self, dataloader: Iterable[Row] | Iterable[list[Row]]) -> Iterator[Row]:
        if self._row_source is not dataloader:
            self._row_source = dataloader
            self._row_iter = self._flatten(dataloader)
        return self._row_iter

    @staticmethod
    def _flatten(dataloader: Iterable[Row] | Iterable[list[Row]]) -> Iterator[Row]:
        for item in dataloader:
            yield from (item if isinstance(item, list) else [item])

    def shutdown(self) -> None:
        """Close every workflow it ran (`aclose`, on the episodes' loop), then stop the
        loop (running episodes are cancelled)."""
        with self._lock:
            workflows, self._workflows = list(self._workflows.values()), {}
        try:
            for workflow in workflows:
                self._loop.run(close_workflow(workflow))
        finally:
            self._loop.close()
