"""`ProcessTrainEngine`: the torch train engine in a child process of its own
(`service.train_service.backend=process`).

Why: in this process the trainer shares the interpreter lock with the inference
engine's scheduler thread and the rollout threads. In fully-async training on 2
CPU cores the update took 0.199 s beside them against 0.155 s in a process of
its own (docs/performance.md). The HTTP train service separates them too, but
it exports weights to files and pushes them over HTTP; here the weights cross
through one file mapped by both processes (in /dev/shm when it has room).

Start-up: the child imports torch, transformers and the engine first, then takes
its config (the one pickled message: both ends are this code). `nexrl train` and the
controller spawn one ahead (nexrl/training/trainer_spare.py), so those imports run
while the parent imports and builds the rest of the run.

Wire: one pipe, one call at a time. Each message is `wire.pack` bytes: the
tensors of a batch or of a result, plus JSON arguments.

    parent -> child  {"op": name, ...op arguments}; tensors: the batch for
                     compute_logprobs, compute_ref_logprobs and train_batch
    child -> parent  {"step": n, "result": ...} or {"error": [type, base, message]};
                     tensors: {"logprobs"} for the logprob ops

Ops: compute_logprobs, compute_ref_logprobs, train_batch, save, load, export
(an HF folder at "path", or, without one, into the shared buffer: the answer
then names the buffer file and its layout whenever they are new) and shutdown.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import traceback
from typing import Any

import torch

from nexrl.inference.health import describe_exit
from nexrl.run_setup import collector_paused, freeze_setup_heap
from nexrl.training import trainer_spare, wire
from nexrl.training.config import EngineConfig
from nexrl.types import Batch

_ERRORS: dict[str, type[Exception]] = {
    e.__name__: e for e in (ValueError, KeyError, TypeError, FileNotFoundError, OSError)
}
_ALIGN = 64  # bytes: every tensor of the shared buffer starts on a cache line
Layout = list[tuple[str, str, list[int], int]]  # (name, dtype, shape, byte offset)


class ProcessTrainEngine:
    """The `TrainEngine` protocol (nexrl/training/protocol.py) served by a spawned child
    that owns a `TorchTrainEngine`. A child that dies fails the call it was serving
    (and every later one) with its exit status: the trainer is not restarted, since
    its optimizer state would be lost; resume from a checkpoint instead."""

    def __init__(self, config: EngineConfig, model_path: str, threads: int | None = None) -> None:
        self._proc, self._conn = trainer_spare.take_spare() or trainer_spare.spawn()
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
        return int(self._proc.pid)

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        return self._call("compute_logprobs", batch)[0]["logprobs"]

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        if not self.has_ref:  # known since start-up: no batch crosses the pipe for nothing
            return None
        tensors, _ = self._call("compute_ref_logprobs", batch)
        return tensors.get("logprobs")

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: dict[str, Any]
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
        try:
            tensors, reply = wire.unpack(self._conn.recv_bytes())
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

    def _map(self, file: str, layout: Layout, nbytes: int) -> None:
        """Map the child's buffer file, then unlink it: both mappings outlive the name, so
        nothing is left behind whichever process ends first."""
        self._views = _views(file, layout, nbytes)
        os.unlink(file)


# -- the child -----------------------------------------------------------------------------
def child_main(conn: Any) -> None:
    """Import the engine, take its config from the pipe, build it and say so; then answer
    calls until told to stop or the pipe closes."""
    with collector_paused():  # what it builds lives as long as the process
        engine = _build_engine(conn)
    if engine is None:
        return
    freeze_setup_heap()  # full collections then skip the imports and the model
    start = {"fills_old_logprobs": bool(getattr(engine, "fills_old_logprobs", False))}
    start["has_ref"] = engine.ref_model is not None
    conn.send_bytes(wire.pack({}, {"step": engine.step, "result": start}))
    served = _Served(engine)
    while True:
        try:
            tensors, args = wire.unpack(conn.recv_bytes())
        except (EOFError, OSError):
            return  # the parent is gone
        if args.get("op") == "shutdown":
            return
        try:
            out, result = served.handle(args, tensors)
            reply = wire.pack(out, {"step": engine.step, "result": result})
        except Exception as exc:
            reply = wire.pack({}, {"error": _described(exc)})
        conn.send_bytes(reply)


def _build_engine(conn: Any) -> Any | None:
    """The engine, built from the config the parent sends; None when the parent sends none
    (a discarded spare) or the build fails (the parent is told why)."""
    from nexrl.training.torch_engine import TorchTrainEngine

    try:
        config, model_path, threads = conn.recv()
    except (EOFError, OSError):
        return None  # never used (a discarded spare, or the parent is gone)
    torch.set_num_threads(threads)
    try:
        return TorchTrainEngine(config, model_path)
    except Exception as exc:
        conn.send_bytes(wire.pack({}, {"error": _described(exc)}))
        return None


class _Served:
    """One engine's ops, and the shared buffer its exports go to."""

    def __init__(self, engine: Any) -> None:
        self.engine = engine
        self.layout: Layout = []
        self.views: list[torch.Tensor] = []

    def handle(self, args: dict[str, Any], tensors: dict) -> tuple[dict, Any]:
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
            return {}, self.export(engine.export_weights(None, copy=False))
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
