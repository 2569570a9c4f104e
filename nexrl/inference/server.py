"""nexrl's OpenAI-compatible HTTP server around any in-process `InferenceEngine`.

`create_app(engine)` returns a FastAPI app; `nexrl.inference.serve` runs it
with uvicorn. Generation endpoints await `engine.agenerate`, so concurrent
HTTP requests land in the engine's running batch together. Control endpoints
(weight update, pause, abort) follow SGLang's names and bodies so that the
same trainer-side adapter drives SGLang and nexrl. Every error is a JSON body
`{"error": {"message", "type", "code"}}` with a 4xx status for bad input; the
server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import time
import uuid
from functools import partial
from typing import Any

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    generate_latest,
)

from nexrl.inference import streaming
from nexrl.inference.api_models import (
    AbortRequest,
    ChatRequest,
    CompletionRequest,
    UpdateWeightsRequest,
    chat_body,
    chat_chunk_fn,
    completion_body,
    completion_chunk_fn,
    response_header,
    usage_chunk_fn,
)
from nexrl.inference.protocol import (
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    WeightUpdateMeta,
)


class APIError(Exception):
    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


class _Metrics:
    """Prometheus metrics on a private registry (several apps may live in one process)."""

    def __init__(self, engine: InferenceEngine) -> None:
        self.engine = engine
        self.registry = CollectorRegistry()
        r = self.registry
        self.requests = Counter(
            "nexrl_requests", "HTTP generation requests", ["endpoint"], registry=r
        )
        self.tokens = Counter("nexrl_generated_tokens", "Generated tokens", registry=r)
        self.tps = Gauge(
            "nexrl_tokens_per_second", "Generated tokens/s since last scrape", registry=r
        )
        self.occupancy = Gauge("nexrl_batch_occupancy", "Running rows / max batch size", registry=r)
        self.queue = Gauge("nexrl_queue_length", "Requests waiting for a slot", registry=r)
        self.version = Gauge("nexrl_weight_version", "Current weight version", registry=r)
        self._last = (time.monotonic(), 0.0)
        self._total = 0.0

    def generated(self, n: int) -> None:
        self.tokens.inc(n)
        self._total += n

    def render(self) -> bytes:
        stats = getattr(self.engine, "stats", {}) or {}
        now, total = time.monotonic(), self._total
        then, before = self._last
        self.tps.set((total - before) / max(now - then, 1e-9))
        self._last = (now, total)
        max_batch = getattr(self.engine, "max_batch_size", 1) or 1
        self.occupancy.set(stats.get("running", 0) / max_batch)
        self.queue.set(stats.get("waiting", 0))
        self.version.set(self.engine.version)
        return generate_latest(self.registry)


# FastAPI versions with built-in OpenTelemetry look up the global providers on every
# request (a fifth of the server's time at 64 concurrent clients); the server does not use it.
_NO_TELEMETRY = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)


def _json(body: dict[str, Any]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": code, "code": status}}, status_code=status
    )


def _auth(api_key: str | None):
    async def check(request: Request) -> None:  # async: a sync dependency costs a thread hop
        if api_key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {api_key}".encode()):
            raise APIError(
                401, "missing or wrong API key (Authorization: Bearer KEY)", "auth_error"
            )

    return check


def create_app(
    engine: InferenceEngine, *, model_name: str = "default", api_key: str | None = None
) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name` (also reachable by its path)."""
    app = FastAPI(title="nexrl inference", dependencies=[Depends(_auth(api_key))], **_NO_TELEMETRY)
    metrics = _Metrics(engine)
    tokenizer = engine.tokenizer
    vocab = len(tokenizer)  # the tokenizer computes it on every call
    max_len = getattr(engine, "max_model_len", None)
    names = {model_name, str(getattr(engine, "model_path", model_name))}
    _install_errors(app)

    def check_model(name: str) -> None:
        if name not in names:
            raise APIError(
                404, f"model {name!r} not found; this server has {model_name!r}", "model_not_found"
            )

    gen = _Generation(engine, metrics, model_name)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest) -> Response:
        check_model(body.model)
        prompts = _prompt_batch(body.prompt, tokenizer, vocab)

        def default_max(ids: list[int]) -> int:
            return 16 if max_len is None else min(16, max(max_len - len(ids), 0))

        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "prompt: stream=true takes one prompt per request")
            chunks = partial(completion_chunk_fn, tokenizer=tokenizer, logprobs=body.logprobs)
            ids = prompts[0]
            return await gen.stream(ids, body, default_max(ids), "completions", chunks)
        runs = [gen.run(ids, body, default_max(ids), "completions") for ids in prompts]
        bodies = [
            completion_body(resp, model_name, version, tokenizer, body.logprobs)
            for resp, version in await asyncio.gather(*runs)
        ]
        return _json(bodies[0] if len(bodies) == 1 else _merge_completions(bodies, body.n))

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest) -> Response:
        check_model(body.model)
        ids = list(
            tokenizer.apply_chat_template(body.messages, add_generation_prompt=True, tokenize=True)
        )
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        default_max = max((max_len or len(ids) + 16) - len(ids), 0)
        if body.stream:
            chunks = partial(chat_chunk_fn, tokenizer=tokenizer, logprobs=body.logprobs)
            return await gen.stream(ids, body, default_max, "chat", chunks)
        resp, version = await gen.run(ids, body, default_max, "chat")
        return _json(chat_body(resp, model_name, version, tokenizer, body.logprobs))

    _info_routes(app, engine, metrics, model_name)
    _control_routes(app, engine)
    return app


def _info_routes(app: FastAPI, engine: InferenceEngine, metrics: _Metrics, model_name: str) -> None:
    max_len = getattr(engine, "max_model_len", None)

    @app.get("/v1/models")
    async def models() -> dict[str, Any]:
        card = {"id": model_name, "object": "model", "owned_by": "nexrl", "max_model_len": max_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, Any]:
        if not engine.health():
            raise APIError(503, "engine is not healthy", "unavailable")
        stats = dict(getattr(engine, "stats", {}) or {})
        return {"status": "ok", "weight_version": engine.version, **stats}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _Generation:
    """Runs one generation for an endpoint: a whole response, or a token stream."""

    def __init__(self, engine: InferenceEngine, metrics: _Metrics, model_name: str) -> None:
        self.engine, self.metrics, self.model_name = engine, metrics, model_name

    def _count(self, resp: GenerationResponse) -> None:
        self.metrics.generated(sum(len(o.output_ids) for o in resp.outputs))

    async def run(self, ids: list[int], body, default_max: int, endpoint: str):
        params = body.sampling(default_max)
        version = self.engine.version
        try:
            resp = await self.engine.agenerate(GenerationRequest(ids, params, rid=body.rid))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        self.metrics.requests.labels(endpoint).inc()
        self._count(resp)
        return resp, version

    async def stream(self, ids: list[int], body, default_max: int, endpoint: str, chunks):
        """`stream=true`: server-sent events (nexrl/inference/streaming.py)."""
        engine = self.engine
        if not getattr(engine, "supports_streaming", False):
            raise APIError(400, f"stream=true: {type(engine).__name__} cannot stream tokens")
        rid = body.rid or uuid.uuid4().hex
        request = GenerationRequest(ids, body.sampling(default_max), rid=rid)
        obj = "text_completion" if endpoint == "completions" else "chat.completion.chunk"
        header = response_header(obj, rid, self.model_name, engine.version)
        try:
            started = await streaming.start(engine, request)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        self.metrics.requests.labels(endpoint).inc()
        usage = usage_chunk_fn(header) if (body.stream_options or {}).get("include_usage") else None
        events = streaming.sse(
            engine, request, started, engine.tokenizer, chunks(header), usage, self._count
        )
        return StreamingResponse(events, media_type="text/event-stream")


def _control_routes(app: FastAPI, engine: InferenceEngine) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, Any]:
        version = body.version
        if version is None and body.weight_version is not None:
            version = int(body.weight_version)
        meta = WeightUpdateMeta(engine.version + 1 if version is None else version, body.model_path)
        try:
            await asyncio.to_thread(engine.update_weights, meta)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
            raise APIError(400, f"weight update from {body.model_path!r} failed: {exc}") from exc
        return {"success": True, "message": "weights updated", "version": engine.version}

    @app.post("/pause_generation")
    async def pause() -> dict[str, Any]:
        await asyncio.to_thread(engine.pause)
        return {"success": True}

    @app.post("/continue_generation")
    async def resume() -> dict[str, Any]:
        await asyncio.to_thread(engine.resume)
        return {"success": True}

    @app.post("/abort_request")
    async def abort(body: AbortRequest) -> dict[str, Any]:
        await asyncio.to_thread(engine.abort, None if body.abort_all else body.rid)
        return {"success": True}


def _prompt_batch(prompt: Any, tokenizer, vocab: int) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [_encode(prompt, tokenizer)]
    if not prompt:
        raise APIError(400, "prompt: empty; give text or token ids")
    if all(isinstance(p, str) for p in prompt):
        return [_encode(p, tokenizer) for p in prompt]
    if all(isinstance(p, list) for p in prompt):
        return [_checked_ids(p, vocab) for p in prompt]
    return [_checked_ids(prompt, vocab)]


def _encode(text: str, tokenizer) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


def _checked_ids(ids: list[int], vocab: int) -> list[int]:
    bad = [t for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]


def _merge_completions(bodies: list[dict[str, Any]], n: int) -> dict[str, Any]:
    """One response for several prompts: choice index = prompt index * n + sample index."""
    merged = dict(bodies[0])
    merged["choices"] = [
        {**c, "index": k * n + c["index"]} for k, b in enumerate(bodies) for c in b["choices"]
    ]
    merged["prompt_token_ids"] = [b["prompt_token_ids"] for b in bodies]
    merged["weight_version"] = min(b["weight_version"] for b in bodies)
    merged["usage"] = {key: sum(b["usage"][key] for b in bodies) for key in bodies[0]["usage"]}
    return merged


def _install_errors(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, exc: APIError) -> JSONResponse:
        return _error(exc.status, exc.message, exc.code)

    @app.exception_handler(RequestValidationError)
    async def invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        parts = []
        for err in exc.errors():
            where = ".".join(str(x) for x in err.get("loc", ()) if x != "body")
            parts.append(f"{where or 'body'}: {err.get('msg')}")
        return _error(400, "invalid request: " + "; ".join(parts), "invalid_request_error")

    @app.exception_handler(json.JSONDecodeError)
    async def bad_json(request: Request, exc: json.JSONDecodeError) -> JSONResponse:
        return _error(400, f"malformed JSON: {exc}", "invalid_request_error")
