"""What a tool environment is, and the parts every implementation shares.

`ToolingEnv` is the boundary a rollout talks to: list the tools (OpenAI tool
schemas, ready for `apply_chat_template(tools=...)` or `tools=` of the OpenAI
API) and call one by name. A call never raises into the rollout: an unknown
tool, bad arguments, an exception in the tool, or a timeout all come back as a
`ToolResult` with `is_error=True` and a message the model can read, because a
policy that writes a bad call should see why and get a low reward, not crash
the run. `guarded_call` implements that contract (timeout, truncation,
metrics) once for the local and the MCP environment.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Awaitable, Callable, Generator, Mapping, Sequence
from dataclasses import dataclass
from types import TracebackType
from typing import Protocol, TypedDict, runtime_checkable

from nexrl.inference.tool_parsers import ParseFailure, ToolCall


class ToolFunction(TypedDict):
    name: str
    description: str
    parameters: dict[str, object]
    """The arguments' JSON Schema."""


class ToolSchema(TypedDict):
    """An OpenAI tool schema, as `list_tools` returns them."""

    type: str
    function: ToolFunction


class ToolMessage(TypedDict):
    """An OpenAI `tool` message: one call's result for the model."""

    role: str
    tool_call_id: str
    name: str
    content: str


@dataclass
class ToolResult:
    """One call's outcome. `content` is what the model sees in the tool message."""

    name: str
    content: str
    is_error: bool = False
    latency_s: float = 0.0
    truncated: bool = False


class ToolList(list[ToolSchema]):
    """Tool schemas that are a plain list *and* awaitable: `env.list_tools()` reads as the
    seed's synchronous call (`apply_chat_template(msgs, tools=env.list_tools())`) and as
    nexrl's `await env.list_tools()`."""

    def __await__(self) -> Generator[object, None, ToolList]:
        return self._itself().__await__()

    async def _itself(self) -> ToolList:
        return self

    # The coroutine protocol, so `asyncio.run(env.list_tools())` and `create_task` take it
    # as they took the coroutine `list_tools` once returned: it finishes at the first step.
    def send(self, value: object) -> None:
        raise StopIteration(self)

    def throw(
        self,
        typ: type[BaseException] | BaseException,
        val: BaseException | None = None,
        tb: TracebackType | None = None,
    ) -> None:
        raise val if val is not None else typ

    def close(self) -> None:
        return None


@dataclass
class MCPToolingEnvConfig:
    """Where an `MCPToolingEnv` finds its server (seed 004's config object).

    url: a streamable-HTTP endpoint (`http://127.0.0.1:8000/mcp`); or
    command: a stdio server to launch (`["python", "server.py"]`), with `env` for it.
    timeout_s / max_output_chars: per-call limits (`CallLimits`).
    """

    url: str | None = None
    command: list[str] | None = None
    env: dict[str, str] | None = None
    timeout_s: float | None = 30.0
    max_output_chars: int = 8192

    def server(self) -> str | list[str]:
        if (self.url is None) == (self.command is None):
            raise ValueError("MCPToolingEnvConfig: set exactly one of `url` and `command`")
        return self.url if self.url is not None else list(self.command or [])


@runtime_checkable
class ToolingEnv(Protocol):
    """A set of tools a policy can call during an episode.

    Seed 004 names, on both environments: `ainitialize()` (connect / prepare),
    `aexecute(name, args) -> str` (the text the model reads), `tool_schemas` (the list
    `list_tools` returns) and `tool_registry` (name -> callable). `call_tool` is nexrl's
    richer form of `aexecute` (a `ToolResult` with error flag and latency).
    """

    def list_tools(self) -> Awaitable[list[ToolSchema]]:
        """OpenAI tool schemas: `{"type": "function", "function": {name, description,
        parameters}}`."""
        ...

    async def call_tool(self, name: str, arguments: Mapping[str, object]) -> ToolResult: ...

    async def aclose(self) -> None: ...


async def aexecute(env: ToolingEnv, tool_name: str, tool_args: Mapping[str, object]) -> str:
    """Seed 004's `aexecute`: the call's text (an error is text the model reads too)."""
    return (await env.call_tool(tool_name, tool_args)).content


@dataclass
class ToolMetrics:
    """Counters of one environment (sum them over environments for a run's metrics)."""

    calls: int = 0
    failures: int = 0  # unknown tool, invalid arguments, the tool raised, or timed out
    timeouts: int = 0
    parse_failures: int = 0  # calls the parser rejected (never executed); see `record_parse`
    truncated: int = 0
    latency_s: float = 0.0
    max_latency_s: float = 0.0

    def record(self, result: ToolResult, timed_out: bool = False) -> None:
        self.calls += 1
        self.failures += int(result.is_error)
        self.timeouts += int(timed_out)
        self.truncated += int(result.truncated)
        self.latency_s += result.latency_s
        self.max_latency_s = max(self.max_latency_s, result.latency_s)

    def as_dict(self, prefix: str = "tools/") -> dict[str, float]:
        """Flat metrics for the run's logger; `mean_latency_s` over executed calls."""
        mean = self.latency_s / self.calls if self.calls else 0.0
        return {
            f"{prefix}calls": self.calls,
            f"{prefix}failures": self.failures,
            f"{prefix}timeouts": self.timeouts,
            f"{prefix}parse_failures": self.parse_failures,
            f"{prefix}truncated": self.truncated,
            f"{prefix}latency_s": self.latency_s,
            f"{prefix}mean_latency_s": mean,
            f"{prefix}max_latency_s": self.max_latency_s,
        }


@dataclass
class CallLimits:
    """Per-call limits every environment applies.

    timeout_s: seconds a call may take before the model gets a timeout error (a sync tool's
        thread keeps running to its end: Python cannot stop a thread).
    max_output_chars: longer outputs are cut, with a note saying how much was cut.
    """

    timeout_s: float | None = 30.0
    max_output_chars: int = 8192


def render_output(value: object) -> str:
    """A tool's return value as tool-message text: strings as they are, the rest as JSON."""
    if isinstance(value, str):
        return value
    return json.dumps(value, ensure_ascii=False, default=str)


def truncate(text: str, limit: int) -> tuple[str, bool]:
    if len(text) <= limit:
        return text, False
    return text[:limit] + f"\n... [truncated {len(text) - limit} characters]", True


async def guarded_call(
    name: str,
    run: Callable[[], Awaitable[tuple[str, bool]]],
    limits: CallLimits,
    metrics: ToolMetrics,
) -> ToolResult:
    """Await `run() -> (text, is_error)` under the limits; every failure becomes a result."""
    start = time.perf_counter()
    timed_out = False
    try:
        text, is_error = await asyncio.wait_for(run(), limits.timeout_s)
    except asyncio.TimeoutError:
        text, is_error = f"error: tool {name!r} timed out after {limits.timeout_s}s", True
        timed_out = True
    except Exception as exc:  # the model must see the error, the rollout must go on
        text, is_error = f"error: tool {name!r} raised {type(exc).__name__}: {exc}", True
    # Our error messages must stay readable even under a tiny output limit.
    text, cut = truncate(
        text, max(limits.max_output_chars, 2000) if is_error else limits.max_output_chars
    )
    result = ToolResult(name, text, is_error, time.perf_counter() - start, cut)
    metrics.record(result, timed_out)
    return result


async def run_tool_calls(
    env: ToolingEnv,
    calls: list[ToolCall],
    failures: Sequence[ParseFailure] = (),
    metrics: ToolMetrics | None = None,
) -> list[ToolMessage]:
    """Execute parsed calls concurrently; return OpenAI `tool` messages in call order.

    Parse failures are never executed; they are counted in `metrics` (default: the env's
    own `metrics` attribute when it has one) so the run can report them.
    """
    metrics = metrics if metrics is not None else getattr(env, "metrics", None)
    if metrics is not None:
        metrics.parse_failures += len(failures)
    results = await asyncio.gather(*(env.call_tool(c.name, c.arguments) for c in calls))
    return [
        {"role": "tool", "tool_call_id": c.id, "name": c.name, "content": r.content}
        for c, r in zip(calls, results, strict=True)
    ]
