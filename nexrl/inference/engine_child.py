"""The engine process's side of `ProcessEngine` (nexrl/inference/process_engine.py):
build the engine, then answer the parent's JSON messages over the pipe until 'shutdown'
or until the pipe closes. The message format is in process_engine's docstring."""

from __future__ import annotations

import os
import threading
from concurrent.futures import Future
from typing import Any

import orjson

from nexrl.inference.health import OOM_EXIT_CODE, is_oom
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta


def child_main(conn, model_path: str, options: dict[str, Any]) -> None:
    """Entry point of the engine process: serve messages until 'shutdown' or the pipe closes."""
    import signal

    import torch

    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the parent's to handle

    from nexrl.inference.factory import build_engine

    threads = options.pop("threads", None)
    if threads:
        # the engine computes on its own thread, with `threads`; this thread (loading,
        # messages) stays single-threaded so that the process holds one OpenMP team
        # (the engine option `threads`, docs/inference.md)
        torch.set_num_threads(1)
        options["threads"] = int(threads)
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
        if exc is not None and is_oom(exc):
            _die_of_oom(send, exc)
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
        except MemoryError as exc:
            _die_of_oom(send, exc)
        if msg["op"] == "shutdown":
            engine.shutdown()
            reply(msg["id"])
            return
        _handle(engine, msg, reply, send)


def _die_of_oom(send, exc: BaseException) -> None:
    """Out of memory leaves the engine in an unknown state: say so, then exit for a restart."""
    try:
        send({"fatal": f"ran out of memory ({type(exc).__name__}: {str(exc)[:200]})"})
    finally:
        os._exit(OOM_EXIT_CODE)


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
        elif op == "ping":
            result = True
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
