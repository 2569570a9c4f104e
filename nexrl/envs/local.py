"""`LocalToolingEnv`: plain Python functions as tools.

The JSON schema of a tool comes from its signature through pydantic
(`create_model` over the parameters and their type hints), so every type
pydantic knows (Literal, Enum, list[int], nested models, Optional) gets the
same schema and the same validation; the docstring gives the description (its
first paragraph) and the parameter descriptions (a Google-style `Args:`
section). Arguments are validated against that model before the call, and
unknown arguments are rejected, so the model reads exactly what was wrong.
Sync tools run in a worker thread so a slow tool never blocks the event loop
(the GPU keeps generating for the other episodes).
"""

from __future__ import annotations

import asyncio
import inspect
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TypeVar, get_type_hints

from pydantic import BaseModel, ConfigDict, Field, ValidationError, create_model
from pydantic.fields import FieldInfo

from nexrl.envs.base import (
    CallLimits,
    ToolFunction,
    ToolList,
    ToolMetrics,
    ToolResult,
    ToolSchema,
    aexecute,
    guarded_call,
    render_output,
)

_SECTION = re.compile(r"^(?:Args|Arguments|Parameters):\n((?:[ \t]+.*(?:\n|$)|\n)*)", re.M)
_ARG = re.compile(r"^\s*(\w+)\s*(?:\([^)]*\))?\s*:\s*(.*)$")


_F = TypeVar("_F", bound=Callable[..., object])


def parse_docstring(doc: str | None) -> tuple[str, dict[str, str]]:
    """(description, {param: description}) from a Google-style docstring."""
    if not doc:
        return "", {}
    text = inspect.cleandoc(doc)
    description = text.split("\n\n", 1)[0].replace("\n", " ").strip()
    params: dict[str, str] = {}
    section = _SECTION.search(text)
    base, last = None, None
    for line in section.group(1).splitlines() if section else []:
        indent = len(line) - len(line.lstrip())
        m = _ARG.match(line)
        if m and (base is None or indent <= base):
            base, last = indent, m.group(1)
            params[last] = m.group(2).strip()
        elif last and line.strip():  # a continuation line
            params[last] = f"{params[last]} {line.strip()}".strip()
    return description, params


@dataclass
class LocalTool:
    """A registered function, its argument model and its OpenAI schema."""

    name: str
    fn: Callable[..., object]
    args_model: type[BaseModel]
    schema: ToolSchema

    @classmethod
    def from_function(cls, fn: Callable[..., object], name: str | None = None) -> LocalTool:
        name = name or fn.__name__
        description, arg_docs = parse_docstring(fn.__doc__)
        hints = get_type_hints(fn)
        fields: dict[str, tuple[object, FieldInfo]] = {}
        for pname, param in inspect.signature(fn).parameters.items():
            if param.kind in (param.VAR_POSITIONAL, param.VAR_KEYWORD):
                raise TypeError(f"tool {name!r}: *args/**kwargs cannot be described to a model")
            if pname not in hints:
                raise TypeError(f"tool {name!r}: parameter {pname!r} needs a type hint")
            default = ... if param.default is param.empty else param.default
            fields[pname] = (hints[pname], Field(default, description=arg_docs.get(pname)))
        model = create_model(  # type: ignore[call-overload]
            f"{name}_args", __config__=ConfigDict(extra="forbid"), **fields
        )
        parameters = model.model_json_schema()
        parameters.pop("title", None)
        for prop in parameters.get("properties", {}).values():
            prop.pop("title", None)
        function: ToolFunction = {
            "name": name,
            "description": description,
            "parameters": parameters,
        }
        return cls(name, fn, model, {"type": "function", "function": function})


class LocalToolingEnv:
    """Tools from Python functions, registered per instance (no global state).

    Example: `env = LocalToolingEnv(); env.register_tool(add)`; then
    `await env.list_tools()` and `await env.call_tool("add", {"a": 1, "b": 2})`, or in
    seed 004's words `env.list_tools()` (no await needed) and
    `await env.aexecute("add", {"a": 1, "b": 2})`.
    """

    def __init__(
        self,
        tools: list[Callable[..., object]] | None = None,
        *,
        timeout_s: float | None = 30.0,
        max_output_chars: int = 8192,
    ) -> None:
        self.limits = CallLimits(timeout_s, max_output_chars)
        self.metrics = ToolMetrics()
        self._tools: dict[str, LocalTool] = {}
        for fn in tools or []:
            self.register_tool(fn)

    def register_tool(self, fn: _F, name: str | None = None) -> _F:
        """Add `fn` as a tool (usable as a decorator); a duplicate name is an error."""
        if not callable(fn):
            raise TypeError(f"register_tool needs a callable, got {type(fn).__name__}")
        tool = LocalTool.from_function(fn, name)
        if tool.name in self._tools:
            raise ValueError(f"tool {tool.name!r} is already registered")
        self._tools[tool.name] = tool
        return fn

    def list_tools(self) -> ToolList:
        """The tools' OpenAI schemas: a list, awaitable too (`ToolList`)."""
        return ToolList(t.schema for t in self._tools.values())

    @staticmethod
    def generate_schema(func: Callable[..., object]) -> ToolSchema:
        """The OpenAI tool schema of `func` (from its type hints and docstring)."""
        return LocalTool.from_function(func).schema

    @property
    def tool_registry(self) -> dict[str, Callable[..., object]]:
        """Seed 004's name: tool name -> the registered function (a copy)."""
        return {name: t.fn for name, t in self._tools.items()}

    @property
    def tool_schemas(self) -> list[ToolSchema]:
        """Seed 004's name for the schema list (`list_tools()`)."""
        return self.list_tools()

    is_initialized = True  # nothing to prepare: the tools are plain functions

    async def ainitialize(self) -> None:
        """Seed 004's setup hook; local tools need none."""

    async def aexecute(self, tool_name: str, tool_args: Mapping[str, object]) -> str:
        """Seed 004's call: the text the model reads (errors included, never raised)."""
        return await aexecute(self, tool_name, tool_args)

    async def call_tool(self, name: str, arguments: Mapping[str, object]) -> ToolResult:
        async def run() -> tuple[str, bool]:
            tool = self._tools.get(name)
            if tool is None:
                return f"error: unknown tool {name!r}; available: {sorted(self._tools)}", True
            try:
                args = tool.args_model.model_validate(arguments or {})
            except ValidationError as exc:
                return f"error: invalid arguments for {name!r}: {_brief(exc)}", True
            kwargs = {k: getattr(args, k) for k in type(args).model_fields}
            if inspect.iscoroutinefunction(tool.fn):
                value = await tool.fn(**kwargs)
            else:
                value = await asyncio.to_thread(tool.fn, **kwargs)
            return render_output(value), False

        return await guarded_call(name, run, self.limits, self.metrics)

    async def aclose(self) -> None:
        return None


def _brief(exc: ValidationError) -> str:
    """Pydantic's errors as one line per field, without its documentation links."""
    parts = []
    for err in exc.errors():
        where = ".".join(str(x) for x in err["loc"]) or "arguments"
        parts.append(f"{where}: {err['msg']}")
    return "; ".join(parts)
