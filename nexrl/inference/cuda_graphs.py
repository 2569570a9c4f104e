"""The decode step as CUDA graphs: one recorded forward per (batch bucket, span bucket).

On a GPU a small model's decode step is launch-bound: SmolLM2-135M runs some 15
kernels per layer for 30 layers, each a few microseconds of GPU work behind tens of
microseconds of Python and launch overhead. A CUDA graph records the whole forward
once and replays it with a single launch.

A graph has fixed shapes and fixed addresses, so every step copies its tokens and
positions into static input tensors, pads the batch to the next bucket (powers of two
up to the engine's slots) and attends over a fixed span bucket (powers of two from
`MIN_SPAN`, masked to each row's own positions). Padded rows decode token 0 at
position 0 of their own cache rows: rows past the running batch are free, and a
prefill writes a row before it is used. Graphs are recorded when the engine starts
(`DecodeGraphs` says why), share one memory pool and write one logits buffer, which a
step reads before the next replay.

Weights are read by address: `ModelRunner.refresh` copies new weights into the tensors
the graphs recorded (`keep_addresses`) instead of rebuilding them.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from functools import partial

import torch

logger = logging.getLogger(__name__)

DecodeFn = Callable[[torch.Tensor, torch.Tensor, int], torch.Tensor]
"""(tokens (B,), positions (B,), attended span) -> logits (B, V)."""

MIN_SPAN = 128
"""Smallest span bucket: shorter sequences attend over this many (masked) positions."""


def bucket(n: int, cap: int, least: int = 1) -> int:
    """The smallest power of two >= max(n, least), at most `cap`."""
    size = least
    while size < n:
        size *= 2
    return min(size, cap)


def buckets(least: int, cap: int) -> list[int]:
    """Every value `bucket(n, cap, least)` takes: least, 2 least, 4 least, ..., cap."""
    sizes = [min(least, cap)]
    while sizes[-1] < cap:
        sizes.append(min(2 * sizes[-1], cap))
    return sizes


class DecodeGraphs:
    """The decode forward of every (batch bucket, span bucket), recorded when the engine
    starts and replayed per step into one shared logits buffer.

    Why all up front: recording marks the device's default random generator as capturing,
    so another thread of the process that drew CUDA random numbers meanwhile (a trainer's
    dropout beside the engine in a fully-async run) would fail. `capture=False` runs the
    same padded, fixed-span forwards eagerly: the bucketing and padding are then checked
    on any device (the tests run it on a CPU).
    """

    def __init__(
        self,
        decode: DecodeFn,
        max_slots: int,
        max_len: int,
        vocab: int,
        device,
        capture: bool = True,
    ) -> None:
        self.decode, self.max_slots, self.max_len = decode, max_slots, max_len
        self.tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.out = torch.zeros(max_slots, vocab, device=device)  # the logits of a step
        self.graphs: dict[tuple[int, int], Callable[[], None]] = {}
        self.failed = False
        self._record_all(capture)

    def keys(self) -> list[tuple[int, int]]:
        """(rows, span) of every forward, largest first (later ones reuse its memory)."""
        spans, rows = buckets(MIN_SPAN, self.max_len), buckets(1, self.max_slots)
        return [(r, s) for s in reversed(spans) for r in reversed(rows)]

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """Logits (B, V) of rows [0, B): `span` is at least their largest position + 1.
        The buffer is overwritten by the next call."""
        if self.failed:
            return self.decode(tokens, pos, span)
        b = tokens.shape[0]
        rows = bucket(b, self.max_slots)
        self.tokens[:b].copy_(tokens)
        self.pos[:b].copy_(pos)
        if rows > b:
            self.tokens[b:rows].zero_()
            self.pos[b:rows].zero_()
        self.graphs[rows, bucket(span, self.max_len, MIN_SPAN)]()
        return self.out[:b]

    @torch.inference_mode()
    def _record_all(self, capture: bool) -> None:
        pool = torch.cuda.graph_pool_handle() if capture else None
        start = time.perf_counter()
        try:
            for rows, span in self.keys():
                run = partial(self._forward, rows, span)
                self.graphs[rows, span] = self._record(run, pool) if capture else run
            took = time.perf_counter() - start
            logger.info("decode step: %d CUDA graphs in %.2f s", len(self.graphs), took)
        except RuntimeError:  # a failed capture may leave the pool unusable: eager steps
            logger.exception("recording the decode step as CUDA graphs failed: eager steps")
            self.failed = True
            self.graphs.clear()

    def _forward(self, rows: int, span: int) -> None:
        self.out[:rows].copy_(self.decode(self.tokens[:rows], self.pos[:rows], span))

    @staticmethod
    def _record(run: Callable[[], None], pool) -> Callable[[], None]:
        """`run` recorded after one warm-up run (cuBLAS handles, kernel choices) on a side
        stream; both write K/V of token 0 at position 0, in rows nobody runs yet."""
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            run()
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=pool, capture_error_mode="thread_local"):
            run()
        return graph.replay


def keep_addresses(old: list[torch.Tensor | None], new: list[torch.Tensor | None]) -> None:
    """Copy each new tensor into its old one where they are different tensors (after a
    weight update the fused weights are rebuilt; recorded graphs read the old ones)."""
    for o, n in zip(old, new, strict=True):
        if o is not None and n is not None and o.data_ptr() != n.data_ptr():
            o.copy_(n)
