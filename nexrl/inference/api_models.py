"""Request bodies and response builders of nexrl's OpenAI-compatible server.

Field names follow OpenAI where it defines them and vLLM / SGLang where they
extend it (`top_k`, `stop_token_ids`, `prompt_token_ids`, `token_ids`,
`rid`), so any OpenAI client works and token-in/token-out clients find the
ids where they look for them. nexrl adds `weight_version` (the version at the
start of generation) and per-choice `token_versions`.
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Sequence
from typing import Annotated

from pydantic import BaseModel, ConfigDict, Field, JsonValue

from nexrl.inference.protocol import GenerationResponse, SamplingParams
from nexrl.inference.tool_parsers import ParseFailure, ToolCall, ToolCallParser

MAX_LOGPROBS = 20
"""Default cap on `logprobs` / `top_logprobs` (vLLM's default `max_logprobs` too)."""

ROLES = ("system", "developer", "user", "assistant", "tool")
INT32_MAX, INT64_MAX = (1 << 31) - 1, (1 << 63) - 1
"""Every integer field is bounded by the engine type it ends up in (counts and token ids
int32, seeds int64): JSON integers are unbounded, and one past the engine's type once
failed inside the engine instead of here."""
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]
Count = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Sampling(BaseModel):
    # allow_inf_nan=False: `temperature: Infinity` (Python's json reads it) is a 400
    model_config = ConfigDict(extra="allow", allow_inf_nan=False)

    model: str
    # checked by the server too (its message names max_new_tokens)
    max_tokens: int | None = Field(16, ge=-INT32_MAX, le=INT32_MAX)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(-1, ge=-1, le=INT32_MAX)
    n: int = Field(1, ge=1, le=INT32_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = None
    seed: int | None = Field(None, ge=-INT64_MAX - 1, le=INT64_MAX)
    stream: bool = False
    stream_options: dict[str, JsonValue] | None = None
    rid: str | None = None
    ignore_eos: bool = False

    def sampling(self, default_max: int) -> SamplingParams:
        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop or [])
        return SamplingParams(
            max_new_tokens=default_max if self.max_tokens is None else self.max_tokens,
            temperature=self.temperature,
            top_p=self.top_p,
            top_k=self.top_k,
            stop_token_ids=list(self.stop_token_ids or []),
            stop=stop,
            n=self.n,
            seed=self.seed,
            ignore_eos=self.ignore_eos,
        )


class CompletionRequest(_Sampling):
    prompt: str | list[int] | list[str] | list[list[int]] = Field(
        ..., description="text, token ids, or a list of either (several prompts)"
    )
    logprobs: Count | None = None
    echo: bool = False


class ChatRequest(_Sampling):
    messages: list[JsonValue] = Field(..., min_length=1)
    logprobs: bool = False
    top_logprobs: Count | None = None
    max_completion_tokens: Count | None = None
    tools: list[dict[str, JsonValue]] | None = None
    tool_choice: str | dict[str, JsonValue] | None = None
    parallel_tool_calls: bool | None = None  # accepted; every parsed call is returned


class _Control(BaseModel):
    """Control bodies reject unknown fields: a typo must not silently do nothing."""

    model_config = ConfigDict(extra="forbid")


class UpdateWeightsRequest(_Control):
    """SGLang's `/update_weights_from_disk` body (its options accepted, not all used), plus
    our integer `version`."""

    model_path: str
    version: int | None = Field(None, ge=0, le=INT64_MAX)
    weight_version: int | None = Field(None, ge=0, le=INT64_MAX)
    """SGLang's label; here an integer (a numeric string such as "3" is read as 3)."""
    load_format: str | None = None
    abort_all_requests: bool = False
    flush_cache: bool = True
    is_async: bool = False
    torch_empty_cache: bool = False
    keep_pause: bool = False


class AbortRequest(_Control):
    rid: str | None = None
    abort_all: bool = False


class EmptyControlRequest(_Control):
    """`/pause_generation`, `/continue_generation`: no fields (SGLang's `mode` is accepted)."""

    mode: str | None = None


def chat_messages(messages: Sequence[object]) -> list[dict[str, object]]:
    """Checked copies of OpenAI chat messages, ready for a chat template.

    Raises ValueError naming the field (`messages[2].role: ...`). Text content parts are
    joined; an assistant message may have null content only with `tool_calls`, whose
    JSON-string arguments become objects (what chat templates expect).
    """
    return [_message(m, f"messages[{i}]") for i, m in enumerate(messages)]


def _message(m: object, where: str) -> dict[str, object]:
    if not isinstance(m, dict):
        raise ValueError(f"{where}: must be an object with 'role' and 'content'")
    role = m.get("role")
    if role is None:
        raise ValueError(f"{where}.role: field required (one of {', '.join(ROLES)})")
    if role not in ROLES:
        raise ValueError(f"{where}.role: unknown role {role!r}; expected one of {', '.join(ROLES)}")
    out = dict(m)
    content = m.get("content")
    if content is None:
        if not (role == "assistant" and m.get("tool_calls")):
            raise ValueError(
                f"{where}.content: null is allowed only in an assistant message with tool_calls"
            )
        out["content"] = ""
    elif isinstance(content, list):
        out["content"] = "".join(
            _text_part(p, f"{where}.content[{j}]") for j, p in enumerate(content)
        )
    elif not isinstance(content, str):
        raise ValueError(f"{where}.content: must be a string or a list of text parts")
    if m.get("tool_calls") is not None:
        out["tool_calls"] = [
            _tool_call(c, f"{where}.tool_calls[{j}]") for j, c in enumerate(m["tool_calls"])
        ]
    return out


def _text_part(part: object, where: str) -> str:
    if not isinstance(part, dict) or part.get("type") != "text":
        kind = part.get("type") if isinstance(part, dict) else type(part).__name__
        raise ValueError(f"{where}.type: {kind!r} is not supported (text parts only)")
    if not isinstance(part.get("text"), str):
        raise ValueError(f"{where}.text: must be a string")
    return part["text"]


def _tool_call(call: object, where: str) -> dict[str, object]:
    if not isinstance(call, dict):
        raise ValueError(f"{where}.function.name: field required")
    fn = call.get("function")
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise ValueError(f"{where}.function.name: field required")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except json.JSONDecodeError as exc:
            raise ValueError(f"{where}.function.arguments: not valid JSON ({exc.msg})") from None
    return {**call, "function": {**fn, "arguments": args}}


Parsed = tuple[str, list[ToolCall], list[ParseFailure]]


def _usage(prompt_len: int, resp: GenerationResponse) -> dict[str, int]:
    completion = sum(len(o.output_ids) for o in resp.outputs)
    return {
        "prompt_tokens": prompt_len,
        "completion_tokens": completion,
        "total_tokens": prompt_len + completion,
    }


_ID_PREFIX = {
    "text_completion": "cmpl",
    "chat.completion": "chatcmpl",
    "chat.completion.chunk": "chatcmpl",
}


def response_header(obj: str, rid: str | None, model: str, version: int) -> dict[str, object]:
    """Fields every response (and every streamed chunk of it) starts with."""
    return {
        "id": f"{_ID_PREFIX[obj]}-{rid or uuid.uuid4().hex}",
        "object": obj,
        "created": int(time.time()),
        "model": model,
        "weight_version": version,
    }


def _tail(resp: GenerationResponse, choices: list[dict[str, object]]) -> dict[str, object]:
    usage = _usage(len(resp.input_ids), resp)
    return {"choices": choices, "prompt_token_ids": resp.input_ids, "usage": usage}


def completion_body(
    resp: GenerationResponse, model: str, version: int, tokenizer, logprobs: int | None
) -> dict[str, object]:
    choices = []
    for i, out in enumerate(resp.outputs):
        lp = None
        if logprobs is not None:
            lp = _completion_logprobs(tokenizer, out.output_ids, out.output_logprobs)
        choices.append(
            {
                "index": i,
                "text": out.text,
                "finish_reason": out.finish_reason,
                "logprobs": lp,
                "prompt_token_ids": resp.input_ids,
                "token_ids": out.output_ids,
                "token_versions": out.output_versions,
            }
        )
    return {**response_header("text_completion", resp.rid, model, version), **_tail(resp, choices)}


def assistant_message(text: str, finish: str, parsed: Parsed | None) -> tuple[dict, str]:
    """The OpenAI assistant message and finish_reason of one sample (tool calls parsed)."""
    if parsed is None or not parsed[1]:
        return {"role": "assistant", "content": text}, finish
    content, calls, _ = parsed
    message = {
        "role": "assistant",
        "content": content or None,
        "tool_calls": [c.to_openai() for c in calls],
    }
    return message, "tool_calls" if finish == "stop" else finish


def chat_body(
    resp: GenerationResponse,
    model: str,
    version: int,
    tokenizer,
    logprobs: bool,
    parsed: list[Parsed] | None = None,
) -> dict[str, object]:
    choices = []
    for i, out in enumerate(resp.outputs):
        lp = _chat_logprobs(tokenizer, out.output_ids, out.output_logprobs) if logprobs else None
        message, finish = assistant_message(
            out.text, out.finish_reason, parsed[i] if parsed else None
        )
        choices.append(
            {
                "index": i,
                "message": message,
                "finish_reason": finish,
                "logprobs": lp,
                "token_ids": out.output_ids,
                "token_versions": out.output_versions,
            }
        )
    return {**response_header("chat.completion", resp.rid, model, version), **_tail(resp, choices)}


def _completion_logprobs(tokenizer, ids: list[int], lps: list[float]) -> dict[str, object]:
    toks = tokenizer.convert_ids_to_tokens(ids)
    return {
        "tokens": toks,
        "token_logprobs": lps,
        "top_logprobs": [{t: v} for t, v in zip(toks, lps, strict=True)],
        "text_offset": [],
    }


def _chat_logprobs(tokenizer, ids: list[int], lps: list[float]) -> dict[str, object]:
    toks = tokenizer.convert_ids_to_tokens(ids)
    return {
        "content": [
            {"token": t, "logprob": v, "bytes": list(t.encode()), "top_logprobs": []}
            for t, v in zip(toks, lps, strict=True)
        ]
    }


# -- streaming chunks (nexrl/inference/streaming.py) -------------------------------------------
def completion_chunk_fn(header: dict[str, object], tokenizer, logprobs: int | None):
    """Builds one `text_completion` chunk per (sample, new tokens)."""

    def make(index: int, text: str, ids: list[int], lps: list[float], finish: str | None):
        lp = _completion_logprobs(tokenizer, ids, lps) if logprobs is not None and ids else None
        choice = {"index": index, "text": text, "logprobs": lp, "finish_reason": finish}
        return {**header, "choices": [{**choice, "token_ids": ids}]}

    return make


def chat_chunk_fn(header: dict[str, object], tokenizer, logprobs: bool):
    """Builds one `chat.completion.chunk` per (sample, new tokens); the first has the role."""
    started: set[int] = set()

    def make(index: int, text: str, ids: list[int], lps: list[float], finish: str | None):
        delta: dict[str, object] = {"content": text}
        if index not in started:
            started.add(index)
            delta["role"] = "assistant"
        lp = _chat_logprobs(tokenizer, ids, lps) if logprobs and ids else None
        choice = {"index": index, "delta": delta, "logprobs": lp, "finish_reason": finish}
        return {**header, "choices": [{**choice, "token_ids": ids}]}

    return make


def chat_tool_chunk_fn(
    header: dict[str, object], tokenizer, logprobs: bool, parser: ToolCallParser, on_parsed
):
    """Like `chat_chunk_fn`, for requests with tools: the text of a sample is held back until
    it ends (a tool call cannot be told from content before its closing tag), then sent as
    `content` and OpenAI `tool_calls` deltas with the finish_reason. Token ids (and
    logprobs) still stream one chunk per token."""
    plain = chat_chunk_fn(header, tokenizer, logprobs)
    texts: dict[int, str] = {}

    def make(index: int, text: str, ids: list[int], lps: list[float], finish: str | None):
        texts[index] = texts.get(index, "") + text
        if finish is None:
            chunk = plain(index, "", ids, lps, None)
            chunk["choices"][0]["delta"].pop("content")
            return chunk
        parsed = parser.parse(texts[index])
        on_parsed(parsed)
        message, finish = assistant_message(texts[index], finish, parsed)
        chunk = plain(index, message["content"] or "", ids, lps, finish)
        delta = chunk["choices"][0]["delta"]
        if message.get("tool_calls"):
            delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
        return chunk

    return make


def usage_chunk_fn(header: dict[str, object]):
    def make(resp: GenerationResponse) -> dict[str, object]:
        return {**header, "choices": [], "usage": _usage(len(resp.input_ids), resp)}

    return make
