"""`ProcessTrainEngine`: the torch train engine in a child process of its own
(`service.train_service.backend=process`).

Why: in this process the trainer shares the interpreter lock with the inference
engine's scheduler thread and the rollout threads. In fully-async training on 2
CPU cores the update took 0.199 s beside them against 0.155 s in a process of
its own (docs/performance.md). The HTTP train service separates them too, but
it exports weights to files and pushes them over HTTP; here the weights cross
through one file mapped by both processes (in /dev/shm when it has room).

Start-up: the child imports torch, transformers and the engine first, then takes
its config (the one pickled message: both ends are this code).

Wire: one pipe, one call at a time. Each message is `wire.pack` bytes: the
tensors of a batch or of a result, plus JSON arguments.

    parent -> child  {"op": name, ...op arguments}; tensors: the batch for
                     compute_logprobs, compute_ref_logprobs and train_batch
    child -> parent  {"step": n, "result": ...} or {"error": [type, base, message]};
                     tensors: {"logprobs"} for the logprob ops

Ops: compute_logprobs, compute_ref_logprobs, train_batch, save, load, export
(an HF folder at "path", or, without one, into the shared buffer: the answer
then names the buffer file and its layout whenever they are new) and shutdown.

Heartbeat: while the child serves a call it also sends `{"beat": true}` every
`HEARTBEAT_S` from a thread of its own. The parent waits for the answer at most
`heartbeat_timeout_s` between two messages: a child that is stopped (SIGSTOP) or
whose interpreter is stuck sends nothing, and the call fails within that time with
a message saying so (a killed child is seen at once, its pipe closes).
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
import traceback
from collections.abc import Mapping
from multiprocessing.connection import Connection
from multiprocessing.context import SpawnProcess
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from nexrl.inference.health import describe_exit
from nexrl.spawn import spawn_context
from nexrl.training import wire
from nexrl.training.config import EngineConfig
from nexrl.types import Batch

if TYPE_CHECKING:
    from nexrl.training.torch_engine import TorchTrainEngine

_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, KeyError, TypeError, FileNotFoundError, OSError)
}
_ALIGN = 64  # bytes: every tensor of the shared buffer starts on a cache line
HEARTBEAT_S = 1.0
"""Seconds between two heartbeats of a busy child."""
HEARTBEAT_TIMEOUT_S = 60.0
"""Default silence after which a busy child counts as stopped or hung."""
START_TIMEOUT_S = 900.0
"""The start answer may come after the child's imports (no heartbeat before them)."""
Layout = list[tuple[str, str, list[int], int]]  # (name, dtype, shape, byte offset)


class ProcessTrainEngine:
    """The `TrainEngine` protocol (nexrl/training/protocol.py) served by a spawned child
    that owns a `TorchTrainEngine`. A child that dies fails the call it was serving
    (and every later one) with its exit status: the trainer is not restarted, since
    its optimizer state would be lost; resume from a checkpoint instead."""

    def __init__(
        self,
        config: EngineConfig,
        model_path: str,
        threads: int | None = None,
        heartbeat_timeout_s: float = HEARTBEAT_TIMEOUT_S,
    ) -> None:
        self.heartbeat_timeout_s = heartbeat_timeout_s
        self._proc, self._conn = _spawn()
        self._lock = threading.Lock()
        self._step = 0
        self._views: dict[str, torch.Tensor] = {}  # name -> its tensor in the shared buffer
        try:
            self._conn.send((config, str(model_path), threads or torch.get_num_threads()))
        except OSError as exc:
            raise self._died("start") from exc
        info = self._answer("start")[1]
        self.fills_old_logprobs: bool = info["fills_old_logprobs"]
        self.has_ref: bool = info["has_ref"]

    @property
    def step(self) -> int:
        return self._step

    @property
    def pid(self) -> int:
        pid = self._proc.pid
        if pid is None:  # never: `_spawn` starts it
            raise RuntimeError("the trainer child was not started")
        return pid

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._call("compute_logprobs", batch)[0]["logprobs"]

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        if not self.has_ref:  # known since start-up: no batch crosses the pipe for nothing
            return None
        tensors, _ = self._call("compute_ref_logprobs", batch)
        return tensors.get("logprobs")

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: Mapping[str, object]
    ) -> dict[str, float]:
        args = {"loss_fn": loss_fn, "loss_kwargs": dict(loss_kwargs or {})}
        return self._call("train_batch", batch, **args)[1]

    def save(self, path: str) -> None:
        self._call("save", path=str(path))

    def load(self, path: str) -> None:
        self._call("load", path=str(path))

    def export_weights(
        self, path: str | None = None, copy: bool = True
    ) -> dict[str, torch.Tensor] | str:
        """An HF folder written at `path`, or the state dict copied out of the shared
        buffer (fresh tensors: the next export may overwrite the buffer); `copy=False`:
        the buffer's own views, valid until the next export."""
        if path is not None:
            return self._call("export", path=str(path))[1]
        with self._lock:
            answer = self._locked_call("export", None, {})[1]
            if answer["file"] is not None:
                self._map(answer["file"], answer["layout"], answer["nbytes"])
            return {name: view.clone() if copy else view for name, view in self._views.items()}

    def close(self) -> None:
        """Stop the child (it exits on its own when this process dies first)."""
        if self._proc.is_alive():
            try:
                with self._lock:
                    self._conn.send_bytes(wire.pack({}, {"op": "shutdown"}))
            except OSError:
                pass
            self._proc.join(timeout=10)
        if self._proc.is_alive():
            self._proc.kill()
            self._proc.join(timeout=5)
        self._conn.close()

    # -- wire ----------------------------------------------------------------------------
    def _call(self, op: str, batch: Batch | None = None, **args: Any) -> tuple[dict, Any]:
        with self._lock:
            return self._locked_call(op, batch, args)

    def _locked_call(self, op: str, batch: Batch | None, args: dict[str, Any]) -> tuple[dict, Any]:
        body = {"op": op, **args}
        try:
            if batch is None:
                self._conn.send_bytes(wire.pack({}, body))
            else:
                self._conn.send_bytes(wire.pack_batch(batch, body))
        except OSError as exc:
            raise self._died(op) from exc
        return self._answer(op)

    def _answer(self, op: str) -> tuple[dict, Any]:
        wait = START_TIMEOUT_S if op == "start" else self.heartbeat_timeout_s
        try:
            while True:
                if not self._conn.poll(wait):
                    raise self._silent(op, wait)
                tensors, reply = wire.unpack(self._conn.recv_bytes())
                if not reply.get("beat"):
                    break
                wait = self.heartbeat_timeout_s
        except (EOFError, OSError) as exc:
            raise self._died(op) from exc
        if "error" in reply:
            kind, base, message = reply["error"]
            raise _ERRORS.get(base, RuntimeError)(f"train process, {op}: {kind}: {message}")
        self._step = int(reply.get("step", self._step))
        return tensors, reply.get("result")

    def _died(self, op: str) -> RuntimeError:
        self._proc.join(timeout=5)
        return RuntimeError(
            f"the train process (pid {self._proc.pid}) ended during {op!r}: "
            f"{describe_exit(self._proc.exitcode)}"
        )

    def _silent(self, op: str, wait: float) -> RuntimeError:
        """A child that sent nothing for `wait` s: killed (it holds the run's only
        optimizer state, but a stopped or stuck one never gives it back)."""
        state = _process_state(self.pid)
        self._proc.kill()
        self._proc.join(timeout=10)
        return RuntimeError(
            f"the train process (pid {self._proc.pid}) sent no heartbeat for {wait:g} s "
            f"during {op!r} ({state}); it was killed: resume from the last checkpoint"
        )

    def _map(self, file: str, layout: Layout, nbytes: int) -> None:
        """Map the child's buffer file, then unlink it: both mappings outlive the name, so
        nothing is left behind whichever process ends first."""
        self._views = _views(file, layout, nbytes)
        os.unlink(file)


def _process_state(pid: int) -> str:
    """What /proc says a silent process is doing (Linux), for the error message."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return "state unknown"
    if state in ("T", "t"):
        return "stopped: SIGSTOP or a debugger; SIGCONT resumes it"
    return f"hung: process state {state}"


# -- the child -----------------------------------------------------------------------------
def _spawn() -> tuple[SpawnProcess, Connection]:
    """A new child and the parent's end of its pipe; the child waits for its config."""
    ctx = spawn_context()
    conn, child_conn = ctx.Pipe()
    proc = ctx.Process(target=child_main, args=(child_conn,), name="nexrl-trainer", daemon=True)
    proc.start()
    child_conn.close()
    return proc, conn


class _Beat:
    """The child's heartbeat: `{"beat": true}` every `HEARTBEAT_S` while `busy` is set.
    Every send of the child goes through `send` (one lock: messages never interleave)."""

    def __init__(self, conn: Connection) -> None:
        self.conn, self.lock, self.busy = conn, threading.Lock(), threading.Event()
        threading.Thread(target=self._run, name="nexrl-trainer-beat", daemon=True).start()

    def send(self, data: bytes) -> None:
        with self.lock:
            self.conn.send_bytes(data)

    def _run(self) -> None:
        beat = wire.pack({}, {"beat": True})
        while True:
            self.busy.wait()
            time.sleep(HEARTBEAT_S)
            if self.busy.is_set():
                try:
                    self.send(beat)
                except OSError:
                    return  # the parent is gone


def child_main(conn: Connection) -> None:
    """Import the engine, take its config from the pipe, build it and say so; then answer
    calls until told to stop or the pipe closes."""
    beat = _Beat(conn)
    engine = _build_engine(conn, beat)
    if engine is None:
        return
    start = {"fills_old_logprobs": bool(getattr(engine, "fills_old_logprobs", False))}
    start["has_ref"] = engine.ref_model is not None
    beat.busy.clear()
    beat.send(wire.pack({}, {"step": engine.step, "result": start}))
    served = _Served(engine)
    while True:
        try:
            tensors, args = wire.unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if args.get("op") == "shutdown":
            return
        beat.busy.set()
        try:
            out, result = served.handle(args, tensors)
            reply = wire.pack(out, {"step": engine.step, "result": result})
        except Exception as exc:
            reply = wire.pack({}, {"error": _described(exc)})
        beat.busy.clear()
        beat.send(reply)


def _build_engine(conn: Connection, beat: _Beat) -> TorchTrainEngine | None:
    """The engine, built from the config the parent sends; None when the parent sends none
    (a discarded spare) or the build fails (the parent is told why)."""
    from nexrl.training.torch_engine import TorchTrainEngine

    try:
        config, model_path, threads = conn.recv()
    except (EOFError, OSError):
        return None  # never used (a discarded spare, or the parent is gone)
    beat.busy.set()
    torch.set_num_threads(threads)
    try:
        return TorchTrainEngine(config, model_path)
    except Exception as exc:
        beat.busy.clear()
        beat.send(wire.pack({}, {"error": _described(exc)}))
        return None


class _Served:
    """One engine's ops, and the shared buffer its exports go to."""

    def __init__(self, engine: TorchTrainEngine) -> None:
        self.engine = engine
        self.layout: Layout = []
        self.views: list[torch.Tensor] = []

    def handle(
        self, args: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> tuple[dict[str, torch.Tensor], object]:
        op, engine = args["op"], self.engine
        if op == "compute_logprobs":
            return {"logprobs": engine.compute_logprobs(Batch(tensors))}, None
        if op == "compute_ref_logprobs":
            ref = engine.compute_ref_logprobs(Batch(tensors))
            return ({} if ref is None else {"logprobs": ref}), None
        if op == "train_batch":
            return {}, engine.train_batch(Batch(tensors), args["loss_fn"], args["loss_kwargs"])
        if op in ("save", "load"):
            getattr(engine, op)(args["path"])
            return {}, None
        if op == "export":
            if args.get("path"):
                return {}, engine.export_weights(args["path"])
            state = engine.export_weights(None, copy=False)
            assert not isinstance(state, str)  # no path: the state dict itself
            return {}, self.export(state)
        raise ValueError(f"unknown op {op!r}")

    def export(self, state: dict[str, torch.Tensor]) -> dict[str, Any]:
        """Copy `state` into the buffer; a new buffer (file and layout in the answer) the
        first time and whenever the tensors' names, shapes or dtypes change."""
        layout, nbytes = _layout_of(state)
        answer: dict[str, Any] = {"file": None}
        if layout != self.layout:
            file = _buffer_file(nbytes)
            self.views, self.layout = list(_views(file, layout, nbytes).values()), layout
            answer = {"file": file, "layout": layout, "nbytes": nbytes}
        for view, tensor in zip(self.views, state.values(), strict=True):
            view.copy_(tensor)
        return answer


def _layout_of(state: dict[str, torch.Tensor]) -> tuple[Layout, int]:
    layout: Layout = []
    offset = 0
    for name, tensor in state.items():
        layout.append((name, str(tensor.dtype).removeprefix("torch."), list(tensor.shape), offset))
        size = tensor.numel() * tensor.element_size()
        offset += -(-size // _ALIGN) * _ALIGN
    return layout, max(offset, _ALIGN)


def _views(file: str, layout: Layout, nbytes: int) -> dict[str, torch.Tensor]:
    """Each tensor of `layout` as a view of `file` mapped shared."""
    buffer = torch.from_file(file, shared=True, size=nbytes, dtype=torch.uint8)
    views = {}
    for name, dtype, shape, offset in layout:
        kind = getattr(torch, dtype)
        size = torch.Size(shape).numel() * kind.itemsize
        views[name] = buffer[offset : offset + size].view(kind).view(shape)
    return views


def _buffer_file(nbytes: int) -> str:
    """A new file of `nbytes` in /dev/shm (memory) when it has room, else the temp dir."""
    shm = "/dev/shm"
    room = os.path.isdir(shm) and shutil.disk_usage(shm).free > 2 * nbytes
    fd, path = tempfile.mkstemp(prefix="nexrl-train-weights-", dir=shm if room else None)
    os.ftruncate(fd, nbytes)
    os.close(fd)
    return path


def _described(exc: BaseException) -> list[str]:
    """[its type, its nearest built-in type (raised again in the parent), its message
    with where it was raised]."""
    base = next(c for c in type(exc).__mro__ if c.__module__ == "builtins")
    frames = traceback.extract_tb(exc.__traceback__)
    where = f" (raised at {frames[-1].filename}:{frames[-1].lineno})" if frames else ""
    return [type(exc).__name__, base.__name__, f"{exc}{where}"]
