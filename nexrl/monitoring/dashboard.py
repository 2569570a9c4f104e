"""A live status page for a run, served on loopback with the standard library.

`Dashboard(tracker, run_dir, state_fn)` serves two routes from a daemon thread:
`/` is one self-contained HTML page (inline JS and SVG, no CDN: training
machines often have no internet) and `/api/status` is the JSON the page polls
every second. The JSON joins three sources that already exist:

- the `ActivityTracker` (in-flight work per module, counters, training step,
  error health and recent errors), reached through `execute` so a Ray actor
  tracker works the same way;
- `<run_dir>/metrics.jsonl`, read incrementally (only new complete lines per
  poll; a file that shrank, as a resume rewrites it, is re-read from the start);
- `state_fn()`, a callable the controller passes in returning whatever pipeline
  state it wants shown (pool sizes, admission snapshot); the page prints it as is.

The standard library's `ThreadingHTTPServer` is used rather than FastAPI
because a local run does not install the server stack (`serve` extra).
The server refuses non-loopback hosts: the page has no authentication.
"""

from __future__ import annotations

import ipaddress
import json
import logging
import re
import socket
import threading
import time
from collections.abc import Callable
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from importlib import resources
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from nexrl.execute import execute
from nexrl.monitoring.errors import ErrorReporter
from nexrl.types import DEFAULT_MODEL_TAG

if TYPE_CHECKING:
    from nexrl.monitoring.activity import ActivityTracker
    from nexrl.system import ModuleSystem

logger = logging.getLogger(__name__)

SERIES_KEYS = {
    "reward": "reward/mean",
    "validation": "val/reward",
    "throughput": "throughput/samples_per_s",
}
"""Chart name -> metrics.jsonl key plotted against `step`."""

_INFLIGHT_LINE = re.compile(r"^\s+(?P<module>[^:]+): (?P<work>.*) \((?P<age>[\d.]+)s\)$")


def check_loopback(host: str) -> str:
    """`host` if it is a loopback address or `localhost`; else a ValueError naming the key."""
    if host == "localhost":
        return host
    try:
        if ipaddress.ip_address(host).is_loopback:
            return host
    except ValueError:
        pass
    raise ValueError(
        f"dashboard.host must be a loopback address (127.0.0.1, ::1 or localhost), got "
        f"{host!r}: the status page has no authentication"
    )


class MetricsTail:
    """Incremental reader of `metrics.jsonl` keeping the chart series and the last histogram."""

    def __init__(self, path: Path, max_points: int = 5000) -> None:
        self.path = path
        self.max_points = max_points
        self._offset = 0
        self._lock = threading.Lock()
        self._reset()

    def _reset(self) -> None:
        self._offset = 0
        self.series: dict[str, list[list[float]]] = {name: [] for name in SERIES_KEYS}
        self.staleness: dict[str, int] = {}
        self.staleness_step: int | None = None
        self.last_step: int | None = None

    def poll(self) -> None:
        """Read the complete lines appended since the last poll (thread-safe)."""
        with self._lock:
            if not self.path.exists():
                return
            if self.path.stat().st_size < self._offset:  # rewritten (resume truncation)
                self._reset()
            with self.path.open("rb") as f:
                f.seek(self._offset)
                data = f.read()
            end = data.rfind(b"\n") + 1  # a partly written last line waits for the next poll
            self._offset += end
            for raw in data[:end].splitlines():
                if raw.strip():
                    self._add(raw)

    def _add(self, raw: bytes) -> None:
        try:
            row = json.loads(raw)
        except json.JSONDecodeError:
            logger.warning("dashboard: skipping a malformed line of %s", self.path)
            return
        step = row.get("step") if isinstance(row, dict) else None
        if not isinstance(step, int | float):
            return
        self.last_step = max(self.last_step or 0, int(step))
        for name, key in SERIES_KEYS.items():
            value = row.get(key)
            if isinstance(value, int | float):
                points = self.series[name]
                points.append([step, value])
                del points[: max(0, len(points) - self.max_points)]
        hist = row.get("staleness/histogram")
        if isinstance(hist, dict):
            self.staleness = {str(k): v for k, v in hist.items()}
            self.staleness_step = int(step)

    def snapshot(self) -> dict[str, object]:
        with self._lock:
            return {
                "series": {k: list(v) for k, v in self.series.items()},
                "staleness": {"step": self.staleness_step, "histogram": dict(self.staleness)},
                "last_logged_step": self.last_step,
            }


class InflightItem(TypedDict):
    module: str
    work: str
    age_s: float


def parse_inflight(summary: str) -> list[InflightItem]:
    """The work items of `ActivityTracker.get_running_status_summary()` as dicts."""
    items: list[InflightItem] = []
    for line in summary.splitlines():
        m = _INFLIGHT_LINE.match(line)
        if m:
            items.append({"module": m["module"], "work": m["work"], "age_s": float(m["age"])})
    return items


def recent_errors(tracker: ActivityTracker, n: int = 20) -> list[dict[str, object]]:
    """The last `n` errors when the tracker is local (a Ray tracker shows only its health)."""
    reporter = getattr(tracker, "error_reporter", None)
    if not isinstance(reporter, ErrorReporter):
        return []
    return [
        {
            "time": e.timestamp,
            "module": e.module_name,
            "work": e.work_context,
            "severity": e.severity.value,
            "message": e.message,
        }
        for e in reporter.get_errors()[-n:]
    ]


def pipeline_state_fn(system: ModuleSystem) -> Callable[[], dict[str, object]]:
    """The `state_fn` for a `ModuleSystem`: pool sizes and the admission ledger, through
    the modules' public methods (so Ray actors work too)."""

    def state() -> dict[str, object]:
        return {
            "trajectory_pool_ready": execute(system.trajectory_pool.num_ready),
            "train_batch_pool": execute(system.train_batch_pool.qsize),
            "admission": execute(system.task_admission.snapshot, DEFAULT_MODEL_TAG),
        }

    return state


class Dashboard:
    """Serves the status page of one run on `http://host:port/` until `stop()`."""

    def __init__(
        self,
        tracker: ActivityTracker,
        run_dir: str | Path,
        state_fn: Callable[[], dict[str, object]] | None = None,
        host: str = "127.0.0.1",
        port: int = 0,
    ) -> None:
        self.tracker = tracker
        self.state_fn = state_fn
        self.host = check_loopback(host)
        if not 0 <= int(port) <= 65535:
            raise ValueError(f"dashboard.port must be in 0..65535 (0: any free port), got {port}")
        self.port = int(port)
        self.metrics = MetricsTail(Path(run_dir) / "metrics.jsonl")
        self._server: ThreadingHTTPServer | None = None
        self._thread: threading.Thread | None = None
        self._started = time.time()

    @property
    def url(self) -> str:
        if self._server is None:
            raise RuntimeError("Dashboard.url: the dashboard is not started")
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"http://{host}:{self._server.server_address[1]}/"

    def start(self) -> str:
        """Bind and serve in a daemon thread; returns the page's URL."""
        if self._server is not None:
            return self.url
        server_cls = _V6Server if ":" in self.host else ThreadingHTTPServer
        self._server = server_cls((self.host, self.port), _handler_for(self))
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="nexrl-dashboard", daemon=True
        )
        self._thread.start()
        logger.info("dashboard: %s", self.url)
        return self.url

    def stop(self) -> None:
        """Stop serving and release the port (idempotent)."""
        if self._server is None:
            return
        self._server.shutdown()
        self._server.server_close()
        if self._thread is not None:
            self._thread.join(timeout=5)
        self._server = self._thread = None

    def status(self) -> dict[str, object]:
        """Everything the page shows, as one JSON-able dict."""
        self.metrics.poll()
        inflight = parse_inflight(execute(self.tracker.get_running_status_summary))
        per_module: dict[str, int] = {}
        for item in inflight:
            per_module[item["module"]] = per_module.get(item["module"], 0) + 1
        return {
            "time": time.time(),
            "uptime_s": time.time() - self._started,
            "step": execute(self.tracker.get_training_step),
            "inflight": inflight,
            "inflight_per_module": per_module,
            "rollout_workers_busy": sum(m.startswith("rollout_worker") for m in per_module),
            "counters": execute(self.tracker.get_counters),
            "health": execute(self.tracker.get_error_health_status),
            "errors": recent_errors(self.tracker),
            "pipeline": self.state_fn() if self.state_fn is not None else {},
            **self.metrics.snapshot(),
        }


class _V6Server(ThreadingHTTPServer):
    address_family = socket.AF_INET6


def page_html() -> bytes:
    """The page, shipped as package data next to this module."""
    return resources.files("nexrl.monitoring").joinpath("dashboard_page.html").read_bytes()


def _handler_for(dashboard: Dashboard) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            path = self.path.split("?", 1)[0]
            if path in ("/", "/index.html"):
                self._send(HTTPStatus.OK, "text/html; charset=utf-8", page_html())
            elif path == "/api/status":
                try:
                    body = json.dumps(dashboard.status(), default=str).encode()
                except Exception as exc:  # the page shows why, the run goes on
                    logger.exception("dashboard: status failed")
                    err = json.dumps({"error": f"{type(exc).__name__}: {exc}"}).encode()
                    self._send(HTTPStatus.INTERNAL_SERVER_ERROR, "application/json", err)
                    return
                self._send(HTTPStatus.OK, "application/json", body)
            else:
                self._send(HTTPStatus.NOT_FOUND, "text/plain", b"not found")

        def _send(self, status: HTTPStatus, ctype: str, body: bytes) -> None:
            self.send_response(status)
            self.send_header("Content-Type", ctype)
            self.send_header("Content-Length", str(len(body)))
            self.send_header("Cache-Control", "no-store")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:  # noqa: A002
            logger.debug("dashboard: " + format, *args)

    return Handler
