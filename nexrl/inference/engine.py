"""`Engine`: the built-in continuous-batching inference engine.

One scheduler thread owns the model, the KV cache and the running batch.
Callers (any thread, or asyncio through `agenerate`) submit a request and wait
on a `concurrent.futures.Future`. Every loop of the scheduler:

1. runs control commands (weight update, pause, abort) between steps, so a
   command never races a forward;
2. admits waiting requests while slots are free: their prompts prefill in one
   padded forward, once per request whatever `n` (prefix sharing), and each
   of the `n` rows samples its first token;
3. runs ONE decode forward for all running rows and samples the next tokens;
4. finishes rows (max tokens, stop token/string, abort) and resolves a
   request's future when its last sample finishes.

Requests therefore join and leave the batch at every step. A weight update
lets running samples continue on the new weights (partial rollout): their KV
cache keeps the old weights' prefix, and `output_versions` records, per token,
the version that sampled it.
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch

from nexrl.config.options import ENGINE_DEFAULTS as _D
from nexrl.config.options import InferenceEngineConfig
from nexrl.inference.factory import build_engine  # noqa: F401  (its home until it moved)
from nexrl.inference.model_runner import ModelRunner, plan_kv_cache
from nexrl.inference.prefix_cache import PrefixCache
from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    TokenCallback,
    WeightUpdateMeta,
)
from nexrl.inference.sampler import (
    SampleKinds,
    StopChecker,
    check_fits,
    sample_generator,
    sample_next,
    stop_token_set,
    to_device,
    validate_params,
)
from nexrl.inference.scheduler import Pending, Row, RunningBatch, run_into, take_admissible
from nexrl.inference.weights import (
    load_model_and_tokenizer,
    load_weights_into,
    state_dict_from_meta,
)
from nexrl.models.threads import threads_for, use_threads

logger = logging.getLogger(__name__)


class Engine:
    """Continuous-batching `InferenceEngine` for Llama/Qwen2/Qwen3 checkpoints. Options:
    `nexrl.config.options.InferenceEngineConfig` (their defaults and meaning);
    `Engine.from_config` takes that dataclass."""

    supports_streaming = True  # submit(..., on_token=...)

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        max_batch_size: int = _D.max_batch_size,
        max_model_len: int | None = _D.max_model_len,
        kv_cache_gib: float | None = _D.kv_cache_gib,
        max_prefill_tokens: int = _D.max_prefill_tokens,
        dtype: str = _D.dtype,
        device: str = _D.device,
        seed: int = _D.seed,
        model_and_tokenizer: tuple[Any, Any] | None = None,
        emulated_step_latency_s: float = _D.emulated_step_latency_s,
        matmul: str = _D.matmul,
        native_attention: bool = _D.native_attention,
        gather_quiet_s: float = _D.gather_quiet_s,
        gather_max_s: float = _D.gather_max_s,
        threads: int | None = _D.threads,
        prefix_cache_gib: float = _D.prefix_cache_gib,
        cuda_graphs: bool = _D.cuda_graphs,
    ) -> None:
        if model_path is None and model_and_tokenizer is None:
            from nexrl.models.tiny import default_model_path

            model_path = default_model_path()
        self.model_path = str(model_path)
        model, tok = model_and_tokenizer or load_model_and_tokenizer(self.model_path, dtype, device)
        self.model, self.tokenizer = model, tok
        self.threads = threads_for(model, threads, "engine option threads")
        # the cache is (max_batch_size, max_model_len) rows: sized by the budget, never by
        # the model's context (see model_runner.plan_kv_cache)
        dtype_t = next(model.parameters()).dtype
        self.max_model_len = plan_kv_cache(
            model.config, dtype_t, max_batch_size, max_model_len, kv_cache_gib
        )
        logger.info(
            "engine KV cache: %d rows x max_model_len %d", max_batch_size, self.max_model_len
        )
        self.max_batch_size = max_batch_size
        self.max_prefill_tokens = max_prefill_tokens
        self.emulated_step_latency_s = float(emulated_step_latency_s)
        if gather_quiet_s < 0 or gather_max_s < 0:
            raise ValueError(
                f"gather_quiet_s={gather_quiet_s} and gather_max_s={gather_max_s} must be >= 0"
            )
        self.gather_quiet_s, self.gather_max_s = float(gather_quiet_s), float(gather_max_s)
        self.runner = ModelRunner(
            model, max_batch_size, self.max_model_len, matmul, native_attention, cuda_graphs
        )
        self.prefix = PrefixCache.for_runner(self.runner, prefix_cache_gib)
        # on the model's device: a model passed in ready-made may live on any of them
        self.batch = RunningBatch(max_batch_size, self.max_model_len, self.runner.device)
        eos = model.generation_config.eos_token_id
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self._gen = torch.Generator().manual_seed(seed)
        # request ids: a random prefix per engine, then a count (no syscall per request;
        # `next` on a count is atomic, so submitting threads never share an id)
        self._rid_prefix, self._rid_count = uuid.uuid4().hex[:12], itertools.count()
        self._version = 0
        self._paused = False
        self._stopping = False
        self._cv = threading.Condition()
        self._inbox: deque[Pending] = deque()
        self._commands: deque[tuple[Callable[[], Any], Future]] = deque()
        self._waiting: deque[Pending] = deque()
        self.stats = {"requests": 0, "generated_tokens": 0, "steps": 0, "running": 0, "waiting": 0}
        self.stats.update(prompt_tokens=0, prefix_hit_tokens=0)  # hits: read from the prefix cache
        self._thread = threading.Thread(target=self._loop, name="nexrl-engine", daemon=True)
        self._thread.start()

    @classmethod
    def from_config(
        cls,
        config: InferenceEngineConfig,
        model_path: str | Path | None = None,
        model_and_tokenizer: tuple[Any, Any] | None = None,
    ) -> Engine:
        """An engine with the typed options `config`."""
        options = dataclasses.asdict(config)
        return cls(model_path, model_and_tokenizer=model_and_tokenizer, **options)

    # -- public API -------------------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._version

    def submit(self, request: GenerationRequest, on_token: TokenCallback | None = None) -> Future:
        """Queue `request`; the future resolves to its `GenerationResponse`.

        With `on_token`, every sampled token is also handed to it as soon as it exists
        (streaming); the future still resolves with the whole response at the end.
        """
        params = request.sampling
        validate_params(params)
        if not request.input_ids:
            raise ValueError("input_ids is empty: a prompt needs at least one token")
        check_fits(len(request.input_ids), params.max_new_tokens, self.max_model_len)
        if params.n > self.max_batch_size:
            raise ValueError(f"n={params.n} exceeds max_batch_size={self.max_batch_size}")
        if request.rid is None:
            request.rid = f"{self._rid_prefix}-{next(self._rid_count)}"
        pending = Pending(
            request,
            Future(),
            stop_token_set(params, self.eos_token_ids),
            StopChecker(self.tokenizer, params.stop),
            [None] * params.n,
            params.n,
            on_token=on_token,
        )
        with self._cv:
            if self._stopping:
                raise RuntimeError("engine is shut down")
            self._inbox.append(pending)
            self._cv.notify()
        return pending.future

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        return self.submit(request).result()

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await asyncio.wrap_future(self.submit(request))

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load new weights (read here, copied in between two steps); version := meta.version."""
        state = state_dict_from_meta(meta)

        def apply() -> None:
            load_weights_into(self.model, state)
            self.runner.refresh()
            if self.prefix is not None:  # its KV came from the old weights
                self.prefix.clear()
            self._version = meta.version

        self._command(apply)

    def reset_prefix_cache(self) -> None:
        """Forget the cached prompt KV (no-op without a prefix cache)."""
        if self.prefix is not None:
            self._command(self.prefix.clear)

    def pause(self) -> None:
        """Return once no step runs; running requests keep their state (and KV cache)."""
        self._command(lambda: setattr(self, "_paused", True))

    def resume(self) -> None:
        self._command(lambda: setattr(self, "_paused", False))

    def abort(self, rid: str | None = None) -> None:
        """Finish running and waiting requests (all, or `rid`) now with finish_reason 'abort'."""
        self._command(lambda: self._abort(rid))

    def health(self) -> bool:
        return self._thread.is_alive()

    def shutdown(self) -> None:
        if not self._thread.is_alive():
            return
        self.abort()
        with self._cv:
            self._stopping = True
            self._cv.notify()
        self._thread.join(timeout=10)

    # -- scheduler thread -------------------------------------------------------------------
    def _command(self, fn: Callable[[], Any]) -> Any:
        if threading.current_thread() is self._thread:
            return fn()
        future: Future = Future()
        with self._cv:
            self._commands.append((fn, future))
            self._cv.notify()
        return future.result()

    def _has_work(self) -> bool:
        return bool(self._commands or self._inbox) or (
            not self._paused and bool(self._waiting or len(self.batch))
        )

    def _loop(self) -> None:
        if self.threads is not None:
            use_threads(self.threads)  # this thread's count only (`threads_for`)
        while True:
            with self._cv:
                while not self._has_work() and not self._stopping:
                    self._cv.wait()
                if self._stopping:
                    return
                commands = list(self._commands)
                self._commands.clear()
                if not commands and not len(self.batch) and not self._paused:
                    self._gather()
                self._waiting.extend(self._inbox)
                self._inbox.clear()
            for fn, future in commands:
                run_into(fn, future)
            if not self._paused:
                self._guarded_step()

    def _gather(self) -> None:
        """Idle, with requests arriving: let the burst land before the first step (called
        holding `_cv`). Clients that submit together (a step's rollout workers) then share
        one prefill and one decode wave instead of trickling into the batch one per step
        while their submitting threads and the engine contend for the interpreter. Waits
        while each new request comes within `gather_quiet_s` of the last, at most
        `gather_max_s`, and never once the arrivals fill the free slots or a command or
        shutdown is queued."""
        if self.gather_quiet_s <= 0 or self.gather_max_s <= 0:
            return
        deadline = time.monotonic() + self.gather_max_s
        while not self._commands and not self._stopping:
            queued = [*self._waiting, *self._inbox]
            left = deadline - time.monotonic()
            if left <= 0 or sum(p.request.sampling.n for p in queued) >= self.batch.free:
                return
            self._cv.wait(min(self.gather_quiet_s, left))
            if len(self._inbox) + len(self._waiting) == len(queued):
                return  # quiet: nothing new within the window

    def _guarded_step(self) -> None:
        try:
            self._step()
        except Exception as exc:  # fail every caller instead of hanging them, then go on
            logger.exception("engine step failed")
            for pending in {id(r.pending): r.pending for r in self.batch.rows}.values():
                pending.fail(exc)
            for pending in self._waiting:
                pending.fail(exc)
            self._waiting.clear()
            self.batch.compact(list(range(len(self.batch))))

    def _step(self) -> None:
        if self.emulated_step_latency_s > 0:  # see "Emulated accelerator" in docs/async.md
            time.sleep(self.emulated_step_latency_s)
        if self._admit():
            self._finish()  # a first token may already end a sample
        b = len(self.batch)
        if b:
            span = self.batch.max_pos() + 1  # read on the host: no wait for the device
            logits = self.runner.decode(self.batch.cur_tok[:b], self.batch.pos[:b], span)
            self._sample_and_record(slice(0, b), logits)
        self._finish()
        self.stats.update(running=len(self.batch), waiting=len(self._waiting))
        self.stats["steps"] += 1

    def _sample_and_record(self, rows: slice, logits: torch.Tensor) -> None:
        bt = self.batch
        tokens, lps = sample_next(
            logits,
            bt.temp[rows],
            bt.top_p[rows],
            bt.top_k[rows],
            bt.generators(rows),
            self._gen,
            kinds=SampleKinds.of(bt.counts),
        )
        bt.record(rows, tokens, lps, self._version)
        self.stats["generated_tokens"] += rows.stop - rows.start
        if bt.counts["streaming"]:
            bt.stream(rows, tokens, lps, self._version)

    def _admit(self) -> bool:
        """Prefill waiting requests that fit (slots and prefill token budget); True if any."""
        chosen = take_admissible(self._waiting, self.batch.free, self.max_prefill_tokens)
        if chosen:
            self._prefill(chosen)
        return bool(chosen)

    def _prefill(self, chosen: list[Pending]) -> None:
        """Prefill `chosen`: prompts that share a prefix nobody has cached go in two
        waves, one prompt per shared prefix first (see `prefix_cache.split_waves`)."""
        waves: Sequence[list[int]] = [list(range(len(chosen)))]
        if self.prefix is not None:
            waves = self.prefix.split_waves([p.request.input_ids for p in chosen])
        for wave in waves:
            if wave:
                self._prefill_alone_on_failure([chosen[i] for i in wave])
        self.stats["requests"] += len(chosen)

    def _prefill_alone_on_failure(self, wave: list[Pending]) -> None:
        """Prefill `wave`; if that fails, prefill its requests one by one, so a request
        that cannot be prefilled fails alone (its own future) and the others run. The
        rows a failed attempt added are dropped first (they are the batch's tail)."""
        before = len(self.batch)
        try:
            self._prefill_wave(wave)
        except Exception as exc:
            if len(self.batch) > before:
                self.batch.compact(list(range(before, len(self.batch))))
            if len(wave) == 1:
                logger.warning("request %s failed in prefill: %r", wave[0].request.rid, exc)
                wave[0].fail(exc)
                return
            for pending in wave:
                self._prefill_alone_on_failure([pending])

    def _prefill_wave(self, chosen: list[Pending]) -> None:
        prompts = [p.request.input_ids for p in chosen]
        cached = [self.prefix.match(ids) if self.prefix else [] for ids in prompts]
        start = torch.tensor([len(c) for c in cached])
        self.stats["prompt_tokens"] += sum(map(len, prompts))
        self.stats["prefix_hit_tokens"] += int(start.sum())
        lengths = torch.tensor([len(ids) for ids in prompts]) - start
        tokens = torch.zeros(len(chosen), int(lengths.max()), dtype=torch.long)
        for i, (ids, c) in enumerate(zip(prompts, cached, strict=True)):
            tokens[i, : len(ids) - len(c)] = torch.tensor(ids[len(c) :])
        rows: list[Row] = []
        src: list[int] = []
        for i, p in enumerate(chosen):
            n, seed = p.request.sampling.n, p.request.sampling.seed
            rows.extend(
                Row(p, k, None if seed is None else sample_generator(seed, k)) for k in range(n)
            )
            src.extend([i] * n)
        first = len(self.batch)
        dst = torch.arange(first, first + len(rows))
        if self.prefix is not None:
            self.prefix.load(self.runner, [(first + j, cached[i]) for j, i in enumerate(src)])
        logits = self.runner.prefill(tokens, lengths, torch.tensor(src), dst, start)  # (R, V)
        if self.prefix is not None:
            anchors = self.prefix.insert_prompts(self.runner, prompts, src, first)
            for i, anchor in anchors.items():
                chosen[i].prefix_anchor = anchor  # its samples' inserts start there
        idx = self.batch.add_rows(rows, [len(prompts[i]) for i in src])
        self._sample_and_record(
            idx, logits.index_select(0, to_device(torch.tensor(src), logits.device))
        )

    def _finish(self) -> None:
        finished = self.batch.finished_rows()
        if not finished:
            return
        taken = self.batch.take_outputs(finished, self.tokenizer)
        if self.prefix is not None:
            self._cache_samples(self.prefix, finished, taken)
        for row, output in taken:
            row.pending.finish_sample(row.index, output)
            if row.pending.left == 0:
                row.pending.resolve()
        src, dst, span = self.batch.compact(finished)
        if dst.numel():  # cache positions past the movers' own are never read: not copied
            self.runner.move_rows(src, dst, span)

    def _cache_samples(
        self, prefix: PrefixCache, rows: list[int], taken: list[tuple[Row, GenerationOutput]]
    ) -> None:
        """Finished samples into the prefix cache, but those of requests that send no next
        turn (`cache_output` off); see `PrefixCache.insert_samples`."""
        samples = []
        for j, (row, out) in zip(rows, taken, strict=True):
            request, anchor = row.pending.request, row.pending.prefix_anchor
            if request.cache_output:
                samples.append((j, request.input_ids, out.output_ids, out.output_versions, anchor))
        prefix.insert_samples(self.runner, samples, self._version)

    def _abort(self, rid: str | None) -> None:
        self._waiting.extend(self._inbox)
        self._inbox.clear()
        for j, row in enumerate(self.batch.rows):
            if rid is None or row.pending.request.rid == rid:
                self.batch.set_abort(j)
        keep: deque[Pending] = deque()
        for p in self._waiting:
            if rid is None or p.request.rid == rid:
                p.resolve_empty("abort")
            else:
                keep.append(p)
        self._waiting = keep
        self._finish()
