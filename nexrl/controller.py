"""NexRLController: builds the modules, wires them, runs and watches the loop.

The data flow lives in the modules; the controller starts them, validates when
the weight-sync controller asks, applies the error policy, and stops everything
once training is done:

    initialize train workers; load initial / resume checkpoint (push its weights)
    validate before training (optional)
    start the module loops
    while not finished:
        check errors and liveness; validate when a weight push asks for it
        Ray: a module actor restarted -> rewind in place to the last checkpoint
    final validation; stop; wait for quiescence

The loops (each a thread, or a thread inside a Ray actor) and their calls:

    DataLoader <-get/requeue- TaskAdmission <-acquire/complete- RolloutWorker xN
                                 ^ form_batch (one call per batch)   | put group
                                 +--------- TrajectoryPool <---------+
    TrainBatchPool <-put- AlgorithmProcessor <-get batch- TrajectoryPool
    TrainWorker -get-> TrainBatchPool; train step; export; notify -> WSC -push-> engine
    WSC -set_version / hold-> TaskAdmission

One owner per job:

    handing out and re-queueing tasks   TaskAdmission (nexrl/rollout/admission.py)
    staleness of a forming batch        the same, in `form_batch`
    pushing weights, versions           WeightSyncController (nexrl/weight_sync.py)
    when to validate                    WeightSyncController decides, the controller runs it

Who waits for what, and what unblocks it:

    | who               | waits for                     | unblocked by                        |
    |-------------------|-------------------------------|-------------------------------------|
    | rollout worker    | an admission slot             | form_batch (sync), a push, a slot   |
    |                   |                               | released by a failure or a drop,    |
    |                   |                               | end_validate                        |
    | processor         | a batch of whole groups       | a group put (or the data's tail)    |
    | train worker      | a processed batch             | the processor's put_batch           |
    | async push        | running rollouts (batch-async)| their `TaskAdmission.complete`      |
    |                   | a running validation          | the controller's end_validate       |
    | controller        | a validation to finish        | every validation task back          |
"""

from __future__ import annotations

import logging
import time
from typing import Any

from omegaconf import DictConfig

from nexrl.distributed.recovery import (
    ActorRestartedError,
    describe,
    quiesce_and_reset,
    restart_loops,
)
from nexrl.execute import ModuleDiedError, execute
from nexrl.monitoring import should_stop
from nexrl.monitoring.dashboard import Dashboard, pipeline_state_fn
from nexrl.monitoring.ledger import restore_ledger
from nexrl.monitoring.progress import StallReporter, describe_stall
from nexrl.run_setup import (
    find_latest_checkpoint,
    find_resume_checkpoint,
    older_checkpoint,
    resolve_run_config,
)
from nexrl.system import LocalSystem, ModuleSystem
from nexrl.types import DEFAULT_MODEL_TAG, ModelTag

logger = logging.getLogger(__name__)


def build_system(cfg: DictConfig) -> ModuleSystem:
    """The modules of a run, built for `cfg.launch_mode`."""
    if cfg.launch_mode == "ray":
        from nexrl.distributed.ray_system import RaySystem

        return RaySystem(cfg)
    return LocalSystem(cfg)


class TrainingAborted(RuntimeError):
    """The error policy stopped the run, or a module died."""


class NexRLController:
    def __init__(self, config: DictConfig) -> None:
        self._explicit_ckpt = config.train_worker.checkpoint_path is not None
        self._config = resolve_run_config(config)
        self.system = build_system(self._config)
        self.run_dir = self._config.run_dir
        self.activity_tracker = self.system.activity_tracker
        self._tag: ModelTag = DEFAULT_MODEL_TAG
        self._last_validated_step: int | None = None
        self._monitor = self._config.runtime_monitor
        # read once: the watch loop passes 2-3 times a train step
        self._total_steps = self._config.train_worker.total_train_steps
        self._next_health_check = 0.0
        self._next_error_check = 0.0
        self._next_restart_check = 0.0
        self._steps_seen = 0  # train steps the weight sync controller had finished
        self._stall = StallReporter(
            self._monitor.stall_report_s,
            lambda: describe_stall(
                self.system.trajectory_pool,
                self.system.task_admission,
                self.activity_tracker,
                self._tag,
            ),
        )
        self.rewinds: list[tuple[int, list[str]]] = []
        """(checkpoint step, restarted actor groups) per Ray rewind (docs/reliability.md)."""
        self.final_metrics: dict[str, float] = {}
        self.dashboard: Dashboard | None = None

    # -- the run -----------------------------------------------------------------
    def run(self) -> dict[str, float]:
        try:
            return self._run()
        except (ModuleDiedError, TrainingAborted) as exc:
            lost = self.system.describe_failure()  # Ray: a node left the cluster
            if lost:
                raise TrainingAborted(lost) from exc
            raise

    def _run(self) -> dict[str, float]:
        s = self.system
        logger.info("run dir: %s", self.run_dir)
        for worker in s.train_workers:
            execute(worker.initialize_workers)
        self._load_initial_checkpoint()
        validate_first = self._config.validate.validate_before_train
        if validate_first:  # switch workers to validation before their loops start
            self._start_validate(self._tag)
        s.start()
        self._start_dashboard()
        try:
            if validate_first:
                self._wait_validate()
                self._end_validate(self._tag)
            self._train_then_validate()
        finally:
            self._stop()
        return self.final_metrics

    def _watch_once(self) -> bool:
        """One pass of the watch loop; True once training is done. A Ray actor restart
        (noticed by its note, or by a call that reached the fenced actor, or by the
        errors those calls raised) rewinds the run to its last checkpoint."""
        try:
            if self._check_finish():
                return True
            self._check_module_exceptions_periodically()
            self._check_module_liveness_periodically()
            wsc = self.system.weight_sync_controller
            if execute(wsc.is_waiting_for_validation):
                self._run_validate(self._tag)
            else:  # until the next train step ends (or `progress_wait_s`)
                self._steps_seen = execute(
                    wsc.wait_for_progress, self._steps_seen, self.system.progress_wait_s
                )
                self._stall.observe(self._steps_seen)
        except (ActorRestartedError, TrainingAborted):
            if not self._rewind_after_restart(settle=True):
                raise
            return False
        if time.monotonic() >= self._next_restart_check:
            self._next_restart_check = time.monotonic() + 0.2
            self._rewind_after_restart()
        return False

    def _train_then_validate(self) -> None:
        """Watch training to its end, then validate the final weights unless that step
        was validated. An actor restart after the last step rewinds the run, which then
        trains to its end again."""
        while True:
            while not self._watch_once():
                pass  # each pass waits for the next train step's end (`progress_wait_s`)
            try:
                if self._last_validated_step != self._train_step():
                    self._run_validate(self._tag)
                return
            except (ActorRestartedError, TrainingAborted):
                if not self._rewind_after_restart(settle=True):
                    raise

    def _rewind_after_restart(self, settle: bool = False) -> bool:
        """Ray: rewind to the last complete checkpoint if a module actor restarted (its state
        is gone: nexrl/distributed/recovery.py); False when none did."""
        restarted = self.system.restarted_actors(settle)
        if not restarted:
            return False
        folder = self._config.train_worker.checkpoint_path
        path = self.system.on_checkpoint_node(find_latest_checkpoint, folder)
        if path is None:
            raise TrainingAborted(
                f"Ray actor(s) {describe(restarted)} restarted and lost their state (task "
                f"ledger, pools, loader position or optimizer); no complete checkpoint under "
                f"{folder} to rewind to (set train_worker.save_freq)"
            )
        logger.warning("Ray actor(s) %s restarted: rewinding to %s", describe(restarted), path)
        quiesce_and_reset(self.system, restarted)  # flushes every outbox: the step is current
        before = execute(self.activity_tracker.get_training_step)  # the train actor may be fenced
        step = self._restore_checkpoint(path)
        restart_loops(self.system)
        execute(self.activity_tracker.increment, "recovery/rewinds")
        execute(self.activity_tracker.increment, "recovery/steps_redone", max(0, before - step))
        self.rewinds.append((step, sorted(restarted)))
        logger.warning("rewound to step %d (was at step %d)", step, before)
        return True

    def _start_dashboard(self) -> None:
        d = self._config.dashboard
        if d.enabled:
            state = pipeline_state_fn(self.system)
            self.dashboard = Dashboard(self.activity_tracker, self.run_dir, state, d.host, d.port)
            url = self.dashboard.start()
            logger.info("status page: %s", url)
            print(f"nexrl: status page {url}", flush=True)

    def _train_step(self) -> int:
        return execute(self.system.train_workers[0].get_train_step)

    def _check_finish(self) -> bool:
        if self._total_steps and self._train_step() >= self._total_steps:
            return True
        s = self.system
        if not execute(s.dataloader.is_finished):
            return False
        # a task between two modules (taken from a pool, its bracket not begun) is in no
        # pool and not in flight: only the task ledger sees it until it is trained
        if execute(s.task_admission.pending_count):
            return False
        s.flush_tracker()  # the last brackets' queued calls are on record before we ask
        return (
            execute(self.activity_tracker.is_quiescent)
            and execute(s.trajectory_pool.is_empty)
            and execute(s.train_batch_pool.is_empty)
        )

    def _check_module_exceptions(self) -> bool:
        if not self._monitor.exception_handling.enabled:
            return True
        health = execute(self.activity_tracker.get_error_health_status)
        handling = self._monitor.exception_handling
        if should_stop(health, handling.policy, handling.max_consecutive_errors):
            raise TrainingAborted(
                f"stopping on reported errors (policy {handling.policy}, "
                f"{health.get('consecutive_error_count', 0)} since the last train step): "
                f"{health['message']}"
            )
        return True

    def _check_module_exceptions_periodically(self) -> None:
        """Every `runtime_monitor.exception_handling.check_interval` seconds."""
        if time.monotonic() >= self._next_error_check:
            self._next_error_check = (
                time.monotonic() + self._monitor.exception_handling.check_interval
            )
            self._check_module_exceptions()

    def _check_module_liveness(self, timeout: float = 5.0) -> bool:
        if not execute(self.activity_tracker.check_module_liveness, timeout):
            dead = execute(self.activity_tracker.get_dead_modules)
            raise TrainingAborted(
                f"module(s) {dead} died or stopped answering; in flight: "
                + execute(self.activity_tracker.get_running_status_summary)
            )
        return True

    def _check_module_liveness_periodically(self) -> None:
        if time.monotonic() < self._next_health_check:
            return
        hc = self._monitor.health_check
        self._next_health_check = time.monotonic() + hc.check_interval
        if hc.enabled:
            self._check_module_liveness(hc.timeout)

    # -- checkpoints -------------------------------------------------------------
    def _load_initial_checkpoint(self) -> None:
        """Fresh start: both sides loaded `model_path` (version 0). Resume: load and push."""
        path = self._load_resume_checkpoint()
        if path is not None:
            self._restore_checkpoint(path, ledger=True)

    def _restore_checkpoint(self, path: str, ledger: bool = False) -> int:
        """Weights, optimizer and step, the loader state and the pending tasks of `path`;
        the weights are pushed as version `step`. Returns the step. `ledger`: a resumed
        run (not a Ray rewind, whose tracker kept its counts) also takes the task ledger's
        counts (nexrl/monitoring/ledger.py)."""
        s = self.system
        path, state = self._load_or_fall_back(path)
        if ledger:
            restore_ledger(self.activity_tracker, state.get("ledger"))
        load_state = getattr(s.dataloader, "load_state_dict", None)  # a loader may keep none
        if "dataloader" in state and load_state is not None:
            try:
                execute(load_state, state["dataloader"])
            except ValueError as exc:  # a config that does not match the run's data
                raise TrainingAborted(
                    f"cannot resume from {path}: {exc} (the run was started with another "
                    "config; resume.use_saved_config=true continues with its own)"
                ) from None
        # tasks handed out but not trained at the save go first (exactly once)
        pending = state.get("pending_tasks") or []
        if pending:
            execute(s.task_admission.restore, pending)
        execute(s.train_workers[0].export_sync_weights)
        execute(s.weight_sync_controller.resume_from, self._tag, state["step"])
        execute(self.activity_tracker.set_training_step, state["step"])
        self._last_validated_step = None
        logger.info(
            "resumed from %s at step %d (%d pending tasks re-queued)",
            path,
            state["step"],
            len(pending),
        )
        return int(state["step"])

    def _load_or_fall_back(self, path: str) -> tuple[str, dict[str, Any]]:
        """Load `path`; one that does not load (corrupt content the manifest could not
        catch) is skipped with a warning for the next older complete checkpoint."""
        failed: set[str] = set()
        while True:
            try:
                return path, execute(self.system.train_workers[0].load_checkpoint, path)
            except (ValueError, KeyError, OSError, RuntimeError) as exc:
                why = str(exc).strip().splitlines()[0] if str(exc).strip() else repr(exc)
                failed.add(path)
                older = older_checkpoint(path, failed)
                if older is None:
                    raise TrainingAborted(
                        f"checkpoint {path} does not load ({why}) and no older complete "
                        "checkpoint of this run does; set resume.mode=disable to start a "
                        "fresh run"
                    ) from None
                logger.warning("checkpoint %s does not load (%s); using %s", path, why, older)
                path = older

    def _load_resume_checkpoint(self) -> str | None:
        resume = self._config.resume
        if resume.mode == "disable":
            return None
        if resume.mode == "from_path":
            if not resume.resume_path:
                raise ValueError("resume.mode=from_path needs resume.resume_path")
            return str(resume.resume_path)
        return self.system.on_checkpoint_node(
            find_resume_checkpoint, self._config, self._explicit_ckpt
        )

    def _find_latest_checkpoint(self, checkpoint_folder: str) -> str | None:
        return find_latest_checkpoint(checkpoint_folder)

    # -- validation ---------------------------------------------------------------
    def _set_validate_mode(self, on: bool) -> None:
        for worker in self.system.rollout_workers:
            execute(worker.begin_validate if on else worker.end_validate)

    def _start_validate(self, model_tag: ModelTag) -> None:
        s = self.system
        execute(s.validate_dataloader.reset)
        execute(s.validator.begin, execute(s.validate_dataloader.__len__))
        execute(s.weight_sync_controller.start_validate, model_tag)
        self._set_validate_mode(True)

    def _end_validate(self, model_tag: ModelTag) -> None:
        s = self.system
        self._set_validate_mode(False)
        s.flush_tracker()  # the validator logs at the tracker's step, queued by the trainer
        metrics = execute(s.validator.compute_and_log_metrics)
        execute(s.validator.clear)
        execute(s.weight_sync_controller.end_validate, model_tag)
        self._last_validated_step = self._train_step()
        self.final_metrics.update(metrics)
        logger.info("validation at step %d: %s", self._last_validated_step, metrics)

    def _wait_validate(self) -> None:
        while not execute(self.system.validator.is_complete):
            self._check_module_exceptions()
            time.sleep(self.system.watch_interval_s)

    def _run_validate(self, model_tag: ModelTag) -> None:
        """Validate the weights the inference side serves now (seed 000 `_run_validate`)."""
        self._start_validate(model_tag)
        self._wait_validate()
        self._end_validate(model_tag)

    # -- shutdown ------------------------------------------------------------------
    def _stop(self, timeout: float = 60.0) -> None:
        self.system.stop()
        self.system.flush_tracker()
        if not execute(self.activity_tracker.wait_quiescent, timeout):
            logger.warning(
                "not quiescent after %.0fs: %s",
                timeout,
                execute(self.activity_tracker.get_running_status_summary),
            )
        execute(
            self.activity_tracker.experiment_logger_post,
            backend="metrics",
            data={f"ledger/{k}": v for k, v in self._ledger().items()},
            step=self._train_step(),
        )
        execute(self.activity_tracker.close)

    def shutdown(self) -> None:
        """Release what the run holds beyond `run()` (Ray actors and placement groups).

        Separate from `run()` so that the tracker can still be inspected after a run.
        """
        if self.dashboard is not None:
            self.dashboard.stop()
        shutdown = getattr(self.system, "shutdown", None)
        if shutdown is not None:
            shutdown()

    def _ledger(self) -> dict[str, int]:
        return dict(execute(self.activity_tracker.get_counters))
