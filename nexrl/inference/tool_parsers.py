"""Tool-call parsers: model text in, OpenAI-style tool calls out.

Each chat format writes tool calls its own way; a parser turns one completion's
text into `(content, calls, failures)`. A call that is malformed (bad JSON, no
name, arguments that are not an object) or truncated (an opening tag with no
closing one, e.g. when `max_tokens` cut the sample) is never returned as a
call: it becomes a `ParseFailure` with a reason, so a rollout cannot execute
half a call, and the caller can count it (a metric) and show it to the model.
The failed text stays in `content` so that nothing the model wrote is lost.

`PARSERS` is an explicit registry keyed by the name `nexrl serve
--tool-call-parser` and `get_parser` take.
"""

from __future__ import annotations

import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from nexrl.registry import Registry
from nexrl.types import JSONDict


@dataclass
class ToolCall:
    """One parsed call. `arguments` is a dict; `to_openai` serialises it as OpenAI does."""

    name: str
    arguments: JSONDict
    id: str = field(default_factory=lambda: f"call_{uuid.uuid4().hex[:24]}")

    def to_openai(self) -> dict[str, object]:
        """The `tool_calls[i]` entry of an OpenAI assistant message (arguments as a string)."""
        args = json.dumps(self.arguments, ensure_ascii=False)
        function = {"name": self.name, "arguments": args}
        return {"id": self.id, "type": "function", "function": function}


@dataclass
class ParseFailure:
    """Text that looked like a tool call but could not be one, and why."""

    text: str
    reason: str


ParseResult = tuple[str, list[ToolCall], list[ParseFailure]]


def _call_from_json(raw: str, args_key: str) -> ToolCall | ParseFailure:
    """`{"name": ..., args_key: {...}}` -> ToolCall; anything else -> ParseFailure."""
    try:
        obj = json.loads(raw)
    except json.JSONDecodeError as exc:
        return ParseFailure(raw, f"invalid JSON: {exc.msg} at char {exc.pos}")
    return _call_from_obj(obj, raw, args_key)


def _call_from_obj(obj: object, raw: str, args_key: str) -> ToolCall | ParseFailure:
    if not isinstance(obj, dict):
        return ParseFailure(raw, f"a tool call must be a JSON object, got {type(obj).__name__}")
    name = obj.get("name")
    if not isinstance(name, str) or not name:
        return ParseFailure(raw, "tool call has no 'name' string")
    args = obj.get(args_key, obj.get("arguments", {}))
    if isinstance(args, str):  # some models emit the arguments JSON-encoded, as OpenAI does
        try:
            args = json.loads(args)
        except json.JSONDecodeError as exc:
            return ParseFailure(raw, f"'{args_key}' is a string that is not JSON: {exc.msg}")
    if args is None:
        args = {}
    if not isinstance(args, dict):
        return ParseFailure(raw, f"'{args_key}' must be an object, got {type(args).__name__}")
    return ToolCall(name, args)


def _sort(items: list[ToolCall | ParseFailure]) -> tuple[list[ToolCall], list[ParseFailure]]:
    calls = [c for c in items if isinstance(c, ToolCall)]
    return calls, [f for f in items if isinstance(f, ParseFailure)]


class HermesParser:
    """Hermes / Qwen2.5 / Qwen3: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`.

    Content is the text outside the tags. An opening tag without a closing one is a
    truncated call (a failure) and stays in the content.
    """

    open_tag, close_tag = "<tool_call>", "</tool_call>"
    _block = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)

    def parse(self, text: str) -> ParseResult:
        items: list[ToolCall | ParseFailure] = []
        kept: list[str] = []
        pos = 0
        for m in self._block.finditer(text):
            kept.append(text[pos : m.start()])
            item = _call_from_json(m.group(1).strip(), "arguments")
            if isinstance(item, ParseFailure):
                kept.append(m.group(0))
            items.append(item)
            pos = m.end()
        rest = text[pos:]
        if self.open_tag in rest:
            start = rest.index(self.open_tag)
            items.append(ParseFailure(rest[start:], "truncated: <tool_call> is never closed"))
        kept.append(rest)
        calls, failures = _sort(items)
        return "".join(kept).strip() if calls else "".join(kept), calls, failures


class Llama3JsonParser:
    """Llama 3.1/3.2 JSON tool calling: the reply is `{"name": ..., "parameters": {...}}`.

    Several calls are separated by `;`. The format has no tags, so only a reply that
    starts with `{` (after `<|python_tag|>` if present) is taken as a call; a reply
    that starts like a call but does not parse is a failure (truncated or malformed).
    """

    prefix = "<|python_tag|>"

    def parse(self, text: str) -> ParseResult:
        body = text.strip()
        if body.startswith(self.prefix):
            body = body[len(self.prefix) :].strip()
        if not body.startswith("{"):
            return text, [], []
        decoder = json.JSONDecoder()
        items: list[ToolCall | ParseFailure] = []
        pos = 0
        while pos < len(body):
            try:
                obj, end = decoder.raw_decode(body, pos)
            except json.JSONDecodeError as exc:
                items.append(ParseFailure(body[pos:], f"invalid JSON: {exc.msg} at char {exc.pos}"))
                break
            items.append(_call_from_obj(obj, body[pos:end], "parameters"))
            pos = end
            while pos < len(body) and body[pos] in " \t\n;":
                pos += 1
        calls, failures = _sort(items)
        return ("" if calls and not failures else text), calls, failures


class MistralParser:
    """Mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` after the content."""

    tag = "[TOOL_CALLS]"

    def parse(self, text: str) -> ParseResult:
        if self.tag not in text:
            return text, [], []
        content, _, raw = text.partition(self.tag)
        raw = raw.strip()
        try:
            obj = json.loads(raw)
        except json.JSONDecodeError as exc:
            return text, [], [ParseFailure(raw, f"invalid JSON: {exc.msg} at char {exc.pos}")]
        objs = obj if isinstance(obj, list) else [obj]
        calls, failures = _sort([_call_from_obj(o, json.dumps(o), "arguments") for o in objs])
        return (content.strip() if not failures else text), calls, failures


class ToolCallParser(Protocol):
    """What a parser is: `parse(text) -> (content, calls, failures)`."""

    def parse(self, text: str) -> ParseResult: ...


PARSERS: Registry[Callable[[], ToolCallParser]] = Registry(
    "tool-call parser", "service.inference_service.tool_call_parser"
)
"""name -> parser class (called with no argument); `PARSERS.add("mine", MyParser)` makes
`tool_call_parser: mine` and `nexrl serve --tool-call-parser mine` pick it."""
PARSERS.add("hermes", HermesParser)
PARSERS.add("qwen", HermesParser)
PARSERS.add("llama3_json", Llama3JsonParser)
PARSERS.add("mistral", MistralParser)


def get_parser(name: str) -> ToolCallParser:
    """A new parser registered as `name` (or given as "pkg.module:Class"); an unknown
    name is an error that lists the registered ones."""
    factory: Callable[[], ToolCallParser] = PARSERS.get(name)
    return factory()
