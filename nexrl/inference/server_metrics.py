"""Prometheus metrics of `nexrl serve` (`GET /metrics`)."""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Gauge, generate_latest

from nexrl.inference.protocol import InferenceEngine
from nexrl.inference.tool_parsers import ParseResult


class ServerMetrics:
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
        self.prompt_tokens = Gauge("nexrl_prompt_tokens", "Prompt tokens admitted", registry=r)
        self.prefix_hits = Gauge(
            "nexrl_prefix_cache_hit_tokens", "Prompt tokens read from the prefix cache", registry=r
        )
        self.tool_calls = Counter("nexrl_tool_calls", "Tool calls parsed from replies", registry=r)
        self.tool_parse_failures = Counter(
            "nexrl_tool_call_parse_failures", "Malformed or truncated tool calls", registry=r
        )
        self._last = (time.monotonic(), 0.0)
        self._total = 0.0

    def parsed(self, parsed: ParseResult) -> None:
        _, calls, failures = parsed
        self.tool_calls.inc(len(calls))
        self.tool_parse_failures.inc(len(failures))

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
        self.prompt_tokens.set(stats.get("prompt_tokens", 0))
        self.prefix_hits.set(stats.get("prefix_hit_tokens", 0))
        self.version.set(self.engine.version)
        return generate_latest(self.registry)
