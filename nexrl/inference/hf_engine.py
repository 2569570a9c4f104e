"""`HFEngine`: the `InferenceEngine` on top of `transformers`' `model.generate`.

It is the reference the fast engine is measured and tested against, and the
fall-back for architectures the lean forward does not cover. One request runs
at a time (a lock owns the model); its `n` samples run as one `generate` call.
Logprobs come from the raw logits (`output_logits=True`) with the convention
of `nexrl.inference.sampler`. Abort works through a stopping criterion that
checks an abort flag at every step.
"""

from __future__ import annotations

import asyncio
import threading
from pathlib import Path

import torch
from transformers import StoppingCriteria, StoppingCriteriaList

from nexrl.config.options import ENGINE_DEFAULTS
from nexrl.inference.protocol import (
    GenerationOutput,
    GenerationRequest,
    GenerationResponse,
    SamplingParams,
    WeightUpdateMeta,
)
from nexrl.inference.sampler import (
    StopChecker,
    decode_all,
    make_output,
    stop_token_set,
    validate_params,
)
from nexrl.inference.weights import (
    load_model_and_tokenizer,
    load_weights_into,
    state_dict_from_meta,
)


class _AbortFlag(StoppingCriteria):
    def __init__(self) -> None:
        self.set = False

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor, **kwargs) -> torch.Tensor:
        return torch.full((input_ids.shape[0],), self.set, dtype=torch.bool)


class HFEngine:
    """`InferenceEngine` backed by `model.generate`. Thread-safe; requests are serialised."""

    def __init__(
        self,
        model_path: str | Path | None = None,
        *,
        dtype: str = ENGINE_DEFAULTS.dtype,
        device: str = ENGINE_DEFAULTS.device,
        max_model_len: int | None = ENGINE_DEFAULTS.max_model_len,
    ) -> None:
        if model_path is None:
            from nexrl.models.tiny import default_model_path

            model_path = default_model_path()
        self.model_path = str(model_path)
        self.model, self.tokenizer = load_model_and_tokenizer(model_path, dtype, device)
        self.device = device
        self.max_model_len = max_model_len or self.model.config.max_position_embeddings
        eos = self.model.generation_config.eos_token_id
        self.eos_token_ids: list[int] = [eos] if isinstance(eos, int) else list(eos or [])
        self._lock = threading.Lock()
        self._running = threading.Event()
        self._running.set()
        self._aborts: dict[str | None, _AbortFlag] = {}
        self._version = 0

    @property
    def version(self) -> int:
        return self._version

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        return await asyncio.to_thread(self.generate, request)

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        params = request.sampling
        validate_params(params)
        if len(request.input_ids) >= self.max_model_len:
            raise ValueError(
                f"prompt has {len(request.input_ids)} tokens, the context is {self.max_model_len}"
            )
        flag = _AbortFlag()
        self._aborts[request.rid] = flag
        try:
            self._running.wait()
            with self._lock:
                outputs = self._generate_locked(request.input_ids, params, flag)
        finally:
            self._aborts.pop(request.rid, None)
        return GenerationResponse(list(request.input_ids), outputs, request.rid)

    @torch.inference_mode()
    def _generate_locked(
        self, input_ids: list[int], params: SamplingParams, flag: _AbortFlag
    ) -> list[GenerationOutput]:
        greedy = params.temperature <= 0
        n_calls, n_seq = (params.n, 1) if greedy else (1, params.n)
        prompt = torch.tensor([input_ids], device=self.device)
        max_new = min(params.max_new_tokens, self.max_model_len - len(input_ids))
        stops = stop_token_set(params, self.eos_token_ids)
        kwargs = dict(
            max_new_tokens=max_new,
            do_sample=not greedy,
            num_return_sequences=n_seq,
            eos_token_id=stops or None,
            pad_token_id=self.tokenizer.pad_token_id,
            output_logits=True,
            return_dict_in_generate=True,
            stopping_criteria=StoppingCriteriaList([flag]),
        )
        if not greedy:
            kwargs.update(
                temperature=params.temperature, top_p=params.top_p, top_k=max(0, params.top_k)
            )
        if params.stop:
            kwargs.update(stop_strings=list(params.stop), tokenizer=self.tokenizer)
        outputs: list[GenerationOutput] = []
        with torch.random.fork_rng(devices=[]):
            if params.seed is not None:
                torch.manual_seed(params.seed)
            for _ in range(n_calls):
                out = self.model.generate(prompt, attention_mask=torch.ones_like(prompt), **kwargs)
                outputs.extend(self._to_outputs(out, len(input_ids), params, stops, flag))
        return outputs

    def _to_outputs(self, out, prompt_len: int, params: SamplingParams, stops, flag):
        temp = params.temperature if params.temperature > 0 else 1.0
        if out.logits:
            logits = torch.stack(out.logits, dim=1).float() / temp  # (n, G, V)
            gen = out.sequences[:, prompt_len:]  # (n, G)
            lps = torch.log_softmax(logits, -1).gather(2, gen[..., None]).squeeze(-1)
        else:
            gen = out.sequences[:, prompt_len:]
            lps = torch.zeros(gen.shape)
        checker = StopChecker(self.tokenizer, params.stop)
        results = []
        for ids, lp in zip(gen.tolist(), lps.tolist(), strict=True):
            end, reason = _cut(ids, set(stops), checker, len(ids) == params.max_new_tokens)
            if flag.set and reason == "length":
                reason = "abort"
            ids, lp = ids[:end], lp[:end]
            versions = [self._version] * len(ids)
            text = decode_all(self.tokenizer, [ids])[0]
            results.append(make_output(text, ids, lp, versions, reason, params.stop))
        return results

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        state = state_dict_from_meta(meta)
        with self._lock:
            load_weights_into(self.model, state)
            self._version = meta.version

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    def abort(self, rid: str | None = None) -> None:
        for key, flag in list(self._aborts.items()):
            if rid is None or key == rid:
                flag.set = True

    def health(self) -> bool:
        return True

    def shutdown(self) -> None:
        self.abort()
        self.resume()


def _cut(ids: list[int], stops: set[int], checker: StopChecker, full: bool) -> tuple[int, str]:
    """Length of a sample up to its first stop (inclusive) and its finish reason."""
    for i, tok in enumerate(ids):
        if tok in stops:
            return i + 1, "stop"
        if checker.stop and checker.find(ids[: i + 1]) >= 0:
            return i + 1, "stop"
    return len(ids), "length"
