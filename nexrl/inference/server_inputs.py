"""Request inputs of the OpenAI-compatible server: each check turns a body field into
what the engine takes (prompt ids, a tool-call parser) or into an `APIError`, a 4xx
naming the field. Apart from `server.py`, which wires the routes, so that each reads
on its own.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import jinja2

from nexrl.inference.api_models import ChatRequest
from nexrl.inference.sampler import encode_text
from nexrl.inference.tool_parsers import ToolCallParser


class APIError(Exception):
    """A bad request: answered with `status` and `{"error": {message, type: code}}`."""

    def __init__(self, status: int, message: str, code: str = "invalid_request_error") -> None:
        super().__init__(message)
        self.status, self.message, self.code = status, message, code


def check_logprobs(field: str, value: int | None, cap: int) -> None:
    if value is not None and value > cap:
        raise APIError(400, f"{field}: {value} is more than this server's maximum of {cap}")


def tool_mode(body: ChatRequest, parser: ToolCallParser | None) -> ToolCallParser | None:
    """The parser to apply to this request's replies (None: return text as it is)."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice not in ("auto", "none"):
        raise APIError(400, f"tool_choice: {choice!r} is not supported; use 'auto' or 'none'")
    if choice == "none" or not body.tools:
        return None
    if parser is None:
        raise APIError(
            400,
            "tools: this server has no tool-call parser; start it with "
            "`nexrl serve --tool-call-parser NAME` (or send tool_choice='none')",
        )
    for i, tool in enumerate(body.tools):
        if tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise APIError(400, f"tools[{i}]: expected {{'type': 'function', 'function': {{...}}}}")
    return parser


def render(tokenizer, messages: list[dict[str, Any]], tools: list[dict] | None) -> list[int]:
    """The chat template's prompt ids; a template that rejects the messages is a 400.
    A template that renders tools or tool calls to nothing is logged once."""
    from nexrl.agents.chat import warn_if_template_drops

    try:
        warn_if_template_drops(tokenizer, messages, tools)
        ids = tokenizer.apply_chat_template(
            messages,
            tools=tools or None,
            add_generation_prompt=True,
            tokenize=True,
            return_dict=False,
        )
    except jinja2.TemplateError as exc:
        raise APIError(400, f"messages: the chat template rejected them: {exc}") from exc
    return list(ids)


def check_weights_path(path: str, dirs: list[str] | None) -> None:
    if dirs is None:
        return
    resolved = Path(path).resolve()
    if not any(resolved.is_relative_to(Path(d).resolve()) for d in dirs):
        raise APIError(
            403,
            f"model_path: {path!r} is outside the directories this server may load weights "
            f"from ({', '.join(dirs) or 'none'}; nexrl serve --weights-dir)",
            "permission_error",
        )


def prompt_batch(
    prompt: str | list[int] | list[str] | list[list[int]], tokenizer, vocab: int
) -> list[list[int]]:
    """OpenAI's `prompt`: a string, a list of strings, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [encode_text(tokenizer, prompt)]
    if not prompt:
        raise APIError(400, "prompt: empty; give text or token ids")
    texts = [p for p in prompt if isinstance(p, str)]
    if len(texts) == len(prompt):
        return [encode_text(tokenizer, p) for p in texts]
    rows = [p for p in prompt if isinstance(p, list)]
    if len(rows) == len(prompt):
        return [checked_ids(p, vocab) for p in rows]
    ids = [p for p in prompt if isinstance(p, int)]
    if len(ids) != len(prompt):
        raise APIError(400, "prompt: a list of text, of token ids, or of token-id lists")
    return [checked_ids(ids, vocab)]


def checked_ids(ids: list[int], vocab: int) -> list[int]:
    bad = [t for t in ids if not 0 <= int(t) < vocab]
    if bad:
        raise APIError(400, f"prompt: token ids {bad[:5]} are outside the vocabulary [0, {vocab})")
    return [int(t) for t in ids]
