"""The running batch of the built-in engine: per-row state as tensors.

Every running sample owns one row `[0, B)`. Its state (last token, position,
sampling knobs, generated tokens / logprobs / versions) lives in preallocated
`(max_slots, ...)` tensors so that recording a step and finding finished rows
are a handful of tensor ops, not a loop over the batch. When rows finish, the
last rows move into the holes (`compact`), keeping the running rows dense;
only finished rows and rows with stop strings are touched from Python.

Usage order, from the engine's scheduler thread only:
`add_rows` (after prefill) -> `record` -> `finished_rows` -> `take_outputs` ->
`compact`, then every decode step `record` -> `finished_rows` -> ...
"""

from __future__ import annotations

import itertools
import logging
from collections import deque
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import TypeVar

import torch

from nexrl.inference.prefix_cache import Anchor
from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    TokenCallback,
)
from nexrl.inference.sampler import StopChecker, decode_all, make_output, to_device

logger = logging.getLogger(__name__)


@dataclass
class Pending:
    """A submitted request and where its n samples go."""

    request: GenerationRequest
    future: Future
    stop_ids: list[int]
    checker: StopChecker
    outputs: list[GenerationOutput | None] = field(default_factory=list)
    left: int = 0
    aborted: bool = False
    on_token: TokenCallback | None = None  # streaming requests only
    prefix_anchor: Anchor | None = None  # where its prompt's path in the prefix cache ends

    def finish_sample(self, index: int, output: GenerationOutput) -> None:
        self.outputs[index] = output
        self.left -= 1

    def resolve(self) -> None:
        """Hand the caller its response (once)."""
        if self.future.done():
            return
        req = self.request
        outputs = [o for o in self.outputs if o is not None]
        if len(outputs) < len(self.outputs):  # never a response with holes in it
            missing = len(self.outputs) - len(outputs)
            self.fail(RuntimeError(f"request {req.rid}: {missing} samples never finished"))
            return
        self.future.set_result(GenerationResponse(list(req.input_ids), outputs, req.rid))

    def resolve_empty(self, reason: str = "length") -> None:
        """Resolve with n empty samples (max_new_tokens 0, or aborted while waiting)."""
        self.outputs = [
            GenerationOutput([], [], [], reason) for _ in range(self.request.sampling.n)
        ]
        self.resolve()

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass(slots=True)
class Row:
    pending: Pending
    index: int  # sample index within the request
    generator: torch.Generator | None


# Row kinds counted so that a step skips the work no running row needs. A kind is the
# request's: its n rows are all of it (a seeded request's rows carry generators).
_KINDS: dict[str, Callable[[Pending], bool]] = {
    "stop_strings": lambda p: bool(p.checker.stop),
    "seeded": lambda p: p.request.sampling.seed is not None,
    "streaming": lambda p: p.on_token is not None,
    "greedy": lambda p: p.request.sampling.temperature <= 0,
    "tempered": lambda p: p.request.sampling.temperature not in (0, 1),
    "truncated": lambda p: p.request.sampling.top_k > 0 or p.request.sampling.top_p < 1,
}


def _runs(rows: list[Row]) -> list[tuple[Pending, int]]:
    """(request, number of rows) for each run of consecutive rows of one request."""
    return [
        (run[0].pending, len(run))
        for run in (list(g) for _, g in itertools.groupby(rows, key=lambda r: id(r.pending)))
    ]


_T = TypeVar("_T")


def run_into(fn: Callable[[], _T], future: Future[_T]) -> None:
    """Run a control command on the scheduler thread; its result or error goes to `future`."""
    try:
        future.set_result(fn())
    except Exception as exc:  # the caller re-raises it from future.result()
        future.set_exception(exc)


def take_admissible(waiting: deque[Pending], free: int, max_prefill_tokens: int) -> list[Pending]:
    """Pop from the front of `waiting` the requests one prefill admits: while their samples
    fit the `free` slots and the padded prompt tokens (requests x the longest prompt) fit
    `max_prefill_tokens` (the first request always does). A request for 0 new tokens is
    resolved empty on the way, without a slot."""
    chosen: list[Pending] = []
    slots, longest = free, 0  # longest: the padded width of the prefill
    while waiting:
        p = waiting[0]
        n, width = p.request.sampling.n, max(longest, len(p.request.input_ids))
        if n > slots or (chosen and width * (len(chosen) + 1) > max_prefill_tokens):
            break
        waiting.popleft()
        if p.request.sampling.max_new_tokens == 0:
            p.resolve_empty()
            continue
        chosen.append(p)
        slots, longest = slots - n, width
    return chosen


class RunningBatch:
    """Dense per-row state of the running samples (see module docstring)."""

    def __init__(self, max_slots: int, max_len: int, device: str | torch.device = "cpu") -> None:
        s, d = max_slots, device
        self.max_slots, self.max_len = max_slots, max_len
        self.rows: list[Row] = []
        self.counts = dict.fromkeys(_KINDS, 0)  # running rows of each kind
        self._aborting = False  # some row has its abort flag set
        self.cur_tok = torch.zeros(s, dtype=torch.long, device=d)
        self.pos = torch.zeros(s, dtype=torch.long, device=d)  # position of cur_tok
        self.n_gen = torch.zeros(s, dtype=torch.long, device=d)
        self.max_gen = torch.zeros(s, dtype=torch.long, device=d)
        self.temp = torch.ones(s, device=d)
        self.top_p = torch.ones(s, device=d)
        self.top_k = torch.zeros(s, dtype=torch.long, device=d)
        self.abort = torch.zeros(s, dtype=torch.bool, device=d)
        self.stop_ids = torch.full((s, 1), -1, dtype=torch.long, device=d)
        self.out_tok = torch.zeros(s, max_len, dtype=torch.long, device=d)
        self.out_lp = torch.zeros(s, max_len, device=d)
        self.out_ver = torch.zeros(s, max_len, dtype=torch.int32, device=d)
        # positions kept on the host too, so a step never waits on the device to read one
        on_host = self.pos.device.type == "cpu"
        self.host_pos = self.pos if on_host else torch.zeros(s, dtype=torch.long)

    def __len__(self) -> int:
        return len(self.rows)

    @property
    def free(self) -> int:
        return self.max_slots - len(self.rows)

    def _per_row(self) -> list[torch.Tensor]:
        return [
            self.cur_tok,
            self.pos,
            self.n_gen,
            self.max_gen,
            self.temp,
            self.top_p,
            self.top_k,
            self.abort,
            self.stop_ids,
            self.out_tok,
            self.out_lp,
            self.out_ver,
        ]

    def add_rows(self, rows: list[Row], prompt_lens: list[int]) -> slice:
        """Append rows (prefilled elsewhere; a request's rows side by side); returns their
        row range. Each request's settings are read once and spread over its rows."""
        start = len(self.rows)
        idx = slice(start, start + len(rows))
        runs = _runs(rows)
        width = max(len(p.stop_ids) for p, _ in runs)
        if width > self.stop_ids.shape[1]:
            extra = width - self.stop_ids.shape[1]
            pad = torch.full((self.max_slots, extra), -1, dtype=torch.long, device=self.pos.device)
            self.stop_ids = torch.cat([self.stop_ids, pad], dim=1)
        params = [p.request.sampling for p, _ in runs]
        counts = torch.tensor([n for _, n in runs])
        dev = self.pos.device

        def spread(values: list, dtype: torch.dtype) -> torch.Tensor:
            return to_device(torch.tensor(values, dtype=dtype).repeat_interleave(counts, 0), dev)

        plens = to_device(torch.tensor(prompt_lens), dev)
        wanted = spread([p.max_new_tokens for p in params], torch.long)
        self.max_gen[idx] = torch.minimum(wanted, self.max_len - plens)
        self.pos[idx] = plens - 1
        if self.host_pos is not self.pos:
            self.host_pos[idx] = torch.tensor(prompt_lens) - 1
        self.temp[idx] = spread([float(p.temperature) for p in params], torch.float32)
        self.top_p[idx] = spread([float(p.top_p) for p in params], torch.float32)
        self.top_k[idx] = spread([p.top_k for p in params], torch.long)
        pad_to = self.stop_ids.shape[1]
        self.stop_ids[idx] = spread(
            [p.stop_ids + [-1] * (pad_to - len(p.stop_ids)) for p, _ in runs], torch.long
        )
        self.n_gen[idx] = 0
        self.abort[idx] = False
        self.rows.extend(rows)
        self._count_runs(runs, +1)
        return idx

    def _count(self, rows: list[Row], sign: int) -> None:
        """Add (`sign` 1) or take away (-1) `rows` in the kind counts."""
        self._count_runs(_runs(rows), sign)

    def _count_runs(self, runs: list[tuple[Pending, int]], sign: int) -> None:
        """The kind counts of (request, rows) runs: each request tested once."""
        for pending, n in runs:
            for kind, test in _KINDS.items():
                if test(pending):
                    self.counts[kind] += sign * n

    def generators(self, rows: slice) -> dict[int, torch.Generator]:
        """Private generators by position in the row range `rows`."""
        if not self.counts["seeded"]:
            return {}
        chosen = self.rows[rows]
        return {i: r.generator for i, r in enumerate(chosen) if r.generator is not None}

    def set_abort(self, j: int) -> None:
        self.abort[j] = True
        self._aborting = True

    def stream(self, rows: slice, tokens: torch.Tensor, lps: torch.Tensor, version: int) -> None:
        """Hand each new token of `rows` to its request's `on_token` listener, if any."""
        rng = range(rows.start, rows.stop)
        for j, tok, lp in zip(rng, tokens.tolist(), lps.tolist(), strict=True):
            pending, index = self.rows[j].pending, self.rows[j].index
            if pending.on_token is None:
                continue
            try:
                pending.on_token(index, tok, lp, version)
            except Exception:  # a broken listener must not stop the batch
                logger.exception("streaming callback of request %s failed", pending.request.rid)

    def record(self, rows: slice, tokens: torch.Tensor, lps: torch.Tensor, version: int):
        """Store the sampled tokens (M,) of the row range `rows` and advance those rows."""
        n = self.n_gen[rows, None]
        self.out_tok[rows].scatter_(1, n, tokens[:, None])
        self.out_lp[rows].scatter_(1, n, lps[:, None])
        self.out_ver[rows].scatter_(1, n, torch.full_like(n, version, dtype=torch.int32))
        self.n_gen[rows] += 1
        self.pos[rows] += 1
        if self.host_pos is not self.pos:
            self.host_pos[rows] += 1
        self.cur_tok[rows] = tokens

    def max_pos(self) -> int:
        """The largest position of a running row (-1 when none runs), read on the host."""
        b = len(self.rows)
        return int(self.host_pos[:b].max()) if b else -1

    def finished_rows(self) -> list[int]:
        """Rows that hit max tokens, a stop token, a stop string, or were aborted."""
        b = len(self.rows)
        if b == 0:
            return []
        done = self.n_gen[:b] >= self.max_gen[:b]
        if self._aborting:  # every aborted row is found here, and then compacted away
            done |= self.abort[:b]
            self._aborting = False
        done |= (self.cur_tok[:b, None] == self.stop_ids[:b]).any(dim=1)
        found = done.nonzero().flatten().tolist()
        if not self.counts["stop_strings"]:
            return found
        for j, row in enumerate(self.rows):
            if row.pending.checker.stop and j not in found and self._hit_stop_string(j):
                found.append(j)
        return found

    def _hit_stop_string(self, j: int) -> bool:
        ids = self.out_tok[j, : int(self.n_gen[j])].tolist()
        return self.rows[j].pending.checker.find(ids) >= 0

    def take_outputs(self, rows: list[int], tokenizer) -> list[tuple[Row, GenerationOutput]]:
        """The finished samples of `rows`, read from the batch tensors in one gather each."""
        index = to_device(torch.tensor(rows), self.n_gen.device)
        lengths = self.n_gen[index].tolist()
        width = max(lengths, default=0)  # only the written columns: rows span max_model_len
        tokens = self.out_tok[index, :width].tolist()
        lps, versions = self.out_lp[index, :width].tolist(), self.out_ver[index, :width].tolist()
        aborted = self.abort[index].tolist()
        ids = [tokens[k][:n] for k, n in enumerate(lengths)]
        texts = decode_all(tokenizer, ids)
        taken = []
        for k, j in enumerate(rows):
            row, n, out = self.rows[j], lengths[k], ids[k]
            pending = row.pending
            if aborted[k]:
                reason = "abort"
            elif n and (out[-1] in pending.stop_ids or pending.checker.find(out) >= 0):
                reason = "stop"
            else:
                reason = "length"
            stop = pending.request.sampling.stop
            sample = make_output(texts[k], out, lps[k][:n], versions[k][:n], reason, stop)
            taken.append((row, sample))
        return taken

    def compact(self, finished: list[int]) -> tuple[torch.Tensor, torch.Tensor, int]:
        """Drop `finished` rows, moving the last live rows into the holes. Returns (src,
        dst, span): the rows moved, where to, and 1 + the largest position among them."""
        b = len(self.rows)
        keep_n = b - len(finished)
        gone = set(finished)
        order = sorted(gone)
        self._count([self.rows[j] for j in order], -1)
        holes = [j for j in order if j < keep_n]
        movers = [j for j in range(keep_n, b) if j not in gone]
        src = to_device(torch.tensor(movers, dtype=torch.long), self.pos.device)
        dst = to_device(torch.tensor(holes, dtype=torch.long), self.pos.device)
        span = int(self.host_pos[movers].max()) + 1 if movers else 0
        if holes:
            for t in self._per_row():
                t[dst] = t[src]
            if self.host_pos is not self.pos:
                self.host_pos[holes] = self.host_pos[movers]
            for h, m in zip(holes, movers, strict=True):
                self.rows[h] = self.rows[m]
        del self.rows[keep_n:]
        return src, dst, span
