"""Experiment logging: one `ExperimentLogger` fanning out to configured backends.

Backends are plain classes with `log(data, step)` and `close()`, chosen by name
from `LOGGER_BACKENDS` (an explicit registry). `jsonl` is always on when a run
directory is set, because `metrics.jsonl` is the run's durable record (tests and
the e2e check read it); `console`, `tensorboard` and `wandb` are opt-in. The
optional packages are imported only when their backend is asked for, so a
missing `wandb` fails at start with an install hint instead of at import.
"""

from __future__ import annotations

import json
import logging
import math
import threading
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

logger = logging.getLogger(__name__)

DEFAULT_CONSOLE_KEYS = ("reward", "train/reward", "val/reward", "throughput/tokens_per_s")


class LoggerBackend(Protocol):
    def log(self, data: Mapping[str, Any], step: int) -> None: ...

    def close(self) -> None: ...


def _to_jsonable(value: Any) -> Any:
    """Tensors / numpy scalars to Python numbers; anything else unknown to str."""
    if hasattr(value, "item") and getattr(value, "ndim", 0) == 0:
        return value.item()
    if hasattr(value, "tolist"):
        return value.tolist()
    return str(value)


class JsonlBackend:
    """Appends one JSON object per call to `<run_dir>/metrics.jsonl`, flushed per line."""

    def __init__(self, run_dir: str | Path, **_: Any) -> None:
        self.path = Path(run_dir) / "metrics.jsonl"
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._file = self.path.open("a", encoding="utf-8")

    def log(self, data: Mapping[str, Any], step: int) -> None:
        line = json.dumps({"step": step, **data}, default=_to_jsonable)
        self._file.write(line + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()


class ConsoleBackend:
    """A compact rich line per step: step/total, chosen metrics, s/step and ETA.

    Seconds per step are measured between successive new steps in this process;
    the ETA is `(total_steps - step) * s/step` once `total_steps` is known.
    """

    def __init__(self, console_keys: list[str] | None = None, **_: Any) -> None:
        from rich.console import Console

        self._console = Console(highlight=False, soft_wrap=True)  # one line per step
        self._keys = list(console_keys) if console_keys is not None else list(DEFAULT_CONSOLE_KEYS)
        self.total_steps: int | None = None
        self._first: tuple[int, float] | None = None

    def format_line(self, data: Mapping[str, Any], step: int, now: float) -> str:
        parts = [f"step {step}" + (f"/{self.total_steps}" if self.total_steps else "")]
        for key in self._keys:
            if key in data:
                parts.append(f"{key} {_fmt(data[key])}")
        if self._first is None:
            self._first = (step, now)
        first_step, first_t = self._first
        if step > first_step:
            per_step = (now - first_t) / (step - first_step)
            parts.append(f"{per_step:.2f} s/step")
            if self.total_steps:
                parts.append(f"ETA {_fmt_duration(max(0, self.total_steps - step) * per_step)}")
        return " | ".join(parts)

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._console.print(self.format_line(data, step, time.monotonic()))

    def close(self) -> None:
        pass


class TensorboardBackend:
    def __init__(self, run_dir: str | Path | None = None, **_: Any) -> None:
        try:
            from torch.utils.tensorboard import SummaryWriter
        except ImportError as exc:
            raise ImportError(
                "logger.backend 'tensorboard' needs the tensorboard package: "
                "pip install 'nexrl[tensorboard]'"
            ) from exc
        self._writer = SummaryWriter(log_dir=str(Path(run_dir or ".") / "tensorboard"))

    def log(self, data: Mapping[str, Any], step: int) -> None:
        for key, value in data.items():
            if isinstance(value, int | float) and not isinstance(value, bool):
                self._writer.add_scalar(key, value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandbBackend:
    def __init__(
        self,
        run_dir: str | Path | None = None,
        project_name: str = "nexrl",
        experiment_name: str | None = None,
        run_config: Mapping[str, Any] | None = None,
        **_: Any,
    ) -> None:
        try:
            import wandb
        except ImportError as exc:
            raise ImportError(
                "logger.backend 'wandb' needs the wandb package: pip install 'nexrl[wandb]'"
            ) from exc
        self._run = wandb.init(
            project=project_name,
            name=experiment_name,
            dir=str(run_dir) if run_dir else None,
            config=dict(run_config or {}),
        )

    def log(self, data: Mapping[str, Any], step: int) -> None:
        self._run.log(dict(data), step=step)

    def close(self) -> None:
        self._run.finish()


LOGGER_BACKENDS: dict[str, Callable[..., LoggerBackend]] = {
    "jsonl": JsonlBackend,
    "console": ConsoleBackend,
    "tensorboard": TensorboardBackend,
    "wandb": WandbBackend,
}


def parse_backends(backend: str | list[str] | tuple[str, ...] | None) -> list[str]:
    """`"console,jsonl"` or `["console"]` or None -> validated list of backend names."""
    if backend is None:
        return []
    names = backend.split(",") if isinstance(backend, str) else list(backend)
    names = [n.strip() for n in names if n and n.strip()]
    for name in names:
        if name not in LOGGER_BACKENDS:
            raise ValueError(
                f"logger.backend: unknown backend {name!r}; "
                f"valid choices: {', '.join(LOGGER_BACKENDS)}"
            )
    return list(dict.fromkeys(names))


class ExperimentLogger:
    """Fan-out of metrics to the chosen backends; thread-safe.

    `post(backend="metrics", data=..., step=...)` (alias "all") logs to every
    backend; a backend's own name logs to it alone (dropped if it is not
    enabled). `total_steps` (constructor or post kwarg) feeds the console ETA.
    """

    def __init__(
        self,
        backends: str | list[str] | None = None,
        run_dir: str | Path | None = None,
        project_name: str = "nexrl",
        experiment_name: str | None = None,
        total_steps: int | None = None,
        console_keys: list[str] | None = None,
        run_config: Mapping[str, Any] | None = None,
    ) -> None:
        names = parse_backends(backends)
        if run_dir is not None and "jsonl" not in names:
            names.insert(0, "jsonl")
        if "jsonl" in names and run_dir is None:
            raise ValueError("logger.backend 'jsonl' needs a run directory (logger.run_dir)")
        kwargs = dict(
            run_dir=run_dir,
            project_name=project_name,
            experiment_name=experiment_name,
            console_keys=console_keys,
            run_config=run_config,
        )
        self.backends: dict[str, LoggerBackend] = {n: LOGGER_BACKENDS[n](**kwargs) for n in names}
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
        data: Mapping[str, Any] | None = None,
        step: int | None = None,
        total_steps: int | None = None,
        **_: Any,
    ) -> None:
        """Log `data` at `step` (default: the last step seen) to `backend`."""
        self.set_total_steps(total_steps)
        if not data:
            return
        if backend in ("metrics", "all"):
            targets = list(self.backends.values())
        elif backend in LOGGER_BACKENDS:
            targets = [self.backends[backend]] if backend in self.backends else []
        else:
            raise ValueError(
                f"experiment_logger_post: unknown backend {backend!r}; valid choices: "
                f"metrics, all, {', '.join(LOGGER_BACKENDS)}"
            )
        with self._lock:
            step = self._last_step if step is None else int(step)
            self._last_step = max(self._last_step, step)
            for target in targets:
                target.log(dict(data), step)

    def close(self) -> None:
        with self._lock:
            for target in self.backends.values():
                target.close()
            self.backends = {}


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}" if math.isfinite(value) else str(value)
    return str(value)


def _fmt_duration(seconds: float) -> str:
    seconds = int(round(seconds))
    h, rem = divmod(seconds, 3600)
    m, s = divmod(rem, 60)
    return f"{h}h{m:02d}m{s:02d}s" if h else f"{m}m{s:02d}s"
