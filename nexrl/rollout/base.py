"""Rollout workers: take a task, produce trajectories, hand them on.

`BaseRolloutWorker` owns the loop; subclasses implement `step(task)` only, where
`task` is the `Task` (it reads like the loader's row: `task["prompt"]`,
`task.get(...)`, `"prompt" in task`; the row itself is `task.data`) and the answer
a `StepResult` (or its string, or None for "failed before a trajectory existed",
as in seed 000). The loop never routes a task itself: it gets tasks from the
task owner (`TaskAdmission.acquire`, which applies admission) and gives every
task back with the step's result (`TaskAdmission.complete`), which re-queues,
retries, counts or defers it (nexrl/rollout/admission.py). An exception inside `step` is
reported through the activity tracker and counts as FAIL, so no task is lost.

Groups are formed by episode. A training task's trajectories are collected while
`step` runs and go to the pool as one group when it returns SUCCESS:

- `_put_trajectory_group(trajs)`: each trajectory is one episode (a single-turn group);
- `_put_episodes([[...], ...])`: one list per episode (a multi-turn episode may be
  several trajectories);
- `_put_trajectory(traj)`: one episode, as in seed 000's custom worker. A step that
  puts fewer than `rollout_worker.group_size` episodes is called again for the same
  task until the group is complete, so a worker that returns one trajectory per step
  trains under any `group_size`.

More episodes than `group_size`, or SUCCESS with nothing put, is an error naming
the worker and the task (the task is retried, then counted failed), never a wait.

Trajectories are completed before they are handed on: `uid`, `task_id` and
`model_tag` come from the current task and client; a trajectory written as in the
seed's custom-worker example (prompt and response text only) gets its token ids,
logprobs and versions from the client result it came from (the `response` text the
client returned names its sample; equal text does not), and its reward from
`reward_fn` when it has none. A trajectory still missing a required key raises an
error that names it. The trajectories of an episode that made several share an
`episode_id`: the group's advantage statistics count the episode once.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, TypeVar

from omegaconf import DictConfig

from nexrl.config.schema import RolloutWorkerConfig
from nexrl.execute import execute
from nexrl.module import BLOCKING_GET_WAIT_S, LoopModule, LoopThread
from nexrl.protocols import TaskAdmissionLike, TrajectoryPoolLike, ValidatorLike, WeightSyncLike
from nexrl.rewards.runner import RewardCall, RewardOutcome, RewardRunner
from nexrl.rollout.helpers import HelperThreads
from nexrl.rollout.sample_policy import resolve_inflight, resolve_partial
from nexrl.types import DEFAULT_MODEL_TAG, StepResult, Task, Trajectory, check_trajectory

if TYPE_CHECKING:
    from nexrl.inference.client import LLMServiceClient
    from nexrl.inference.protocol import CompletionResult
    from nexrl.monitoring.activity import ActivityTrackerProxy
    from nexrl.types import JSONDict, JSONValue

logger = logging.getLogger(__name__)
T = TypeVar("T")

RewardFn = Callable[..., float]
_TOKEN_KEYS = ("prompt_ids", "response_ids", "response_logprobs", "finish_reason")
_VERSION_KEYS = ("model_version", "token_versions")


@dataclass(frozen=True)
class RolloutContext:
    """What a rollout worker needs from config sections other than `rollout_worker`."""

    prompt_key: str
    validate_temperature: float
    validate_samples: int
    source_key: str
    enable_partial_rollout: bool
    tail_batch_candidate_steps: int
    dynamic_sampling: bool
    system_prompt: str | None
    validate_tasks_per_worker: int = 1

    @classmethod
    def from_config(cls, cfg: DictConfig, inflight_capable: bool = True) -> RolloutContext:
        """`inflight_capable`: the engine can swap weights under running requests (it
        decides whether `weight.enable_partial_rollout: null` is on)."""
        inflight = resolve_inflight(cfg.weight, inflight_capable)
        return cls(
            prompt_key=cfg.data.prompt_key,
            validate_temperature=cfg.validate.temperature,
            validate_samples=cfg.validate.n_samples,
            source_key=cfg.validate.source_key,
            enable_partial_rollout=resolve_partial(cfg.weight, inflight),
            tail_batch_candidate_steps=cfg.weight.tail_batch_candidate_steps,
            dynamic_sampling=cfg.algorithm.dynamic_sampling,
            system_prompt=cfg.data.system_prompt,
            validate_tasks_per_worker=-(
                -cfg.validate.concurrency // cfg.rollout_worker.num_workers
            ),
        )


def wired(ref: T | None, what: str) -> T:
    """`ref`, set by the wiring (`set_module_references`, `set_activity_tracker`)."""
    if ref is None:
        raise RuntimeError(f"rollout worker: no {what}; the system wires it before the loop runs")
    return ref


class BaseRolloutWorker(LoopModule):
    """Pulls tasks from the task owner, calls `step`, gives each task back with its result.

    While validating, a worker whose class sets `concurrent_steps = True` (its `step`
    keeps no per-task state on `self` but `current_task`, which is per thread) runs
    `validate_tasks_per_worker` validation tasks side by side on helper threads, so that
    a validation set reaches the engine as one batch instead of one task per worker at
    a time. The loop waits while they run and takes what comes back after them."""

    concurrent_steps = False

    def __init__(
        self,
        config: RolloutWorkerConfig,
        llm_client: LLMServiceClient,
        context: RolloutContext,
        reward_fn: RewardFn | None = None,
    ) -> None:
        super().__init__()
        self._config = config
        self._context = context
        self._llm_client = llm_client
        self._reward_fn = reward_fn
        self._rewards = (
            None
            if reward_fn is None
            else RewardRunner(
                reward_fn,
                timeout_s=config.reward_timeout_s,
                use_process_pool=config.reward_process_pool > 0,
                max_workers=max(1, config.reward_process_pool),
            )
        )
        self._is_running_validate = False
        self._unk_warned = False
        self._per_thread = threading.local()  # `current_task`, one per running step
        self._helpers: HelperThreads | None = None  # validation tasks side by side
        self._trajectory_pool: TrajectoryPoolLike | None = None
        self._admission: TaskAdmissionLike | None = None
        self._weight_sync_controller: WeightSyncLike | None = None
        self._validator: ValidatorLike | None = None
        self._loop = LoopThread(f"rollout-{id(self):x}", self._loop_once)

    def set_module_references(
        self,
        trajectory_pool: TrajectoryPoolLike,
        task_admission: TaskAdmissionLike,
        weight_sync_controller: WeightSyncLike,
        validator: ValidatorLike | None = None,
    ) -> None:
        """Tasks come from and go back to `task_admission`; groups go to the pool,
        validation trajectories to `validator`; the client asks `weight_sync_controller`
        whether a push holds new requests."""
        self._trajectory_pool = trajectory_pool
        self._admission = task_admission
        self._weight_sync_controller = weight_sync_controller
        self._validator = validator
        self._llm_client.set_weight_sync_controller(weight_sync_controller)

    # -- lifecycle ---------------------------------------------------------
    def run(self) -> None:
        if self._admission is None or self._activity_tracker is None:
            raise RuntimeError(f"{self._module_name}: set module references and tracker first")
        super().run()

    def begin_validate(self) -> None:
        """Seed 000: the controller announces validation (tasks come from the validation
        loader until `end_validate`; the task owner decides which loader serves). Helper
        threads take validation tasks beside the loop (see the class docstring)."""
        self._is_running_validate = True
        count = self._context.validate_tasks_per_worker if self.concurrent_steps else 1
        if count > 1:
            if self._helpers is None:
                name = f"{self._module_name}-validate"
                self._helpers = HelperThreads(name, count, self._validate_tasks)
            self._helpers.start()

    def end_validate(self) -> None:
        self._is_running_validate = False
        if self._helpers is not None:  # done: their tasks came back and the loader is dry
            self._helpers.wait(BLOCKING_GET_WAIT_S)

    def _validate_tasks(self) -> None:
        """A helper's round: take tasks until the validation loader runs dry; a task that
        comes back after the last helper is done (a retry) is taken by the worker's loop."""
        while self._is_running_validate:
            task = self._get_rollout_task()
            if task is None:
                return
            self._run_task(task)

    def health_check(self) -> bool:
        helpers_ok = self._helpers is None or self._helpers.error is None
        return super().health_check() and helpers_ok

    @property
    def tracker(self) -> ActivityTrackerProxy:
        """The activity tracker proxy (set by the system before the loop runs)."""
        return wired(self._activity_tracker, "activity tracker")

    @property
    def current_task(self) -> Task | None:
        """The task whose `step` runs on the calling thread (None outside a step)."""
        return getattr(self._per_thread, "task", None)

    @current_task.setter
    def current_task(self, task: Task | None) -> None:
        self._per_thread.task = task

    # -- the loop ------------------------------------------------------------
    def _loop_once(self) -> bool:
        if self._helpers is not None and self._helpers.busy:
            return False  # validation tasks go to the helpers (all start together)
        task = self._get_rollout_task()
        if task is None:
            return False
        self._run_task(task)
        return True

    def _run_task(self, task: Task) -> None:
        self.current_task = task
        tracker = self.tracker
        with tracker.track(self._module_name, "rollout", auto_report_errors=False):
            try:
                result = self._run_steps(task)
            except Exception as exc:  # reported, then the task owner retries or counts it
                tracker.report_exception(self._module_name, "rollout step", exc)
                result = StepResult.FAIL
            finally:
                self._per_thread.episodes = None
            execute(wired(self._admission, "task owner").complete, self._model_tag(), task, result)

    def _run_steps(self, task: Task) -> StepResult:
        """`step` until the task's group is complete, then the group into the pool."""
        need = self._config.group_size
        episodes: list[list[Trajectory]] = []
        self._per_thread.episodes = episodes
        for _ in range(need):
            before = len(episodes)
            result = StepResult.of(self.step(task))
            if result is not StepResult.SUCCESS or task.is_validate:
                return result
            if len(episodes) == before or len(episodes) >= need:
                break
        return self._put_group(task, episodes, need)

    def _put_group(self, task: Task, episodes: list[list[Trajectory]], need: int) -> StepResult:
        where = f"{type(self).__name__}.step on task {task.uid!r}"
        if not episodes:
            raise GroupSizeError(
                f"{where} returned success but put no trajectory: hand them on with "
                "self._put_trajectory / self._put_trajectory_group, or return 'fail'"
            )
        if len(episodes) != need:
            raise GroupSizeError(
                f"{where} put {len(episodes)} episodes but rollout_worker.group_size={need}: "
                f"put one group of {need} per task (self._put_trajectory_group), or one "
                f"trajectory per step call (self._put_trajectory; step is then called {need} "
                "times), or set rollout_worker.group_size"
            )
        group = [t for episode in episodes for t in episode]
        for t in group:
            check_trajectory(t)
        pool = wired(self._trajectory_pool, "trajectory pool")
        return StepResult.of(execute(pool.put_trajectory_group, group))

    def step(self, task: Task) -> StepResult | str | None:
        """Turn one task into trajectories and hand them on (see module docstring)."""
        raise NotImplementedError

    def _model_tag(self) -> str:
        return getattr(self._llm_client, "model_tag", DEFAULT_MODEL_TAG)

    @property
    def is_validating_task(self) -> bool:
        """True while `step` runs on a validation task."""
        return self.current_task is not None and self.current_task.is_validate

    # -- data flow (seed 000 names) ------------------------------------------------
    def _get_rollout_task(self) -> Task | None:
        owner = wired(self._admission, "task owner")
        return execute(owner.acquire, self._model_tag(), BLOCKING_GET_WAIT_S)

    def _put_rollout_task(self, task: JSONDict | Task) -> bool:
        """Give a task back to the front of its loader (through the task owner)."""
        if not isinstance(task, Task):
            validate = self.is_validating_task
            task = Task(data=dict(task), is_validate=validate)
        execute(wired(self._admission, "task owner").requeue, task)
        return True

    def _put_trajectory(self, trajectory: Trajectory) -> StepResult:
        """Hand on one trajectory as one episode of the task's group (seed 000)."""
        return self._put_episodes([[trajectory]])

    def _put_trajectory_group(self, trajectories: list[Trajectory]) -> StepResult:
        """Hand on single-turn episodes, one trajectory each (the whole group at once)."""
        return self._put_episodes([[t] for t in trajectories])

    def _put_episodes(self, episodes: list[list[Trajectory]]) -> StepResult:
        """Hand on episodes (a list of trajectories each). Training groups go to the pool
        as one unit once the step is done; validation trajectories go to the validator."""
        task, tag = self.current_task, self._model_tag()
        done = [[self._complete_trajectory(t, task, tag) for t in e] for e in episodes]
        for episode in (e for e in done if len(e) > 1):  # counted once in its group's
            eid = uuid.uuid4().hex  # statistics (nexrl/algorithms/advantages.py)
            for t in episode:
                t.setdefault("episode_id", eid)
        if task is not None and task.is_validate:
            for episode in done:
                for t in episode:
                    execute(wired(self._validator, "validator").put_trajectory, t)
            return StepResult.SUCCESS
        collected = getattr(self._per_thread, "episodes", None)
        if collected is None:  # outside a task's step (a direct call): straight to the pool
            group = [t for e in done for t in e]
            for t in group:
                check_trajectory(t)
            pool = wired(self._trajectory_pool, "trajectory pool")
            return StepResult.of(execute(pool.put_trajectory_group, group))
        collected.extend(done)
        return StepResult.SUCCESS

    # -- validation in a custom step (seed 000 "Validation Usage") ---------------------
    # While `_is_running_validate` is set, the loop hands `step` tasks of the validation
    # loader; these members let a step written as in the seed branch on the flag.
    def _get_validate_task(self) -> Task:
        """The validation task this step was given. A training task already running when
        validation began is returned as is: `_put_validate_trajectory` then sends its
        trajectory to the pool, so neither side gets the other's samples."""
        task = self.current_task
        if task is None:
            raise RuntimeError(
                f"{type(self).__name__}._get_validate_task: call it inside step(task); "
                "validation tasks reach step through the worker's loop"
            )
        return task

    def _process_task(self, task: Task | JSONDict) -> Trajectory:
        """One sample for `task`'s prompt (column `data.prompt_key`, text), with the
        validation temperature on a validation task, as a trajectory of prompt, response
        and finish reason (tokens, logprobs and reward are filled in when it is put).
        Override it to roll out your own way."""
        row = task.data if isinstance(task, Task) else task
        key = self._context.prompt_key
        prompt = row.get(key)
        if not isinstance(prompt, str) or not prompt:
            raise ValueError(
                f"task {row.get('uid')!r}: column {key!r} (data.prompt_key) must be non-empty "
                f"text for _process_task, got {type(prompt).__name__}"
            )
        validate = isinstance(task, Task) and task.is_validate
        cfg = self._config
        temperature = self._context.validate_temperature if validate else cfg.temperature
        result = self._llm_client.completion(
            prompt, max_tokens=cfg.max_tokens, temperature=temperature
        )
        return {
            "prompt": prompt,
            "response": result["response"],
            "finish_reason": result["finish_reason"],
        }

    def _put_validate_trajectory(self, trajectory: Trajectory | list[Trajectory]) -> StepResult:
        """Hand a validation task's trajectory (or its `validate.n_samples` trajectories as
        a list) to the validator. One trajectory where `validate.n_samples` > 1 is an error
        naming the key (the validation would wait for samples that never come)."""
        trajs = list(trajectory) if isinstance(trajectory, list) else [trajectory]
        task, n = self.current_task, self._context.validate_samples
        if task is not None and task.is_validate and len(trajs) != n:
            raise ValueError(
                f"{type(self).__name__}: validation task {task.uid!r} put {len(trajs)} "
                f"trajectories but validate.n_samples={n}: pass all {n} as a list"
            )
        return self._put_episodes([[t] for t in trajs])

    def _complete_trajectory(
        self, trajectory: Trajectory, task: Task | None, tag: str
    ) -> Trajectory:
        """A copy of `trajectory` with the keys the pool needs (see the module docstring)."""
        traj = dict(trajectory)
        if task is not None:
            traj.setdefault("uid", task.uid)
            traj["task_id"] = task.task_id
            if self._context.source_key in task.data:  # per-source validation metrics
                traj.setdefault("source", task.data[self._context.source_key])
        traj.setdefault("model_tag", tag)
        if any(traj.get(k) is None for k in _TOKEN_KEYS):
            self._fill_from_client(traj)
        if traj.get("reward") is None and self._reward_fn is not None and task is not None:
            traj["reward"] = self.score(task.data, traj)
        return traj

    def warn_unknown_tokens(self, prompt_ids: list[int], task: Task) -> bool:
        """Warn once per worker when the tokenizer turned part of a prompt into its unknown
        token (user text the model cannot see: the built-in tiny model's tokenizer knows
        58 characters). True when it warned now."""
        unk = getattr(getattr(self._llm_client, "tokenizer", None), "unk_token_id", None)
        if self._unk_warned or unk is None or unk not in prompt_ids:
            return False
        self._unk_warned = True
        logger.warning(
            "task %r: the tokenizer maps %d prompt token(s) to its unknown token, so the model "
            "never sees that text; set model_path to a model whose tokenizer covers your data",
            task.uid,
            prompt_ids.count(unk),
        )
        return True

    def _fill_from_client(self, traj: Trajectory) -> None:
        """Token ids, logprobs and versions of the client sample whose `response` `traj`
        carries: the client's result text names its sample (`SampleText`), so two
        episodes that end in the same words (or both in "") get their own samples."""
        sample_of = getattr(self._llm_client, "sample_of", None)
        sample = sample_of(traj.get("response")) if sample_of is not None else None
        if sample is None:
            return
        for key in (*_TOKEN_KEYS, *_VERSION_KEYS):
            if traj.get(key) is None:
                traj[key] = sample.get(key)
        traj.setdefault("loss_mask", [1] * len(traj["response_ids"]))

    def score(self, row: JSONDict, sample: CompletionResult | Trajectory) -> float:
        """The reward of one sample (`reward_fn` in either signature, docs/rewards.md); its
        named components land in `sample["scores"]`. A failed call raises `RewardFailed`
        (reported, the task retried) and is counted in `rewards/failed/<kind>`."""
        rewards = wired(self._rewards, "reward_fn")
        return self._reward_of(row, sample, rewards.score(*self._reward_call(row, sample)))

    def score_group(self, row: JSONDict, samples: list[CompletionResult]) -> list[float]:
        """`score` of every sample of one task in one runner call (one thread hop per group,
        not per sample). The first failed sample raises as in `score`; the samples after
        it are not waited for (those not started yet are cancelled)."""
        prompt, data = self._reward_row(row)  # one for the group: each call copies what it reads
        calls = [
            RewardCall(prompt, s["response"], s.get("prompt_ids"), s.get("response_ids"), data)
            for s in samples
        ]
        with contextlib.closing(wired(self._rewards, "reward_fn").iter_scores(calls)) as outcomes:
            return [self._reward_of(row, s, o) for s, o in zip(samples, outcomes, strict=True)]

    def _reward_call(self, row: JSONDict, sample: CompletionResult | Trajectory) -> RewardCall:
        prompt, data = self._reward_row(row)
        return RewardCall(
            prompt, sample["response"], sample.get("prompt_ids"), sample.get("response_ids"), data
        )

    def _reward_row(self, row: JSONDict) -> tuple[JSONValue, JSONDict]:
        """The reward's prompt and the row's other columns, as its keyword arguments."""
        return row.get(self._context.prompt_key), {k: v for k, v in row.items() if k != "prompt"}

    def _reward_of(
        self, row: JSONDict, sample: CompletionResult | Trajectory, outcome: RewardOutcome
    ) -> float:
        if not outcome.ok:
            self.tracker.increment(f"rewards/failed/{outcome.error}")
            raise RewardFailed(
                f"reward {outcome.error} on task {row.get('uid')!r}: {outcome.detail}"
            )
        if outcome.scores:
            sample["scores"] = dict(outcome.scores)
        return float(wired(outcome.reward, "reward in a successful outcome"))

    def pause(self) -> None:
        """Also end a validation's helper round (a rewind pauses every loop, waits for
        quiescence, then resets the task owner)."""
        self._is_running_validate = False
        super().pause()
        if self._helpers is not None:
            self._helpers.wait(30.0)

    def stop(self) -> None:
        super().stop()
        if self._helpers is not None:
            self._helpers.close()
            self._helpers = None
        if self._rewards is not None:
            self._rewards.close()


class GroupSizeError(ValueError):
    """A step put a number of episodes other than its group's size (see module docstring)."""


class RewardFailed(RuntimeError):
    """A reward call timed out, crashed or raised (its kind and detail in the message)."""
