"""Experiment logging: one `ExperimentLogger` fanning out to configured backends.

Backends are plain classes with `log(data, step)`, `log_samples(rows, step)` and
`close()`, chosen by name from `LOGGER_BACKENDS` (an explicit registry). `jsonl`
is always on when a run directory is set, because `metrics.jsonl` is the run's
durable record (tests, `nexrl plot` and the e2e check read it); `console`,
`tensorboard`, `wandb` and `mlflow` are opt-in. The optional packages are
imported only when their backend is asked for, so a missing `wandb` fails at
start with an install hint instead of at import.

Every tracker receives the full resolved config (passed in, or read from
`<run_dir>/config.yaml`, which `resolve_run_config` writes before the logger is
built). A run that continues in an existing run folder (auto-resume) appends to
`metrics.jsonl` and resumes the same wandb / mlflow run: the tracker run ids are
kept in `<run_dir>/trackers.json`.
"""

from __future__ import annotations

import json
import logging
import os
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Protocol, TypedDict

from nexrl.monitoring.progress import DEFAULT_CONSOLE_KEYS, ConsoleBackend
from nexrl.monitoring.samples import SAMPLE_COLUMNS, sample_rows, with_staleness
from nexrl.registry import Registry
from nexrl.types import JSONValue

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_CONSOLE_KEYS",
    "LOGGER_BACKENDS",
    "SAMPLE_COLUMNS",
    "ConsoleBackend",
    "ExperimentLogger",
    "check_backend",
    "parse_backends",
    "sample_rows",
    "with_staleness",
]

TRACKER_IDS_FILE = "trackers.json"


class PostOptions(TypedDict, total=False):
    """The keyword arguments of `ExperimentLogger.post` a tracker forwards."""

    data: Mapping[str, object] | None
    step: int | None
    total_steps: int | None
    rows: Sequence[Mapping[str, object]] | None


class LoggerBackend(Protocol):
    def log(self, data: Mapping[str, object], step: int) -> None: ...

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None: ...

    def close(self) -> None: ...


def _to_jsonable(value: object) -> JSONValue:
    """Tensors / numpy scalars to Python numbers; anything else unknown to str."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


def _scalars(data: Mapping[str, object]) -> dict[str, float]:
    """The numeric entries of a metrics dict (tensors included), as floats."""
    out: dict[str, float] = {}
    for key, value in data.items():
        if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
            value = value.item()
        if isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = float(value)
    return out


def flatten_config(config: Mapping[str, object], prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}: trackers with flat parameter lists (mlflow)."""
    flat: dict[str, object] = {}
    for key, value in config.items():
        name = f"{prefix}{key}"
        if isinstance(value, Mapping) and value:
            flat.update(flatten_config(value, f"{name}."))
        else:
            flat[name] = value
    return flat


def _table(rows: list[dict[str, object]]) -> list[list[object]]:
    return [[row.get(c) for c in SAMPLE_COLUMNS] for row in rows]


def _load_run_config(run_dir: str | Path | None) -> dict[str, object]:
    path = Path(run_dir) / "config.yaml" if run_dir else None
    if path is None or not path.is_file():
        return {}
    from omegaconf import OmegaConf

    return OmegaConf.to_container(OmegaConf.load(path), resolve=False)  # type: ignore[return-value]


class TrackerIds:
    """`<run_dir>/trackers.json`: {"wandb": run id, "mlflow": run id} for resume."""

    def __init__(self, run_dir: str | Path | None) -> None:
        self.path = Path(run_dir) / TRACKER_IDS_FILE if run_dir else None

    def get(self, name: str) -> str | None:
        if self.path is None or not self.path.is_file():
            return None
        return json.loads(self.path.read_text()).get(name)

    def set(self, name: str, run_id: str) -> None:
        if self.path is None:
            return
        ids = json.loads(self.path.read_text()) if self.path.is_file() else {}
        ids[name] = run_id
        self.path.write_text(json.dumps(ids, indent=1) + "\n")


def resumed_step(run_config: Mapping[str, object]) -> int | None:
    """The step a resumed run continues from (`resume.resumed_from` = `.../global_step_N`)."""
    resume = run_config.get("resume")
    if not isinstance(resume, Mapping):
        return None
    path = resume.get("resumed_from") if resume.get("resumed") else None
    if not path:
        return None
    return int(Path(path).name.rsplit("_", 1)[1])


def keep_steps_up_to(path: Path, step: int) -> None:
    """Rewrite a jsonl file with only its lines whose `step` is <= `step` (atomically).
    A line that does not parse (torn by a crash mid-write) is dropped with a warning
    naming the file and line."""
    if not path.exists():
        return
    kept = []
    text = path.read_text(encoding="utf-8", errors="replace")
    for number, line in enumerate(text.splitlines(), 1):
        try:
            row = json.loads(line) if line.strip() else None
        except ValueError:
            logger.warning("%s:%d: dropping a torn line (a crash mid-write)", path, number)
            continue
        if isinstance(row, dict) and row.get("step", 0) <= step:
            kept.append(line)
    tmp = path.with_suffix(".jsonl.tmp")
    tmp.write_text("".join(x + "\n" for x in kept), encoding="utf-8")
    os.replace(tmp, path)


class JsonlBackend:
    """Appends one JSON object per call to `<run_dir>/metrics.jsonl` (with `step` and the
    wall-clock `time`), flushed per line.

    Sample tables go to `<run_dir>/samples.jsonl`, one row per line with `step`.
    Both files are opened for append, so a resumed run continues them.
    """

    def __init__(
        self, run_dir: str | Path, run_config: Mapping[str, object] | None = None, **_: object
    ) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.samples_path = Path(run_dir) / "samples.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        step = resumed_step(run_config or {})
        if step is not None:  # the killed run logged steps past its checkpoint: drop them
            for path in (self.path, self.samples_path):
                keep_steps_up_to(path, step)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, data: Mapping[str, object], step: int) -> None:
        # `time`: when it was logged (Unix seconds), as the trackers record for each point
        line = json.dumps(
            {"step": step, "time": round(time.time(), 3), **data}, default=_to_jsonable
        )
        self._file.write(line + "\n")
        self._file.flush()

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None:
        with self.samples_path.open("a", encoding="utf-8") as f:
            for row in rows:
                f.write(json.dumps({"step": step, **row}, default=_to_jsonable) + "\n")

    def close(self) -> None:
        self._file.close()


class TensorboardBackend:
    """Scalars per step; the config and each sample table as markdown text."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        run_config: Mapping[str, object] | None = None,
        **_: object,
    ) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "logger.backend 'tensorboard' needs the tensorboard package: "
                "pip install 'nexrl[tensorboard]'"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(Path(run_dir or ".") / "tensorboard"))
        if run_config:
            from omegaconf import OmegaConf

            text = OmegaConf.to_yaml(OmegaConf.create(dict(run_config)))
            self._writer.add_text("config", "```yaml\n" + text + "```", 0)

    def log(self, data: Mapping[str, object], step: int) -> None:
        for key, value in _scalars(data).items():
            self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None:
        head = "| " + " | ".join(SAMPLE_COLUMNS) + " |\n|" + " --- |" * len(SAMPLE_COLUMNS)
        lines = ["| " + " | ".join(_md_cell(v) for v in row) + " |" for row in _table(rows)]
        self._writer.add_text("samples", "\n".join([head, *lines]), step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


def _md_cell(value: object) -> str:
    return str(value).replace("|", "\\|").replace("\n", " ")


class WandbBackend:
    """A wandb run; resumed by id when the run folder already holds one."""

    def __init__(
        self,
        run_dir: str | Path | None = None,
        project_name: str = "nexrl",
        experiment_name: str | None = None,
        run_config: Mapping[str, object] | None = None,
        **_: object,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "logger.backend 'wandb' needs the wandb package: pip install 'nexrl[wandb]'"
            ) from exc
        self._wandb = wandb
        ids = TrackerIds(run_dir)
        self._run = wandb.init(
            project=project_name,
            name=experiment_name,
            dir=str(run_dir) if run_dir else None,
            config=dict(run_config or {}),
            id=ids.get("wandb"),
            resume="allow",
            reinit="create_new",
        )
        ids.set("wandb", self._run.id)

    @property
    def run_id(self) -> str:
        return self._run.id

    def log(self, data: Mapping[str, object], step: int) -> None:
        self._run.log(json.loads(json.dumps(dict(data), default=_to_jsonable)), step=step)

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None:
        table = self._wandb.Table(columns=list(SAMPLE_COLUMNS), data=_table(rows))
        self._run.log({"samples": table}, step=step)

    def close(self) -> None:
        self._run.finish()


class MlflowBackend:
    """An mlflow run: config as params (and `config.yaml`), metrics, sample tables.

    The tracking URI is `tracking_uri`, else `$MLFLOW_TRACKING_URI`, else a local
    file store `<run_dir>/mlruns` (`mlflow ui --backend-store-uri <run_dir>/mlruns`).
    mlflow 3 keeps the file store in maintenance mode behind
    `MLFLOW_ALLOW_FILE_STORE=true`, which is set for that default only.
    """

    def __init__(
        self,
        run_dir: str | Path | None = None,
        project_name: str = "nexrl",
        experiment_name: str | None = None,
        run_config: Mapping[str, object] | None = None,
        tracking_uri: str | None = None,
        **_: object,
    ) -> None:
        try:
            from mlflow.tracking import MlflowClient
        except ImportError as exc:
            raise ImportError(
                "logger.backend 'mlflow' needs the mlflow package: pip install 'nexrl[mlflow]'"
            ) from exc
        uri = tracking_uri or os.environ.get("MLFLOW_TRACKING_URI")
        if not uri:
            uri = (Path(run_dir or ".") / "mlruns").resolve().as_uri()
            os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
        self.tracking_uri = uri
        self._client = MlflowClient(tracking_uri=uri)
        ids = TrackerIds(run_dir)
        self.run_id = ids.get("mlflow") or self._new_run(project_name, experiment_name)
        ids.set("mlflow", self.run_id)
        self._log_config(dict(run_config or {}))

    def _new_run(self, project_name: str, experiment_name: str | None) -> str:
        experiment = self._client.get_experiment_by_name(project_name)
        exp_id = experiment.experiment_id if experiment else None
        exp_id = exp_id or self._client.create_experiment(project_name)
        return self._client.create_run(exp_id, run_name=experiment_name).info.run_id

    def _log_config(self, config: dict[str, object]) -> None:
        """Params once per key: a resumed run keeps its original values (mlflow forbids
        changing a param); the current config is always in the `config.yaml` artifact."""
        from mlflow.entities import Param

        if not config:
            return
        known = self._client.get_run(self.run_id).data.params
        params = [
            Param(k, str(v)[:6000]) for k, v in flatten_config(config).items() if k not in known
        ]
        for i in range(0, len(params), 100):  # mlflow's batch limit
            self._client.log_batch(self.run_id, params=params[i : i + 100])
        self._client.log_dict(self.run_id, config, "config.yaml")

    def log(self, data: Mapping[str, object], step: int) -> None:
        import time

        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(k, v, now, step) for k, v in _scalars(data).items()]
        for i in range(0, len(metrics), 1000):
            self._client.log_batch(self.run_id, metrics=metrics[i : i + 1000])

    def log_samples(self, rows: list[dict[str, object]], step: int) -> None:
        columns = {c: [row.get(c) for row in rows] for c in SAMPLE_COLUMNS}
        self._client.log_table(self.run_id, columns, f"samples/step_{step:06d}.json")

    def close(self) -> None:
        self._client.set_terminated(self.run_id)


LOGGER_BACKENDS: Registry[Callable[..., LoggerBackend]] = Registry("backend", "logger.backend")
"""name -> backend class, called with the logger's keyword arguments (`run_dir`,
`project_name`, `experiment_name`, `config`, ...; take `**kwargs`);
`LOGGER_BACKENDS.add("mine", MyBackend)` makes `logger.backend=[jsonl,mine]` pick it."""
LOGGER_BACKENDS.add("jsonl", JsonlBackend)
LOGGER_BACKENDS.add("console", ConsoleBackend)
LOGGER_BACKENDS.add("tensorboard", TensorboardBackend)
LOGGER_BACKENDS.add("wandb", WandbBackend)
LOGGER_BACKENDS.add("mlflow", MlflowBackend)


def parse_backends(backend: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """`"console,jsonl"` or `["console"]` or None -> validated list of backend names."""
    if backend is None:
        return []
    names = backend.split(",") if isinstance(backend, str) else list(backend)
    names = [n.strip() for n in names if n and n.strip()]
    for name in names:
        LOGGER_BACKENDS.get(name)  # a registered name or "pkg.module:Class", else raises
    return list(dict.fromkeys(names))


def check_backend(backend: str) -> None:
    """Raise naming the choices unless `backend` is one `ExperimentLogger.post` takes."""
    if backend not in ("metrics", "all", "samples", *LOGGER_BACKENDS):
        raise ValueError(
            f"experiment_logger_post: unknown backend {backend!r}; valid choices: "
            f"metrics, all, samples, {', '.join(LOGGER_BACKENDS)}"
        )


class ExperimentLogger:
    """Fan-out of metrics and sample tables to the chosen backends; thread-safe.

    `post(backend="metrics", data=..., step=...)` (alias "all") logs to every
    backend; a backend's own name logs to it alone (dropped if it is not
    enabled); `post(backend="samples", rows=[...], step=...)` is `log_samples`,
    so callers behind the activity-tracker proxy (Ray actors) need no new method.
    `total_steps` (constructor or post kwarg) feeds the console ETA.
    """

    def __init__(
        self,
        backends: str | list[str] | None = None,
        run_dir: str | Path | None = None,
        project_name: str = "nexrl",
        experiment_name: str | None = None,
        total_steps: int | None = None,
        console_keys: list[str] | None = None,
        run_config: Mapping[str, object] | None = None,
        sample_every: int = 10,
        sample_rows: int = 8,
        tracking_uri: str | None = None,
    ) -> None:
        names = parse_backends(backends)
        if run_dir is not None and "jsonl" not in names:
            names.insert(0, "jsonl")
        if "jsonl" in names and run_dir is None:
            raise ValueError("logger.backend 'jsonl' needs a run directory (logger.run_dir)")
        if run_config is None:
            run_config = _load_run_config(run_dir)
        self.run_config = dict(run_config)
        self.sample_every = int(sample_every)
        self.sample_rows = int(sample_rows)
        kwargs = dict(
            run_dir=run_dir,
            project_name=project_name,
            experiment_name=experiment_name,
            console_keys=console_keys,
            run_config=self.run_config,
            tracking_uri=tracking_uri,
        )
        self.backends: dict[str, LoggerBackend] = {
            n: LOGGER_BACKENDS.get(n)(**kwargs) for n in names
        }
        self._lock = threading.Lock()
        self._last_step = 0
        self.set_total_steps(total_steps)

    def set_total_steps(self, total_steps: int | None) -> None:
        console = self.backends.get("console")
        if total_steps is not None and isinstance(console, ConsoleBackend):
            console.total_steps = int(total_steps)

    def post(
        self,
        backend: str = "metrics",
        data: Mapping[str, object] | None = None,
        step: int | None = None,
        total_steps: int | None = None,
        rows: Sequence[Mapping[str, object]] | None = None,
        **_: object,
    ) -> None:
        """Log `data` at `step` (default: the last step seen) to `backend`."""
        self.set_total_steps(total_steps)
        if backend == "samples":
            self.log_samples(rows or [], step)
            return
        if not data:
            return
        if backend in ("metrics", "all"):
            targets = list(self.backends.values())
        else:
            check_backend(backend)
            targets = [self.backends[backend]] if backend in self.backends else []
        with self._lock:
            step = self._last_step if step is None else int(step)
            self._last_step = max(self._last_step, step)
            for target in targets:
                target.log(dict(data), step)

    def wants_samples(self, step: int) -> bool:
        """True on the steps that get a sample table (`sample_every`; 0 turns it off)."""
        return self.sample_every > 0 and step % self.sample_every == 0

    def log_samples(self, rows: Sequence[Mapping[str, object]], step: int | None = None) -> None:
        """Log a table of sample completions (columns `SAMPLE_COLUMNS`) on the steps
        `wants_samples` picks, at most `sample_rows` rows; other steps are dropped, so a
        caller may offer samples every step."""
        with self._lock:
            step = self._last_step if step is None else int(step)
            if not rows or not self.wants_samples(step):
                return
            table = [{c: row.get(c) for c in SAMPLE_COLUMNS} for row in rows[: self.sample_rows]]
            for target in self.backends.values():
                target.log_samples(table, step)

    def close(self) -> None:
        with self._lock:
            for target in self.backends.values():
                target.close()
            self.backends = {}
