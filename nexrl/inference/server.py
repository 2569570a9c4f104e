"""nexrl's OpenAI-compatible HTTP server around any in-process `InferenceEngine`.

`create_app(engine)` returns a FastAPI app; `nexrl.inference.serve` runs it
with uvicorn. Generation endpoints await `engine.agenerate`, so concurrent
HTTP requests land in the engine's running batch together. Control endpoints
(weight update, pause, abort) follow SGLang's names and bodies so that the
same trainer-side adapter drives SGLang and nexrl. Every error is a JSON body
`{"error": {"message", "type", "code"}}` with a 4xx status for bad input; the
server keeps serving.

Tools: with a tool-call parser (`create_app(tool_parser="hermes")`, `nexrl serve
--tool-call-parser`), chat requests may carry OpenAI `tools`; they are rendered
by the tokenizer's chat template and the reply is parsed into `tool_calls`
(nexrl/inference/tool_parsers.py). Input limits: prompts beyond the context,
`max_tokens` beyond `max_model_len`, logprobs beyond `max_logprobs`, malformed
messages and unknown control fields are 4xx naming the field. Control
endpoints can take their own `admin_key`; weight updates read only from
`weights_dirs` when given.
"""

from __future__ import annotations

import asyncio
import hmac
import inspect
import json
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import orjson
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from nexrl.inference import streaming
from nexrl.inference.api_models import (
    MAX_LOGPROBS,
    AbortRequest,
    ChatRequest,
    CompletionRequest,
    EmptyControlRequest,
    UpdateWeightsRequest,
    chat_body,
    chat_chunk_fn,
    chat_messages,
    chat_tool_chunk_fn,
    completion_body,
    completion_chunk_fn,
    response_header,
    usage_chunk_fn,
)
from nexrl.inference.protocol import (
    GenerationRequest,
    GenerationResponse,
    InferenceEngine,
    ServedEngine,
    WeightUpdateMeta,
    serves_text,
    streams_tokens,
)
from nexrl.inference.server_inputs import APIError
from nexrl.inference.server_inputs import check_logprobs as _check_logprobs
from nexrl.inference.server_inputs import check_weights_path as _check_weights_path
from nexrl.inference.server_inputs import prompt_batch as _prompt_batch
from nexrl.inference.server_inputs import render as _render
from nexrl.inference.server_inputs import tool_mode as _tool_mode
from nexrl.inference.server_metrics import ServerMetrics
from nexrl.inference.tool_parsers import ToolCallParser, get_parser

CONTROL_PATHS = frozenset(
    {"/update_weights_from_disk", "/pause_generation", "/continue_generation", "/abort_request"}
)


# FastAPI versions with built-in OpenTelemetry look up the global providers on every
# request (a fifth of the server's time at 64 concurrent clients); the server does not use it.
# (typed loosely: the keyword exists in some FastAPI versions only)
_NO_TELEMETRY: dict[str, Any] = (
    {"telemetry": {"tracing": False, "metrics": False, "logs": False}}
    if "telemetry" in inspect.signature(FastAPI).parameters
    else {}
)

_T = TypeVar("_T")


def _json(body: dict[str, object]) -> Response:
    return Response(orjson.dumps(body), media_type="application/json")


def _error(status: int, message: str, code: str) -> JSONResponse:
    return JSONResponse(
        {"error": {"message": message, "type": code, "code": status}}, status_code=status
    )


def _auth(api_key: str | None, admin_key: str | None):
    """Control endpoints take `admin_key` when one is set; everything else `api_key`."""

    async def check(request: Request) -> None:  # async: a sync dependency costs a thread hop
        control = admin_key is not None and request.url.path in CONTROL_PATHS
        key, what = (admin_key, "admin key") if control else (api_key, "API key")
        if key is None:
            return
        given = request.headers.get("authorization", "")
        if not hmac.compare_digest(given.encode(), f"Bearer {key}".encode()):
            raise APIError(
                401, f"missing or wrong {what} (Authorization: Bearer KEY)", "auth_error"
            )

    return check


def create_app(
    engine: InferenceEngine,
    *,
    model_name: str = "default",
    api_key: str | None = None,
    admin_key: str | None = None,
    tool_parser: str | None = None,
    weights_dirs: list[str] | None = None,
    max_logprobs: int = MAX_LOGPROBS,
) -> FastAPI:
    """The FastAPI app serving `engine` as model `model_name` (also reachable by its path).

    api_key / admin_key: bearer keys for all endpoints / for the control endpoints.
    tool_parser: a name in `nexrl.inference.tool_parsers.PARSERS`; None: no `tools`.
    weights_dirs: directories `/update_weights_from_disk` may read; None: any path.
    max_logprobs: the largest `logprobs` / `top_logprobs` a request may ask for.
    """
    if not serves_text(engine):
        raise TypeError(f"create_app: {type(engine).__name__} has no tokenizer to render prompts")
    auth = Depends(_auth(api_key, admin_key))
    # /docs and /openapi.json as routes of their own, behind the same key as the rest
    app = FastAPI(
        title="nexrl inference",
        dependencies=[auth],
        docs_url=None,
        redoc_url=None,
        openapi_url=None,
        **_NO_TELEMETRY,
    )
    _docs_routes(app)
    metrics = ServerMetrics(engine)
    served = _Served(
        engine=engine,
        model_name=model_name,
        parser=get_parser(tool_parser) if tool_parser else None,
        metrics=metrics,
        gen=_Generation(engine, metrics, model_name),
        max_logprobs=max_logprobs,
    )
    _install_errors(app)
    _completion_route(app, served)
    _chat_route(app, served)
    _info_routes(app, engine, metrics, model_name)
    _control_routes(app, engine, weights_dirs)
    return app


def _docs_routes(app: FastAPI) -> None:
    from fastapi.openapi.docs import get_swagger_ui_html

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi() -> dict[str, object]:
        return app.openapi()

    @app.get("/docs", include_in_schema=False)
    async def docs() -> Response:
        return get_swagger_ui_html(openapi_url="/openapi.json", title="nexrl inference")


@dataclass
class _Served:
    """What the generation routes share: the engine, its limits, metrics, tool parser."""

    engine: ServedEngine
    model_name: str
    parser: ToolCallParser | None
    metrics: ServerMetrics
    gen: _Generation
    max_logprobs: int

    def __post_init__(self) -> None:
        self.tokenizer = self.engine.tokenizer
        self.vocab = len(self.tokenizer)  # the tokenizer computes it on every call
        self.max_len: int | None = getattr(self.engine, "max_model_len", None)
        self.max_batch: int | None = getattr(self.engine, "max_batch_size", None)
        self.names = {self.model_name, str(getattr(self.engine, "model_path", self.model_name))}

    def check_model(self, name: str) -> None:
        if name not in self.names:
            raise APIError(
                404,
                f"model {name!r} not found; this server has {self.model_name!r}",
                "model_not_found",
            )

    def check_lengths(self, ids: list[int], max_tokens: int | None, field: str, n: int) -> None:
        """400 naming the field when n, the prompt or max_tokens do not fit the engine."""
        max_len, max_batch = self.max_len, self.max_batch
        if max_batch is not None and n > max_batch:
            raise APIError(400, f"n: {n} is more than this server's max batch size ({max_batch})")
        if max_tokens is not None and max_tokens < 0:
            raise APIError(400, f"max_tokens: must be >= 0 (max_new_tokens), got {max_tokens}")
        if max_len is None:
            return
        if len(ids) >= max_len:
            raise APIError(
                400,
                f"{field}: this model's maximum context length is {max_len} tokens "
                f"(max_model_len), but the request has {len(ids)} input tokens (at least one "
                "must be left to generate)",
            )
        if max_tokens is not None and max_tokens > max_len - len(ids):
            raise APIError(
                400,
                f"max_tokens: {max_tokens} is too large: this model's maximum context length is "
                f"{max_len} tokens and the request has {len(ids)} input tokens "
                f"({max_tokens} > {max_len} - {len(ids)})",
            )


def _completion_route(app: FastAPI, served: _Served) -> None:
    tokenizer, max_len, gen = served.tokenizer, served.max_len, served.gen

    def default_max(ids: list[int]) -> int:
        return 16 if max_len is None else min(16, max(max_len - len(ids), 0))

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        served.check_model(body.model)
        _check_logprobs("logprobs", body.logprobs, served.max_logprobs)
        prompts = _prompt_batch(body.prompt, tokenizer, served.vocab)
        for ids in prompts:
            served.check_lengths(ids, body.max_tokens, "prompt", body.n)
        if body.stream:
            if len(prompts) != 1:
                raise APIError(400, "prompt: stream=true takes one prompt per request")
            chunks = partial(completion_chunk_fn, tokenizer=tokenizer, logprobs=body.logprobs)
            ids = prompts[0]
            return await gen.stream(ids, body, default_max(ids), "completions", chunks)
        rid = body.rid or uuid.uuid4().hex  # what a disconnect aborts
        runs = [gen.run(ids, body, default_max(ids), "completions", rid) for ids in prompts]
        results = await gen.unless_disconnected(request, asyncio.gather(*runs), rid)
        bodies = [
            completion_body(resp, served.model_name, version, tokenizer, body.logprobs)
            for resp, version in results
        ]
        return _json(bodies[0] if len(bodies) == 1 else _merge_completions(bodies, body.n))


def _chat_route(app: FastAPI, served: _Served) -> None:
    tokenizer, metrics, gen = served.tokenizer, served.metrics, served.gen

    @app.post("/v1/chat/completions")
    async def chat(body: ChatRequest, request: Request) -> Response:
        served.check_model(body.model)
        _check_logprobs("top_logprobs", body.top_logprobs, served.max_logprobs)
        try:
            messages = chat_messages(body.messages)
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        use_parser = _tool_mode(body, served.parser)
        ids = _render(tokenizer, messages, body.tools)
        if body.max_completion_tokens is not None:
            body.max_tokens = body.max_completion_tokens
        served.check_lengths(ids, body.max_tokens, "messages", body.n)
        default_max = max((served.max_len or len(ids) + 16) - len(ids), 0)
        if body.stream:
            chunks = partial(chat_chunk_fn, tokenizer=tokenizer, logprobs=body.logprobs)
            if use_parser is not None:
                chunks = partial(
                    chat_tool_chunk_fn,
                    tokenizer=tokenizer,
                    logprobs=body.logprobs,
                    parser=use_parser,
                    on_parsed=metrics.parsed,
                )
            return await gen.stream(ids, body, default_max, "chat", chunks)
        rid = body.rid or uuid.uuid4().hex
        resp, version = await gen.unless_disconnected(
            request, gen.run(ids, body, default_max, "chat", rid), rid
        )
        parsed = None
        if use_parser is not None:
            parsed = [use_parser.parse(o.text) for o in resp.outputs]
            for p in parsed:
                metrics.parsed(p)
        return _json(chat_body(resp, served.model_name, version, tokenizer, body.logprobs, parsed))


def _info_routes(
    app: FastAPI, engine: InferenceEngine, metrics: ServerMetrics, model_name: str
) -> None:
    max_len = getattr(engine, "max_model_len", None)

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        card = {"id": model_name, "object": "model", "owned_by": "nexrl", "max_model_len": max_len}
        return {"object": "list", "data": [card]}

    @app.get("/health")
    async def health() -> dict[str, object]:
        if not engine.health():
            raise APIError(503, "engine is not healthy", "unavailable")
        stats = dict(getattr(engine, "stats", {}) or {})
        return {"status": "ok", "weight_version": engine.version, **stats}

    @app.get("/metrics")
    async def prometheus() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)


class _Generation:
    """Runs one generation for an endpoint: a whole response, or a token stream."""

    def __init__(self, engine: ServedEngine, metrics: ServerMetrics, model_name: str) -> None:
        self.engine, self.metrics, self.model_name = engine, metrics, model_name

    def _count(self, resp: GenerationResponse) -> None:
        self.metrics.generated(sum(len(o.output_ids) for o in resp.outputs))

    async def run(self, ids: list[int], body, default_max: int, endpoint: str, rid: str):
        params = body.sampling(default_max)
        version = self.engine.version
        try:
            resp = await self.engine.agenerate(GenerationRequest(ids, params, rid=rid))
        except ValueError as exc:
            raise APIError(400, str(exc)) from exc
        self.metrics.requests.labels(endpoint).inc()
        self._count(resp)
        return resp, version

    async def unless_disconnected(self, request: Request, work: Awaitable[_T], rid: str) -> _T:
        """Await `work`; if the client goes away first, abort request `rid` in the engine
        (its rows stop generating) and let `work` end with what it has."""
        work = asyncio.ensure_future(work)
        gone = asyncio.ensure_future(_disconnect(request))
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
        if not work.done():
            await asyncio.to_thread(self.engine.abort, rid)
        gone.cancel()
        return await work

    async def stream(self, ids: list[int], body, default_max: int, endpoint: str, chunks):
        """`stream=true`: server-sent events (nexrl/inference/streaming.py)."""
        engine = self.engine
        if not streams_tokens(engine):
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


async def _disconnect(request: Request) -> None:
    """Returns when the client disconnects (the body is read: the next ASGI message is
    `http.disconnect`, sent when the connection closes or the response is complete)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


def _control_routes(app: FastAPI, engine: InferenceEngine, weights_dirs: list[str] | None) -> None:
    @app.post("/update_weights_from_disk")
    async def update_weights(body: UpdateWeightsRequest) -> dict[str, object]:
        _check_weights_path(body.model_path, weights_dirs)
        version = body.version if body.version is not None else body.weight_version
        meta = WeightUpdateMeta(engine.version + 1 if version is None else version, body.model_path)
        try:
            await asyncio.to_thread(engine.update_weights, meta)
        except (FileNotFoundError, KeyError, ValueError, RuntimeError) as exc:
            raise APIError(400, f"weight update from {body.model_path!r} failed: {exc}") from exc
        return {"success": True, "message": "weights updated", "version": engine.version}

    @app.post("/pause_generation")
    async def pause(body: EmptyControlRequest | None = None) -> dict[str, object]:
        await asyncio.to_thread(engine.pause)
        return {"success": True}

    @app.post("/continue_generation")
    async def resume(body: EmptyControlRequest | None = None) -> dict[str, object]:
        await asyncio.to_thread(engine.resume)
        return {"success": True}

    @app.post("/abort_request")
    async def abort(body: AbortRequest) -> dict[str, object]:
        await asyncio.to_thread(engine.abort, None if body.abort_all else body.rid)
        return {"success": True}


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
