"""The structured schema of `rl_train.yaml`.

Each section is a dataclass with a docstring under every field, so the schema
is also the reference (docs/configuration.md is generated from it and a test
keeps the two in step). `load_config` merges the yaml and the command-line
overrides into this schema: an unknown key or a value of the wrong type fails
before anything starts, with a message that names the key.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from omegaconf import MISSING  # noqa: F401  (re-exported for user schemas)

from nexrl.config.options import (
    InferenceEngineConfig,  # noqa: F401  (the engine section's options)
    RayRanksConfig,
)
from nexrl.training.config import EngineConfig


@dataclass
class DataConfig:
    type: str = "hf"
    """Loader type: `hf` (Hugging Face `datasets`: jsonl / json / parquet / saved dir)."""
    path: str | None = None
    """Dataset file or directory; null writes the built-in `task` to the nexrl cache."""
    task: str = "shift_letters"
    """Built-in task used when `path` is null."""
    split: str = "train"
    """Split to read (`train` or `validation` for the built-in task)."""
    prompt_key: str = "prompt"
    """Column holding the prompt: text, or chat messages (a list of {role, content})
    rendered with the tokenizer's chat template."""
    system_prompt: str | None = None
    """System message for every prompt (a text prompt becomes [system, user]); null: none."""
    shuffle: bool = True
    """Shuffle each epoch."""
    seed: int = 42
    """Shuffle seed."""
    num_epochs: int | None = None
    """Passes over the data; null cycles forever (training stops at `total_train_steps`)."""
    max_items: int | None = None
    """Use only the first `max_items` rows."""
    name: str | None = None
    """Configuration of the dataset at `path` (`datasets.load_dataset(path, name=name)`,
    e.g. `main` of the Hub's `openai/gsm8k`, read through the datasets cache); null: its
    only or default one."""
    map_fn: str | None = None
    """Row preprocessing `package.module:function`, called as `fn(row, index)` and returning
    the new row (datasets' `map(with_indices=True)`), before the rows are checked."""


@dataclass
class RolloutWorkerConfig:
    type: str = "single_turn"
    """Worker type: `single_turn` (generate, score with `reward_fn`) or `simple`
    (generate only), or an import path `package.module:Class`."""
    num_workers: int = 16
    """Rollout worker threads (local) or actors (Ray); each handles one task at a time. One
    per group of a train batch (`trajectory_pool.batch_size / group_size`) lets a step's
    prompts reach the engine together, so they decode as one batch; fewer log a warning at
    start."""
    group_size: int = 16
    """Samples per prompt (the GRPO group, the `n` of the request)."""
    reward_fn: str = "shift_letters"
    """Reward function name from the registry, or `package.module:function`."""
    max_tokens: int = 4
    """Maximum new tokens per sample (4: the built-in task's answers are 4 letters)."""
    temperature: float = 1.0
    """Sampling temperature for training rollouts."""
    top_p: float = 1.0
    """Nucleus sampling threshold."""
    top_k: int = -1
    """Top-k sampling; -1 disables."""
    max_task_retries: int = 2
    """A task whose rollout raised is put back this many times, then counted as failed."""
    reward_timeout_s: float | None = 30.0
    """Seconds a reward call may take; a slower one is counted (`rewards/failed/timeout`),
    reported, and its task retried (null: no limit)."""
    reward_process_pool: int = 0
    """Run the reward in this many worker processes (a hung or crashing reward is killed and
    the process replaced); 0: in a thread of the rollout worker (docs/rewards.md)."""
    workflow: str = ""
    """`type: agent` only: the `RolloutWorkflow` class as `package.module:Class` (empty: the
    built-in `nexrl.agents.workflows:ToolWorkflow`); docs/agents.md."""
    workflow_kwargs: dict[str, Any] = field(default_factory=dict)
    """`type: agent` only: keyword arguments of the workflow's constructor (e.g. `tools`,
    `max_turns`); `config` and `reward_fn` are added when it takes them."""


@dataclass
class TrajectoryPoolConfig:
    type: str = "default"
    """Pool type."""
    batch_size: int = 256
    """Trajectories per batch (prompts x group_size)."""
    group_size: int = 16
    """Trajectories per group; a batch holds whole groups only."""
    key_list: list[str] = field(default_factory=lambda: ["uid"])
    """Grouping keys: [] no grouping, one key grouped, several keys hierarchical."""
    check_batch_ready_function: str = "batch_size"
    """`batch_size` (a full batch) or `loaded_batch_finished` (also the epoch's tail)."""


@dataclass
class AlgorithmConfig:
    type: str = "grpo"
    """Processor type: `grpo` (group advantages) or `package.module:Class`."""
    advantage_estimator: str = "grpo"
    """Name in the advantage registry (docs/algorithms.md)."""
    advantage_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of the advantage estimator."""
    loss_fn: str = "ppo_clip"
    """Name in the policy-loss registry."""
    loss_agg_mode: str = "token-mean"
    """Loss aggregation mode."""
    loss_kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments of `compute_loss` (clip bounds, KL, entropy, IS correction)."""
    num_mini_batches: int = 1
    """Optimizer steps per batch: the batch is cut into this many slices (PPO mini-batches)."""
    ppo_epochs: int = 1
    """Passes over the slices of each batch."""
    dynamic_sampling: bool = False
    """DAPO dynamic sampling: drop groups whose rewards are all equal (they carry no
    advantage) at the rollout worker, so batches fill with informative groups only."""
    overlong_buffer_len: int = 0
    """DAPO overlong shaping: penalise responses within this many tokens of
    `rollout_worker.max_tokens` (0: off)."""
    overlong_penalty_factor: float = 1.0
    """Largest overlong penalty."""
    mask_truncated: bool = False
    """DAPO: no loss on responses cut off by `max_tokens`."""
    kl_in_reward_coef: float = 0.0
    """KL penalty in the reward, `reward - coef * KL(policy || reference)` per sequence
    (the reference: `train_worker.engine.ref_model_path`; unset, the initial policy);
    0: off. For KL as a loss term use `loss_kwargs.kl_coef`."""
    kl_in_reward_estimator: str = "k1"
    """KL estimator of the reward penalty: k1, k2 or k3."""


@dataclass
class TrainBatchPoolConfig:
    type: str = "default"
    """Pool type."""
    max_size: int | None = None
    """Batches held per model tag before `put_batch` refuses; null: unbounded."""


@dataclass
class TrainWorkerConfig:
    type: str = "default"
    """Worker type."""
    num_workers: int = 1
    """Train workers: 1 (one optimizer per run; data-parallel ranks are the engine's
    business: torchrun or `ray.train_ranks`). Other values are refused at start."""
    total_train_steps: int = 500
    """Stop after this many optimizer steps."""
    save_freq: int = 100
    """Save a `global_step_N` checkpoint every N steps (0: only at the end)."""
    remove_previous_ckpt: bool = True
    """Keep only the newest checkpoint and the one before it (resume falls back to it when
    the newest does not load)."""
    checkpoint_path: str | None = None
    """Checkpoint folder; null: `<run dir>/checkpoints`."""
    sync_weight_path: str | None = None
    """Weight-sync buffer folder; null: `<run dir>/sync_weights`."""
    log_trained_uids: bool = False
    """Append `{"step", "uids"}` per train step to `trained.jsonl` beside the checkpoint
    folder, written before that step's checkpoint: an audit of which data items each
    step trained (the exactly-once test reads it; docs/reliability.md)."""
    engine: EngineConfig = field(default_factory=EngineConfig)
    """Train engine options (docs/training.md)."""


@dataclass
class WeightConfig:
    type: str = "default"
    """Controller type."""
    sync_mode: str = "sync"
    """`sync`, `batch-async` or `fully-async`."""
    staleness_threshold: int = 0
    """Largest allowed `train_step - min(token_versions)` of a trained sample (async
    modes; `sync` forces 0). Rollouts are admitted only within it and a group that
    would exceed it when its batch forms is dropped and its task re-queued."""
    validate_freq: int = 25
    """Validate after every N weight syncs (0: never during training)."""
    sync_every: int = 1
    """Async modes: push new weights after every N train steps (the version becomes
    the train step, so it jumps by N)."""
    over_sample_threshold: float = 0.0
    """xtuner's over-sending: this fraction of a batch's groups may run beyond the
    staleness budget (e.g. 0.2 = 20% extra); extras that land too late are dropped."""
    enable_partial_rollout: bool | None = None
    """fully-async with aborting pushes: keep the tokens of aborted requests and
    continue them on the new weights; false: re-queue the task at the front and
    start it over (xtuner's async 1 and 2). null: on whenever pushes abort (in-flight
    updates off or not possible, e.g. backend hf / vllm / sglang): starting over makes
    a long tail slower than sync (docs/async.md)."""
    inflight_weight_update: bool | None = None
    """fully-async: a push swaps the weights under running requests instead of
    aborting them; they continue on the new weights with their cached prefix and
    per-token versions. Needs the built-in engine (in-process or `nexrl serve`).
    null: on in fully-async with the built-in engine (measured faster, docs/async.md)
    unless `enable_partial_rollout` or `tail_batch_candidate_steps` ask for aborts;
    false: a push aborts running requests."""
    abort_grace_s: float = 1.0
    """fully-async with aborting pushes: a push first lets running rollouts finish for
    up to this many seconds (no new ones start), then aborts the rest; 0 aborts at once.
    What finishes in the grace keeps its tokens: on a long tail, aborting at once threw
    away every running group at each push (docs/async.md)."""
    tail_batch_candidate_steps: int = 0
    """A task aborted more than this many times waits in the tail-batch candidate
    pool (0: no tail batch)."""
    tail_batch_trigger_size: int = 0
    """Candidates that trigger a tail batch (served together, before new data, never
    aborted again); 0: one batch worth of groups."""
    transport: str = "auto"
    """How pushed weights reach the engine: `file` (safetensors in
    `train_worker.sync_weight_path`), `memory` (the state dict itself: by reference in
    local mode, inside the push call in Ray mode; needs the built-in trainer and an
    in-process inference backend), `auto` (memory where possible, else file)."""


@dataclass
class TrainServiceConfig:
    backend: str = "auto"
    """`builtin` (in-process torch engine), `process` (the same engine in a child process
    of its own: no interpreter-lock contention with the rollout side, weights through
    shared memory), `remote` (a `nexrl train-service`), or `auto`: `process` for a local
    fully-async run with `weight.staleness_threshold` >= 1 (the fastest measured),
    `builtin` otherwise; or a train engine registered in
    `nexrl.training.backends.TRAIN_ENGINES`, or `package.module:Class`."""
    url: str | None = None
    """Service URL for `remote`."""
    model_tag: str = "default"
    """Which model this service trains."""
    api_key: str | None = None
    """Bearer token of the service."""
    timeout: float = 600.0
    """Seconds per request."""
    max_retries: int = 3
    """Retries of a failed request."""


@dataclass
class InferenceServiceConfig:
    backend: str = "builtin"
    """`builtin` (in-process engine), `hf` (transformers generate), `remote` (an
    OpenAI-compatible server: `nexrl serve`), `vllm` or `sglang`."""
    url: str | None = None
    """Server base URL for remote backends."""
    model_tag: str = "default"
    """Which model this service serves."""
    model: str | None = None
    """Model path; null: the run's `model_path`."""
    api_key: str | None = None
    """Bearer token of the server."""
    max_retries: int = 3
    """Retries of a failed request."""
    timeout: float = 300.0
    """Seconds per request."""
    freeze_for_weight_sync: bool = True
    """Hold new requests while a weight sync is in progress."""
    tool_call_parser: str = "hermes"
    """How `LLMServiceClient.generate(messages, tools=...)` reads tool calls from the reply
    (a name in `nexrl.inference.tool_parsers`), on in-process backends."""
    engine: dict[str, Any] = field(default_factory=dict)
    """Engine options of the backend: for `builtin` and `hf` the `InferenceEngineConfig`
    keys below (`service.inference_service.engine.<option>`), for `vllm` its own
    (docs/inference.md). The packaged `rl_train.yaml` sets `max_batch_size: 256`."""


@dataclass
class ServiceConfig:
    train_service: TrainServiceConfig = field(default_factory=TrainServiceConfig)
    inference_service: InferenceServiceConfig = field(default_factory=InferenceServiceConfig)


@dataclass
class EvalConfig:
    type: str = "default"
    """Validator type."""


@dataclass
class ValidateConfig:
    validate_before_train: bool = True
    """Validate the initial weights before the first step."""
    temperature: float = 0.0
    """Sampling temperature of validation rollouts (0: greedy)."""
    n_samples: int = 1
    """Samples per validation task; with more than 1, `val/pass@k` is logged for
    k = 1, 2, 4, ... up to it (use a temperature above 0)."""
    pass_threshold: float = 1.0
    """A sample counts as correct for pass@k when its reward is at least this."""
    source_key: str = "data_source"
    """Row column naming each task's source; rows that have it get `val/<source>/reward`."""
    concurrency: int = 64
    """Validation tasks in flight at once, so that a validation set reaches the engine as
    one batch: each rollout worker runs ceil(concurrency / rollout_worker.num_workers)
    of them side by side (at least one). The `single_turn`, `simple` and `agent` workers
    do; a custom worker runs one task at a time unless it declares
    `concurrent_steps = True`."""
    data: DataConfig = field(
        default_factory=lambda: DataConfig(split="validation", shuffle=False, num_epochs=1)
    )
    """Validation data, same keys as `data`."""
    eval: EvalConfig = field(default_factory=EvalConfig)


@dataclass
class ResumeConfig:
    mode: str = "disable"
    """`disable`, `auto` (newest `global_step_N` under the checkpoint folder) or `from_path`."""
    resume_path: str | None = None
    """Checkpoint folder for `from_path`."""
    use_saved_config: bool = True
    """`auto`: continue a run with the config.yaml it was started with (this command's
    keys that differ are listed in one line); false: with this command's config (saved
    beside it as config.resumed-<time>.yaml)."""
    resumed: bool = False
    """Set at start (not by you): true when `auto` continues an earlier run's folder."""
    resumed_from: str | None = None
    """Set at start (not by you): the checkpoint the run continues from."""


@dataclass
class LoggerConfig:
    backend: list[str] = field(default_factory=lambda: ["jsonl", "console"])
    """Any of `jsonl` (metrics.jsonl in the run dir), `console`, `tensorboard`, `wandb`."""
    run_dir: str | None = None
    """Where file backends write; set to the run directory at start."""
    console_keys: list[str] | None = None
    """Metrics shown on the console line; null: step, reward, throughput, ETA."""
    sample_every: int = 10
    """Log a table of sample completions (prompt, response, reward, version, staleness)
    every N train steps to the trackers (and `samples.jsonl`); 0: never."""
    sample_rows: int = 8
    """Rows in each sample table."""
    mlflow_tracking_uri: str | None = None
    """MLflow tracking URI; null: a local file store in `<run dir>/mlruns`."""


@dataclass
class ExceptionHandlingConfig:
    enabled: bool = True
    """Watch reported errors."""
    check_interval: float = 1.0
    """Seconds between checks."""
    policy: str = "stop_on_error"
    """`stop_on_error` (a module's error; failed tasks only past `max_consecutive_errors`),
    `stop_on_critical` or `continue` (docs/monitoring.md)."""
    max_consecutive_errors: int = 16
    """Errors with no train step between them that stop the run (a run that only fails),
    under `stop_on_error` and `stop_on_critical`; 1: the first error."""


@dataclass
class HealthCheckConfig:
    enabled: bool = True
    """Check module liveness."""
    check_interval: float = 5.0
    """Seconds between checks."""
    timeout: float = 5.0
    """Seconds a module may take to answer (Ray mode)."""


@dataclass
class RuntimeMonitorConfig:
    exception_handling: ExceptionHandlingConfig = field(default_factory=ExceptionHandlingConfig)
    health_check: HealthCheckConfig = field(default_factory=HealthCheckConfig)
    stall_report_s: float = 60.0
    """Seconds without a train step before the run logs what it waits for (the pool's
    groups, trajectories against expected, busy workers, the last error); 0: never."""


@dataclass
class RayConfig:
    address: str | None = None
    """null starts a local Ray; `auto` or `ray://host:10001` joins a running cluster."""
    num_cpus: int | None = None
    """CPUs of a locally started Ray (null: all)."""
    num_gpus: int | None = None
    """GPUs of a locally started Ray (null: all)."""
    namespace: str = "nexrl"
    """Ray namespace of the run's actors."""
    execute_timeout_s: float = 600.0
    """Longest wait for a cross-actor call (`execute`), here and in every actor."""
    max_concurrency: int = 64
    """Threads per module actor (loops, calls from other actors and health checks)."""
    max_restarts: int = 0
    """Ray restarts of a dead module actor; nexrl rebuilds and rewires its modules."""
    torch_threads: int | None = None
    """Torch threads in each module actor; null: `NEXRL_ACTOR_THREADS` or
    `OMP_NUM_THREADS` if set, else the driver's torch threads split evenly over the
    module actors (at least 1)."""
    layout: str = "one_actor"
    """Which modules share an actor: `one_actor` (all of them, in `main`), `rollout_train`
    (a `rollout` and a `train` actor) or `split` (also a `data` actor); docs/ray.md."""
    colocation: dict[str, str | None] = field(default_factory=dict)
    """role -> colocation group (null: an actor of its own), over `layout`'s."""
    groups: dict[str, Any] = field(default_factory=dict)
    """group -> its actor's Ray options, the keys of `nexrl.config.options.RayGroupConfig`:
    `num_cpus` (0.0), `num_gpus` (0.0), `max_concurrency` and `max_restarts` (null: the
    `ray.*` values above), `resources` ({}); checked at start, an unknown key named."""
    train_ranks: RayRanksConfig = field(default_factory=RayRanksConfig)
    """Data-parallel train ranks as a worker group on bundles of their own; empty
    `bundles_per_node`: one in-actor engine."""
    inference_replicas: RayRanksConfig = field(default_factory=RayRanksConfig)
    """Inference engine replicas on bundles of their own; empty `bundles_per_node`: none."""


@dataclass
class DashboardConfig:
    enabled: bool = False
    """Serve the live status page (docs/dashboard.md) while the run trains."""
    host: str = "127.0.0.1"
    """Bind address; loopback only (the page has no authentication)."""
    port: int = 0
    """TCP port; 0 picks a free one (the URL is logged)."""


@dataclass
class RLTrainConfig:
    launch_mode: str = "local"
    """`local` (threads in one process) or `ray`."""
    project_name: str = "nexrl"
    """Project name for experiment loggers."""
    experiment_name: str = "shift_letters"
    """Run name; the run dir is `<output_dir>/<experiment_name>/<timestamp>`."""
    output_dir: str = "./outputs"
    """Where run directories go."""
    run_dir: str | None = None
    """Exact run directory (overrides the timestamped default)."""
    seed: int = 42
    """Global seed."""
    model_path: str | None = None
    """HF model directory; null: the embedded tiny Qwen2."""
    data: DataConfig = field(default_factory=DataConfig)
    rollout_worker: RolloutWorkerConfig = field(default_factory=RolloutWorkerConfig)
    trajectory_pool: TrajectoryPoolConfig = field(default_factory=TrajectoryPoolConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    train_batch_pool: TrainBatchPoolConfig = field(default_factory=TrainBatchPoolConfig)
    train_worker: TrainWorkerConfig = field(default_factory=TrainWorkerConfig)
    weight: WeightConfig = field(default_factory=WeightConfig)
    service: ServiceConfig = field(default_factory=ServiceConfig)
    validate: ValidateConfig = field(default_factory=ValidateConfig)
    resume: ResumeConfig = field(default_factory=ResumeConfig)
    logger: LoggerConfig = field(default_factory=LoggerConfig)
    runtime_monitor: RuntimeMonitorConfig = field(default_factory=RuntimeMonitorConfig)
    ray: RayConfig = field(default_factory=RayConfig)
    """Ray mode settings (`launch_mode: ray`; docs/ray.md)."""
    dashboard: DashboardConfig = field(default_factory=DashboardConfig)
    """The live status page (docs/dashboard.md)."""


CHOICES: dict[str, tuple[str, ...]] = {
    "launch_mode": ("local", "ray"),
    "weight.sync_mode": ("sync", "batch-async", "fully-async"),
    "weight.transport": ("auto", "file", "memory"),
    "resume.mode": ("disable", "auto", "from_path"),
    "runtime_monitor.exception_handling.policy": ("stop_on_error", "stop_on_critical", "continue"),
    "trajectory_pool.check_batch_ready_function": ("batch_size", "loaded_batch_finished"),
    "service.inference_service.backend": ("builtin", "hf", "remote", "vllm", "sglang"),
}
