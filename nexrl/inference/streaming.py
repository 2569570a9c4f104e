"""`stream=true`: OpenAI-style server-sent events from the engine's per-token hook.

The engine calls `on_token(sample_index, token_id, logprob, version)` from its
scheduler thread (or the pipe-reader thread of `ProcessEngine`) for every
sampled token; `TokenStream` moves each one onto the event loop. Every token
becomes one chunk carrying its id (`token_ids`, vLLM's field) and, when asked,
its logprob; the chunk's text is the new part of the sample's decoded text.
Text that could still turn out to be the start of a stop string (or half of a
multi-byte character) is held back until it cannot, so streamed text always
equals the non-streamed `text`. Each sample ends with a chunk carrying its
`finish_reason`; then an optional usage chunk (`stream_options.include_usage`)
and `data: [DONE]`. A client that disconnects aborts its request.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from concurrent.futures import Future
from typing import TypeAlias

import orjson

from nexrl.inference.protocol import (
    Decoder,
    GenerationRequest,
    GenerationResponse,
    StreamingEngine,
)

ChunkFn = Callable[[int, str, list[int], list[float], str | None], dict[str, object]]
TokenEvent: TypeAlias = tuple[int, int, float]
"""(sample index, token id, logprob) of one streamed token."""


class SampleText:
    """Incremental detokenization of one sample with stop-string hold-back."""

    def __init__(self, tokenizer: Decoder, stop: list[str]) -> None:
        self.tokenizer, self.stop = tokenizer, [s for s in stop if s]
        self.hold = max((len(s) for s in self.stop), default=1) - 1
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token_id: int) -> str:
        """Add a token; return the text that is now safe to send."""
        self.ids.append(token_id)
        text = self.tokenizer.decode(self.ids, skip_special_tokens=True)
        safe = len(text) - self.hold
        hits = [i for i in (text.find(s) for s in self.stop) if i >= 0]
        if hits:
            safe = min(safe, min(hits))
        if text.endswith("\ufffd"):  # an incomplete multi-byte character
            safe = min(safe, len(text) - 1)
        delta = text[self.sent : max(safe, self.sent)]
        self.sent += len(delta)
        return delta

    def finish(self, final_text: str) -> str:
        """The rest of the sample's final text (already cut before its stop string)."""
        return final_text[self.sent :]


class TokenStream:
    """Hands the engine's tokens to the event loop; `None` marks the end."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop
        self.queue: asyncio.Queue[TokenEvent | None] = asyncio.Queue()

    def on_token(self, index: int, token_id: int, logprob: float, version: int) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, token_id, logprob))

    def attach(self, future: Future) -> None:
        """Queue the end marker once `future` resolves (after every token it produced)."""

        def end(_: Future) -> None:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, None)

        future.add_done_callback(end)


async def start(
    engine: StreamingEngine, request: GenerationRequest
) -> tuple[TokenStream, Future[GenerationResponse], TokenEvent | None]:
    """Submit `request` streaming; wait for its first event so bad requests still raise here.

    Returns the stream, the engine future and the first event (a token, or None when the
    request finished without one, e.g. `max_tokens=0`).
    """
    stream = TokenStream(asyncio.get_running_loop())
    future = engine.submit(request, on_token=stream.on_token)
    stream.attach(future)
    first = await stream.queue.get()
    error = future.exception() if first is None else None
    if error is not None:
        raise error
    return stream, future, first


async def sse(
    engine: StreamingEngine,
    request: GenerationRequest,
    started: tuple[TokenStream, Future[GenerationResponse], TokenEvent | None],
    tokenizer: Decoder,
    chunk: ChunkFn,
    usage: Callable[[GenerationResponse], dict[str, object]] | None,
    on_done: Callable[[GenerationResponse], None] = lambda resp: None,
) -> AsyncIterator[str]:
    """The event stream of a started request (see module docstring)."""
    stream, future, event = started
    texts = [SampleText(tokenizer, request.sampling.stop) for _ in range(request.sampling.n)]
    done = False
    try:
        while event is not None:
            index, token_id, logprob = event
            yield _data(chunk(index, texts[index].push(token_id), [token_id], [logprob], None))
            event = await stream.queue.get()
        try:
            resp: GenerationResponse = future.result()
        except Exception as exc:  # headers are sent: report the failure in the stream
            yield _data({"error": {"message": str(exc), "type": type(exc).__name__}})
            return
        on_done(resp)
        for i, out in enumerate(resp.outputs):
            yield _data(chunk(i, texts[i].finish(out.text), [], [], out.finish_reason))
        if usage is not None:
            yield _data(usage(resp))
        done = True
        yield "data: [DONE]\n\n"
    finally:
        if not done and not future.done():  # the client went away: free its rows
            asyncio.get_running_loop().run_in_executor(None, engine.abort, request.rid)


def _data(body: dict[str, object]) -> str:
    return f"data: {orjson.dumps(body).decode()}\n\n"
