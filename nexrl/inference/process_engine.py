"""`ProcessEngine`: the built-in `Engine` in a child process, for the HTTP server.

Why: the engine's scheduler thread re-acquires the GIL between every torch op.
In the server process the asyncio loop also wants the GIL (parsing requests,
writing responses); measured with a busy Python thread beside it, the engine
ran ~10x slower. vLLM splits its API server and engine core into processes for
the same reason. Here the HTTP process keeps only the tokenizer and talks to
the engine process over a `multiprocessing` pipe with JSON messages (orjson; no
pickle of request data):

    parent -> child  {"id", "op": "generate" | "update_weights" | "pause" | "resume" |
                      "abort" | "stats" | "ping" | "shutdown", ...}
    child -> parent  {"id", "result": ...} or {"id", "error": {"type", "message"}}
                     or, before the result of a streaming "generate",
                     {"id", "token": [sample_index, token_id, logprob, version]} per token
                     or, just before it exits after running out of memory, {"fatal": why}

A reader thread per child resolves one `Future` per message id; a watchdog
thread pings the child and restarts it when it dies or hangs (`ProcessEngine`).
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import os
import queue
import shutil
import tempfile
import threading
import weakref
from collections.abc import Callable
from concurrent.futures import Future
from concurrent.futures import TimeoutError as FutureTimeout
from dataclasses import asdict, dataclass, field
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import Any

import orjson

from nexrl.inference.engine_child import child_main
from nexrl.inference.health import (
    EngineDeadError,
    EngineRestartedError,
    RestartBudget,
    describe_exit,
)
from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    TokenCallback,
    WeightUpdateMeta,
)
from nexrl.inference.sampler import validate_params
from nexrl.spawn import spawn_context

_ERRORS = {"ValueError": ValueError, "KeyError": KeyError, "FileNotFoundError": FileNotFoundError}
_REPLAYED_OPS = ("generate", "update_weights", "pause", "resume", "abort", "stats")

logger = logging.getLogger(__name__)


@dataclass
class _Child:
    proc: SpawnProcess
    conn: Connection
    fatal: str | None = None  # what the child said before it stopped itself (OOM)
    outbox: queue.SimpleQueue = field(default_factory=queue.SimpleQueue)


@dataclass
class _Call:
    """One message awaiting its answer; replayed to a restarted engine when it can be."""

    op: str
    body: dict[str, object]
    future: Future
    convert: Callable[[Any], Any] | None = None
    on_token: TokenCallback | None = None
    attempts: int = 0
    streamed: bool = False
    child: _Child | None = None  # set for internal calls (pings, restore): never replayed


class ProcessEngine:
    """`InferenceEngine` whose `Engine` runs in a spawned child process, restarted on faults.

    Fault handling (see docs/reliability.md): a watchdog pings the child every
    `health_interval_s`; a child that exited (killed, out of memory) or did not
    answer within `health_timeout_s` (hung) is killed and replaced. The new child
    loads the last weights pushed (a private hard-linked snapshot, so a trainer
    rewriting its export folder cannot change them) with their version, is paused
    if the engine was, and gets every unanswered request again, at most
    `max_request_retries` times each; a request whose tokens were already
    streamed fails with the retryable `EngineRestartedError` instead. More than
    `max_restarts` restarts within `restart_window_s` leave the engine down
    (`EngineDeadError`).
    """

    supports_streaming = True

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        health_interval_s: float = 2.0,
        health_timeout_s: float = 30.0,
        max_restarts: int = 3,
        restart_window_s: float = 600.0,
        max_request_retries: int = 1,
        **options: object,
    ) -> None:
        from transformers import AutoTokenizer

        if model_path is None:
            from nexrl.models.tiny import default_model_path

            model_path = default_model_path()
        self.model_path = str(model_path)
        self._options = options
        self.health_interval_s, self.health_timeout_s = health_interval_s, health_timeout_s
        self.max_request_retries = max_request_retries
        self._budget = RestartBudget(max_restarts, restart_window_s)
        self._lock = threading.RLock()  # guards _child, _calls, _dead
        self._restart_lock = threading.Lock()  # one restart at a time
        self._calls: dict[int, _Call] = {}
        self._ids = itertools.count()
        self._weights: tuple[int, str] | None = None  # (version, private snapshot folder)
        self._paused = False
        self._dead: str | None = None
        self._closing = False
        self.restarts = 0
        self.restart_reasons: list[str] = []
        self._version = 0
        self._stop = threading.Event()
        self._child = self._spawn()
        self._weights_root = Path(tempfile.mkdtemp(prefix="nexrl-engine-weights-"))
        # removed by `shutdown`, else when this object is collected or the process exits
        self._cleanup = weakref.finalize(self, shutil.rmtree, self._weights_root, True)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_path)
        self._watchdog = threading.Thread(
            target=self._watch, name="nexrl-engine-watch", daemon=True
        )
        self._watchdog.start()

    # -- child lifecycle ------------------------------------------------------------------
    def _spawn(self) -> _Child:
        ctx = spawn_context()
        conn, child_conn = ctx.Pipe()
        proc = ctx.Process(
            target=child_main, args=(child_conn, self.model_path, dict(self._options)), daemon=True
        )
        proc.start()
        child_conn.close()
        try:
            info = orjson.loads(conn.recv_bytes())
        except (EOFError, OSError) as exc:
            proc.join(timeout=5)
            raise RuntimeError(
                f"engine process died while starting: {describe_exit(proc.exitcode)}"
            ) from exc
        if "error" in info:
            raise RuntimeError(f"engine process failed to start: {info['error']}")
        self.max_model_len, self.max_batch_size = info["max_model_len"], info["max_batch_size"]
        child = _Child(proc, conn)
        for target, name in ((self._read, "nexrl-engine-ipc"), (self._drain, "nexrl-engine-out")):
            threading.Thread(target=target, args=(child,), name=name, daemon=True).start()
        return child

    @property
    def pid(self) -> int:
        """Process id of the current engine process (changes on restart)."""
        pid = self._child.proc.pid
        if pid is None:  # never: a child is started before it is installed
            raise RuntimeError("the engine process was not started")
        return pid

    def _watch(self) -> None:
        while not self._stop.wait(self.health_interval_s):
            with self._lock:
                child = self._child
            if self._dead or self._closing:
                return
            reason = self.probe(child)
            if reason is not None:
                self._restart(child, reason)

    def probe(self, child: _Child | None = None) -> str | None:
        """None if the engine process is alive and answers a ping in time, else what is wrong."""
        child = child or self._child
        if not child.proc.is_alive():
            return child.fatal or describe_exit(child.proc.exitcode)
        future = self._send("ping", child=child)
        try:
            future.result(timeout=self.health_timeout_s)
        except FutureTimeout:
            return f"no answer to a health check within {self.health_timeout_s:g} s (hung)"
        except Exception as exc:  # the child died under the ping
            return child.fatal or f"{describe_exit(child.proc.exitcode)} ({exc})"
        return None

    def _restart(self, old: _Child, reason: str) -> None:
        with self._restart_lock:
            if self._child is not old or self._dead or self._closing:
                return  # someone else restarted it already (reader and watchdog both saw it)
            if old.proc.is_alive():
                old.proc.kill()  # SIGKILL also ends a stopped (SIGSTOP) process
            old.proc.join(timeout=10)
            reason = old.fatal or reason
            if not self._budget.take():
                self._give_up(f"engine process {reason}; restart budget spent")
                return
            logger.warning("engine process %s; restarting it", reason)
            try:
                child = self._spawn()
                self._restore(child)
            except Exception as exc:  # a replacement that cannot start ends the engine
                self._give_up(f"engine process {reason}; restart failed: {exc}")
                return
            self.restarts += 1
            self.restart_reasons.append(reason)
            with self._lock:
                self._child = child
                calls = sorted(self._calls.items())
            self._replay(child, calls, reason)

    def _restore(self, child: _Child) -> None:
        """Bring a fresh child to the state callers expect: weights, version, paused."""
        limit = self.health_timeout_s * 10
        if self._weights is not None:
            version, path = self._weights
            self._send("update_weights", child=child, version=version, path=path).result(limit)
        if self._paused:
            self._send("pause", child=child).result(limit)

    def _replay(self, child: _Child, calls: list[tuple[int, _Call]], reason: str) -> None:
        for msg_id, call in calls:
            if call.op not in _REPLAYED_OPS or call.child is not None:
                continue
            if call.op == "generate" and (
                call.streamed or call.attempts >= self.max_request_retries
            ):
                self._finish(msg_id, exc=EngineRestartedError(f"engine process {reason}"))
                continue
            call.attempts += 1
            self._write(child, msg_id, call)

    def _give_up(self, reason: str) -> None:
        logger.error("%s; the engine stays down", reason)
        with self._lock:
            self._dead = reason
            calls = list(self._calls)
        for msg_id in calls:
            self._finish(msg_id, exc=EngineDeadError(reason))

    # -- messages -------------------------------------------------------------------------
    def _send(
        self,
        op: str,
        on_token: TokenCallback | None = None,
        convert: Callable[[Any], Any] | None = None,
        child: _Child | None = None,
        **body: object,
    ) -> Future:
        """Send one message; the future resolves to its result (passed through `convert`).

        With `child`, an internal call to that very process (ping, restore step):
        never replayed, failed when that process goes away.
        """
        future: Future = Future()
        if self._dead:
            future.set_exception(EngineDeadError(self._dead))
            return future
        msg_id = next(self._ids)
        call = _Call(op, body, future, convert, on_token, child=child)
        with self._lock:  # register and pick the target together (see _restart)
            self._calls[msg_id] = call
            target = child or self._child
        self._write(target, msg_id, call)
        return future

    def _write(self, child: _Child, msg_id: int, call: _Call) -> None:
        """Queue one message for the child's writer thread; never blocks the caller.

        A child that stopped reading (hung) fills the pipe: only its writer thread
        blocks, the ping behind it goes unanswered, and the restart replays the call.
        """
        child.outbox.put((msg_id, call))

    def _drain(self, child: _Child) -> None:
        """Writer thread of one child: sends its outbox until the child is gone."""
        while True:
            item = child.outbox.get()
            if item is None:
                return
            msg_id, call = item
            try:
                data = orjson.dumps({"id": msg_id, "op": call.op, **call.body})
            except (TypeError, ValueError) as exc:  # this call alone fails; the thread goes on
                self._finish(msg_id, exc=ValueError(f"{call.op}: cannot encode the request: {exc}"))
                continue
            try:
                child.conn.send_bytes(data)
            except (OSError, ValueError):  # a dead child: the restart replays this call
                if call.child is not None:
                    self._finish(msg_id, exc=RuntimeError("engine process exited"))

    def _call(self, op: str, **body: Any) -> Any:
        return self._send(op, **body).result()

    def _finish(self, msg_id: int, result: Any = None, exc: BaseException | None = None) -> None:
        with self._lock:
            call = self._calls.pop(msg_id, None)
        if call is None or call.future.done():
            return
        if exc is not None:
            call.future.set_exception(exc)
        else:
            call.future.set_result(result if call.convert is None else call.convert(result))

    def _read(self, child: _Child) -> None:
        while True:
            try:
                msg = orjson.loads(child.conn.recv_bytes())
            except (EOFError, OSError):
                break
            if "fatal" in msg:
                child.fatal = msg["fatal"]
                continue
            call = self._calls.get(msg["id"])
            if "token" in msg:
                if call is not None and call.on_token is not None:
                    call.streamed = True
                    call.on_token(*msg["token"])
                continue
            if "error" in msg:
                err = msg["error"]
                self._finish(msg["id"], exc=_ERRORS.get(err["type"], RuntimeError)(err["message"]))
            else:
                self._finish(msg["id"], msg["result"])
        child.proc.join(timeout=5)
        child.outbox.put(None)  # ends its writer thread once the queue is drained
        with self._lock:
            orphans = [i for i, c in self._calls.items() if c.child is child]
        for msg_id in orphans:  # pings and restore steps sent to this child
            self._finish(msg_id, exc=RuntimeError("engine process exited"))
        if not self._closing:
            self._restart(child, child.fatal or describe_exit(child.proc.exitcode))

    # -- InferenceEngine ------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    @property
    def stats(self) -> dict[str, int]:
        return self._call("stats")

    def submit(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> Future:
        """As `Engine.submit`; `on_token` runs on this process's pipe-reader thread.
        A request the engine would reject raises ValueError here, before it is sent (a
        replayed bad request must not cost the engine restarts)."""
        validate_params(request.sampling)
        return self._send(
            "generate",
            on_token,
            _response,
            request=_request_dict(request),
            stream=on_token is not None,
        )

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        return self.submit(request).result()

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await asyncio.wrap_future(self.submit(request))

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load `meta` (a folder or an in-memory state dict) from a private snapshot.

        The snapshot (hard links, or a copy across filesystems) is what a restarted
        engine loads again, labelled with `meta.version`.
        """
        snapshot = self._weights_root / f"v{meta.version}-{next(self._ids)}"
        snapshot.mkdir()
        try:
            if meta.path is None and meta.state_dict is not None:
                from safetensors.torch import save_file

                tensors = {k: v.contiguous() for k, v in meta.state_dict.items()}
                save_file(tensors, str(snapshot / "model.safetensors"))
            elif meta.path is not None:
                _link_tree(Path(meta.path), snapshot)
            else:
                raise ValueError("update_weights: the WeightUpdateMeta has no path or state_dict")
            self._call("update_weights", version=meta.version, path=str(snapshot))
        except BaseException:  # a failed update leaves nothing behind
            shutil.rmtree(snapshot, ignore_errors=True)
            raise
        previous, self._weights = self._weights, (meta.version, str(snapshot))
        self._version = meta.version
        if previous is not None:
            shutil.rmtree(previous[1], ignore_errors=True)

    def pause(self) -> None:
        self._call("pause")
        self._paused = True

    def resume(self) -> None:
        self._call("resume")
        self._paused = False

    def abort(self, rid: str | None = None) -> None:
        self._call("abort", rid=rid)

    def health(self) -> bool:
        return self._dead is None and self._child.proc.is_alive()

    def shutdown(self) -> None:
        self._closing = True
        self._stop.set()
        child = self._child
        if child.proc.is_alive() and not self._dead:
            try:
                self._send("shutdown", child=child).result(timeout=30)
            except Exception:  # a hung child is killed below
                logger.warning("engine process did not shut down cleanly; killing it")
            child.proc.join(timeout=30)
        if child.proc.is_alive():
            child.proc.kill()
            child.proc.join(timeout=10)
        child.conn.close()
        self._cleanup()


def _link_tree(src: Path, dst: Path) -> None:
    """Hard-link every file of `src` into `dst` (a copy where linking is not possible)."""
    if not src.is_dir():
        raise FileNotFoundError(f"weight folder {src} does not exist")
    for f in src.rglob("*"):
        target = dst / f.relative_to(src)
        if f.is_dir():
            target.mkdir(parents=True, exist_ok=True)
            continue
        target.parent.mkdir(parents=True, exist_ok=True)
        try:
            os.link(f, target)
        except OSError:
            shutil.copy2(f, target)


def _response(r: dict[str, Any]) -> GenerationResponse:
    outputs = [GenerationOutput(**o) for o in r["outputs"]]
    return GenerationResponse(r["input_ids"], outputs, r["rid"])


def _request_dict(request: GenerationRequest) -> dict[str, object]:
    return {
        "input_ids": list(request.input_ids),
        "sampling": asdict(request.sampling),
        "rid": request.rid,
        "metadata": request.metadata,
        "cache_output": request.cache_output,
    }
