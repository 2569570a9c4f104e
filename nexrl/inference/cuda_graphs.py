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
prefill writes a row before it is used. Graphs are recorded on first use and share one
memory pool; their outputs are read before the next replay, so sharing is safe.

Weights are read by address: `ModelRunner.refresh` copies new weights into the tensors
the graphs recorded (`keep_addresses`) instead of rebuilding them.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

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


class DecodeGraphs:
    """Replays a recorded decode forward for a batch padded to its bucket.

    `capture=False` runs the same padded, fixed-span forward eagerly: the padding and
    bucketing are then checked on any device (the tests run it on a CPU).
    """

    def __init__(
        self, decode: DecodeFn, max_slots: int, max_len: int, device, capture: bool = True
    ) -> None:
        self.decode, self.max_slots, self.max_len = decode, max_slots, max_len
        self.capture = capture
        self.tokens = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.pos = torch.zeros(max_slots, dtype=torch.long, device=device)
        self.graphs: dict[tuple[int, int], tuple[torch.cuda.CUDAGraph, torch.Tensor]] = {}
        self.pool = torch.cuda.graph_pool_handle() if capture else None
        self.failed = False

    def __call__(self, tokens: torch.Tensor, pos: torch.Tensor, span: int) -> torch.Tensor:
        """Logits (B, V) of rows [0, B): `span` is at least their largest position + 1."""
        b = tokens.shape[0]
        rows = bucket(b, self.max_slots)
        key = (rows, bucket(span, self.max_len, MIN_SPAN))
        self.tokens[:b].copy_(tokens)
        self.pos[:b].copy_(pos)
        if rows > b:
            self.tokens[b:rows].zero_()
            self.pos[b:rows].zero_()
        if not self.capture:
            return self.decode(self.tokens[:rows], self.pos[:rows], key[1])[:b]
        if self.failed:
            return self.decode(tokens, pos, span)
        if key not in self.graphs:
            try:
                self.graphs[key] = self._record(*key)
            except RuntimeError:  # a failed capture may leave the pool unusable: eager from now
                logger.exception("recording the decode step as a CUDA graph failed: eager")
                self.failed = True
                return self.decode(tokens, pos, span)
        graph, out = self.graphs[key]
        graph.replay()
        return out[:b]

    def _record(self, rows: int, span: int) -> tuple[torch.cuda.CUDAGraph, torch.Tensor]:
        """Record the forward of `rows` rows over `span` positions. The warm-up runs write
        the same K/V the replay that follows writes (same tokens, positions, weights)."""
        tokens, pos = self.tokens[:rows], self.pos[:rows]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):  # lazy initialisation (cuBLAS handles, SDPA choice) first
                self.decode(tokens, pos, span)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: other threads (a trainer beside the engine) may use the GPU meanwhile
        with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
            out = self.decode(tokens, pos, span)
        return graph, out

    def clear(self) -> None:
        self.graphs.clear()


def keep_addresses(old: list[torch.Tensor | None], new: list[torch.Tensor | None]) -> None:
    """Copy each new tensor into its old one where they are different tensors (after a
    weight update the fused weights are rebuilt; recorded graphs read the old ones)."""
    for o, n in zip(old, new, strict=True):
        if o is not None and n is not None and o.data_ptr() != n.data_ptr():
            o.copy_(n)
