"""`ProcessEngine`: the built-in `Engine` in a child process, for the HTTP server.

Why: the engine's scheduler thread re-acquires the GIL between every torch op.
In the server process the asyncio loop also wants the GIL (parsing requests,
writing responses); measured with a busy Python thread beside it, the engine
ran ~10x slower. vLLM splits its API server and engine core into processes for
the same reason. Here the HTTP process keeps only the tokenizer and talks to
the engine process over a `multiprocessing` pipe with JSON messages (orjson; no
pickle of request data):

    parent -> child  {"id", "op": "generate" | "update_weights" | "pause" | "resume" |
                      "abort" | "stats" | "shutdown", ...}
    child -> parent  {"id", "result": ...} or {"id", "error": {"type", "message"}}
                     or, before the result of a streaming "generate",
                     {"id", "token": [sample_index, token_id, logprob, version]} per token

A reader thread in the parent resolves one `Future` per message id.
"""

from __future__ import annotations

import asyncio
import itertools
import multiprocessing as mp
import tempfile
import threading
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import asdict
from pathlib import Path
from typing import Any

import orjson

from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    SamplingParams,
    TokenCallback,
    WeightUpdateMeta,
)

_ERRORS = {"ValueError": ValueError, "KeyError": KeyError, "FileNotFoundError": FileNotFoundError}


class ProcessEngine:
    """`InferenceEngine` whose `Engine` runs in a spawned child process."""

    supports_streaming = True

    def __init__(self, model_path: str | Path | None = None, **options: Any) -> None:
        from transformers import AutoTokenizer

        if model_path is None:
            from nexrl.models.tiny import default_model_path

            model_path = default_model_path()
        ctx = mp.get_context("spawn")
        self._conn, child = ctx.Pipe()
        self._proc = ctx.Process(
            target=_child_main, args=(child, str(model_path), options), daemon=True
        )
        self._proc.start()
        child.close()
        info = orjson.loads(self._conn.recv_bytes())
        if "error" in info:
            raise RuntimeError(f"engine process failed to start: {info['error']}")
        self.model_path = str(model_path)
        self.max_model_len, self.max_batch_size = info["max_model_len"], info["max_batch_size"]
        self.tokenizer = AutoTokenizer.from_pretrained(str(model_path))
        self._version = 0
        self._ids = itertools.count()
        self._futures: dict[int, tuple[Future, Callable[[Any], Any] | None]] = {}
        self._streams: dict[int, TokenCallback] = {}
        self._send_lock = threading.Lock()
        self._reader = threading.Thread(target=self._read, name="nexrl-engine-ipc", daemon=True)
        self._reader.start()

    @property
    def version(self) -> int:
        return self._version

    @property
    def stats(self) -> dict[str, int]:
        return self._call("stats")

    def _send(
        self,
        op: str,
        on_token: TokenCallback | None = None,
        convert: Callable[[Any], Any] | None = None,
        **body: Any,
    ) -> Future:
        """Send one message; the future resolves to its result (passed through `convert`)."""
        future: Future = Future()
        msg_id = next(self._ids)
        self._futures[msg_id] = (future, convert)
        if on_token is not None:
            self._streams[msg_id] = on_token
        with self._send_lock:
            self._conn.send_bytes(orjson.dumps({"id": msg_id, "op": op, **body}))
        return future

    def _call(self, op: str, **body: Any) -> Any:
        return self._send(op, **body).result()

    def _read(self) -> None:
        while True:
            try:
                msg = orjson.loads(self._conn.recv_bytes())
            except (EOFError, OSError):
                break
            if "token" in msg:
                self._streams[msg["id"]](*msg["token"])
                continue
            self._streams.pop(msg["id"], None)
            future, convert = self._futures.pop(msg["id"])
            if "error" in msg:
                err = msg["error"]
                future.set_exception(_ERRORS.get(err["type"], RuntimeError)(err["message"]))
            else:
                future.set_result(msg["result"] if convert is None else convert(msg["result"]))
        for future, _ in self._futures.values():
            future.set_exception(RuntimeError("engine process exited"))

    def submit(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> Future:
        """As `Engine.submit`; `on_token` runs on this process's pipe-reader thread."""
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
        """From a directory; an in-memory state dict goes through a temporary safetensors file."""
        if meta.path is None and meta.state_dict is not None:
            from safetensors.torch import save_file

            with tempfile.TemporaryDirectory() as tmp:
                save_file(
                    {k: v.contiguous() for k, v in meta.state_dict.items()}, f"{tmp}/w.safetensors"
                )
                self._call("update_weights", version=meta.version, path=tmp)
        else:
            self._call("update_weights", version=meta.version, path=meta.path)
        self._version = meta.version

    def pause(self) -> None:
        self._call("pause")

    def resume(self) -> None:
        self._call("resume")

    def abort(self, rid: str | None = None) -> None:
        self._call("abort", rid=rid)

    def health(self) -> bool:
        return self._proc.is_alive()

    def shutdown(self) -> None:
        if self._proc.is_alive():
            self._call("shutdown")
            self._proc.join(timeout=30)
        self._conn.close()


def _child_main(conn, model_path: str, options: dict[str, Any]) -> None:
    """Entry point of the engine process: serve messages until 'shutdown' or the pipe closes."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    from nexrl.inference.engine import build_engine

    threads = options.pop("threads", None)
    if threads:
        torch.set_num_threads(int(threads))
    try:
        engine = build_engine(model_path, **options)
    except Exception as exc:  # reported to the parent, which raises
        conn.send_bytes(orjson.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        return
    info = {"max_model_len": engine.max_model_len}
    conn.send_bytes(orjson.dumps({**info, "max_batch_size": getattr(engine, "max_batch_size", 1)}))
    lock = threading.Lock()

    def send(body: dict[str, Any]) -> None:
        with lock:
            conn.send_bytes(orjson.dumps(body))

    def reply(msg_id: int, result: Any = None, exc: BaseException | None = None) -> None:
        if exc is not None:
            send({"id": msg_id, "error": {"type": type(exc).__name__, "message": str(exc)}})
        else:
            send({"id": msg_id, "result": result})

    while True:
        try:
            msg = orjson.loads(conn.recv_bytes())
        except (EOFError, OSError):  # parent gone
            engine.shutdown()
            return
        if msg["op"] == "shutdown":
            engine.shutdown()
            reply(msg["id"])
            return
        _handle(engine, msg, reply, send)


def _handle(engine, msg: dict[str, Any], reply, send) -> None:
    op, msg_id = msg["op"], msg["id"]
    try:
        if op == "generate":
            req = msg["request"]
            req["sampling"] = SamplingParams(**req["sampling"])
            on_token = None
            if msg.get("stream"):

                def on_token(*token: Any) -> None:
                    send({"id": msg_id, "token": list(token)})

            future = engine.submit(GenerationRequest(**req), on_token=on_token)
            future.add_done_callback(lambda f: _reply_future(f, msg_id, reply))
            return
        if op == "update_weights":
            engine.update_weights(WeightUpdateMeta(version=msg["version"], path=msg["path"]))
            result = None
        elif op == "abort":
            result = engine.abort(msg.get("rid"))
        elif op in ("pause", "resume"):
            result = getattr(engine, op)()
        elif op == "stats":
            result = dict(getattr(engine, "stats", {}))
        else:
            raise ValueError(f"unknown engine op {op!r}")
    except Exception as exc:  # sent back to the caller, which re-raises it
        reply(msg_id, exc=exc)
        return
    reply(msg_id, result)


def _reply_future(future: Future, msg_id: int, reply) -> None:
    if future.exception() is not None:
        reply(msg_id, exc=future.exception())
        return
    resp = future.result()
    outputs = [
        {
            "output_ids": o.output_ids,
            "output_logprobs": o.output_logprobs,
            "output_versions": o.output_versions,
            "finish_reason": o.finish_reason,
            "text": o.text,
        }
        for o in resp.outputs
    ]  # plain dicts: dataclasses.asdict deep-copies every list element
    reply(msg_id, {"input_ids": resp.input_ids, "outputs": outputs, "rid": resp.rid})


def _response(r: dict[str, Any]) -> GenerationResponse:
    outputs = [GenerationOutput(**o) for o in r["outputs"]]
    return GenerationResponse(r["input_ids"], outputs, r["rid"])


def _request_dict(request: GenerationRequest) -> dict[str, Any]:
    return {
        "input_ids": list(request.input_ids),
        "sampling": asdict(request.sampling),
        "rid": request.rid,
        "metadata": request.metadata,
    }
