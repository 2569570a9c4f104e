"""Training-as-a-service: one `TorchTrainEngine` behind HTTP (`nexrl train-service`).

Endpoints (all POST bodies / tensor responses are safetensors bytes, see `wire.py`;
control bodies are JSON):

    GET  /health                 {"status": "ok", "step": n, "has_ref": bool,
                                  "fills_old_logprobs": bool}
    POST /compute_logprobs       batch -> {"logprobs": (B, T)}
    POST /compute_ref_logprobs   batch -> {"logprobs": (B, T)}, 204 without a reference
    POST /train_batch            batch + {"loss_fn", "loss_kwargs"} -> JSON metrics
    POST /save, /load            {"path": str} -> {"step": n}
    POST /export_weights         {"path": str | null} -> JSON {"path"} or safetensors state dict

Engine calls are serialised by one lock (an optimizer step is not reentrant).
When an API key is configured every endpoint except /health requires
`Authorization: Bearer <key>`. The service binds 127.0.0.1 unless told otherwise.
It runs one engine process; data parallel behind the service is not wired yet.
"""

from __future__ import annotations

import argparse
import threading
from collections.abc import Sequence
from typing import Any

from fastapi import Depends, FastAPI, HTTPException, Request, Response
from omegaconf import OmegaConf

from nexrl.training import wire
from nexrl.training.torch_engine import TorchTrainEngine


def create_app(engine: TorchTrainEngine, api_key: str | None = None) -> FastAPI:
    """FastAPI app exposing `engine`; `api_key` guards every endpoint but /health."""
    app = FastAPI(title="nexrl train service")
    lock = threading.Lock()

    def auth(request: Request) -> None:
        if api_key and request.headers.get("authorization") != f"Bearer {api_key}":
            raise HTTPException(status_code=401, detail="missing or wrong API key")

    def tensors(payload: dict) -> Response:
        return Response(content=wire.pack(payload), media_type=wire.CONTENT_TYPE)

    @app.get("/health")
    def health() -> dict[str, object]:
        return {
            "status": "ok",
            "step": engine.step,
            "has_ref": engine.ref_model is not None,
            # `train_batch` without `old_logprobs` takes them from its own forward: the
            # client then skips its no-grad old-logprob pass (one update per batch)
            "fills_old_logprobs": bool(getattr(engine, "fills_old_logprobs", False)),
        }

    @app.post("/compute_logprobs", dependencies=[Depends(auth)])
    async def compute_logprobs(request: Request) -> Response:
        batch, _ = wire.unpack_batch(await request.body())
        with lock:
            return tensors({"logprobs": engine.compute_logprobs(batch)})

    @app.post("/compute_ref_logprobs", dependencies=[Depends(auth)])
    async def compute_ref_logprobs(request: Request) -> Response:
        batch, _ = wire.unpack_batch(await request.body())
        with lock:
            out = engine.compute_ref_logprobs(batch)
        return Response(status_code=204) if out is None else tensors({"logprobs": out})

    @app.post("/train_batch", dependencies=[Depends(auth)])
    async def train_batch(request: Request) -> dict[str, float]:
        batch, args = wire.unpack_batch(await request.body())
        if "loss_fn" not in args:
            raise HTTPException(status_code=422, detail="train_batch needs 'loss_fn'")
        with lock:
            return engine.train_batch(batch, args["loss_fn"], args.get("loss_kwargs") or {})

    @app.post("/save", dependencies=[Depends(auth)])
    def save(body: dict[str, object]) -> dict[str, int]:
        with lock:
            engine.save(_path(body))
            return {"step": engine.step}

    @app.post("/load", dependencies=[Depends(auth)])
    def load(body: dict[str, object]) -> dict[str, int]:
        with lock:
            engine.load(_path(body))
            return {"step": engine.step}

    @app.post("/export_weights", dependencies=[Depends(auth)])
    def export_weights(body: dict[str, Any]) -> Any:
        with lock:
            out = engine.export_weights(body.get("path"))
        return {"path": out} if isinstance(out, str) else tensors(out)

    return app


def _path(body: dict[str, object]) -> str:
    path = body.get("path")
    if not isinstance(path, str):
        raise HTTPException(status_code=422, detail="body needs a string 'path'")
    return path


def parse_args(argv: Sequence[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="nexrl train-service", description=__doc__.split("\n")[0])
    p.add_argument("--model-path", default=None, help="HF model dir (default: embedded tiny)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8765)
    p.add_argument("--api-key", default=None, help="require 'Authorization: Bearer KEY'")
    p.add_argument("overrides", nargs="*", help="engine config overrides, e.g. lr=1e-5")
    return p.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    """`nexrl train-service [--model-path P] [--port N] [key=value ...]`."""
    import uvicorn

    from nexrl.models.tiny import default_model_path
    from nexrl.training.config import EngineConfig

    args = parse_args(argv)
    overrides = OmegaConf.to_container(OmegaConf.from_dotlist(list(args.overrides)))
    engine = TorchTrainEngine(
        EngineConfig.from_mapping(overrides),  # type: ignore[arg-type]
        str(args.model_path or default_model_path()),
    )
    app = create_app(engine, args.api_key)
    uvicorn.run(app, host=args.host, port=args.port)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
