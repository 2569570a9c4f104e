"""The built-in `TrainEngine`: a Hugging Face causal LM trained with plain torch.

Algorithm-blind: `train_batch` receives token-level tensors (layout in
`nexrl.types`) and the name of a loss that `nexrl.algorithms.objective.compute_loss`
resolves. What the engine owns is the machinery: micro-batches by token
budget with padding-free packing (`microbatch.py`), gradient accumulation with
*global* normalisers so that accumulation and data parallelism (`parallel.py`)
give the gradient of one big batch, clipping, AdamW, LR schedules from
`transformers.get_scheduler`, and exact checkpoints (`checkpoint.py`).

Simplifications: master weights and optimizer state are always float32;
"bf16" means autocast. Pipeline / tensor parallelism are out of scope.
"""

from __future__ import annotations

import contextlib
import logging
import time
import warnings
from collections import defaultdict
from typing import Any

import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from nexrl.algorithms.objective import compute_loss
from nexrl.host_memory import release_freed_memory, release_wanted
from nexrl.inference.weights import join_projections
from nexrl.models.lora import apply_lora, is_peft, load_lora_checkpoint, merged_state_dict
from nexrl.models.sources import resolve_model
from nexrl.models.threads import threads_for, use_threads
from nexrl.training import checkpoint
from nexrl.training.config import EngineConfig
from nexrl.training.masks import dense_masks_apply, model_attention_mask
from nexrl.training.microbatch import (
    accumulate_metrics,
    all_reduce_max,
    chunked_token_logprobs,
    make_inputs,
    reduce_metrics,
    split_by_tokens,
    token_logprobs,
)
from nexrl.training.model_parts import (
    can_chunk,
    checkpointing_on,
    own_memory,
    pick_device,
    seed_everything,
    unwrap,
    without_head,
)
from nexrl.training.optim import grads_in_one_block, make_adamw, make_scheduler
from nexrl.training.parallel import all_reduce_sum, init_from_env, wrap_model
from nexrl.training.shared_prefix import (
    plan_prefixes,
    shared_prefix_logprobs,
    supports_prefix_cache,
)
from nexrl.types import Batch

logger = logging.getLogger(__name__)

TRAIN_KEYS = ("input_ids", "attention_mask", "loss_mask")
GPU_SHARED_PREFIX_FLOPS = 2e12
"""On a GPU, auto `shared_prefix` needs to save this much forward + backward arithmetic
(6 x parameters x tokens saved): about what launching a second forward and backward
costs a small model there (a few milliseconds)."""
GPU_AUTOCAST_FLOPS = 1e11
"""On a GPU, `dtype: auto` autocasts a micro-batch to bfloat16 only when its forward +
backward arithmetic (6 x parameters x tokens) reaches this. Below it the products are a
small part of the step and the casts cost more in launches than bfloat16 saves: the
3-layer tiny model's update took 25 ms in float32 and 30 ms autocast on an H200."""


class TorchTrainEngine:
    """One rank of the torch engine (SPMD: with WORLD_SIZE > 1, build one per rank)."""

    def __init__(
        self,
        config: EngineConfig | dict[str, Any],
        model_path: str,
        model: torch.nn.Module | None = None,
    ) -> None:
        """`model`: an HF causal LM already built in float32 (a benchmark's randomly
        initialised geometry) instead of loading `model_path` (then only its name)."""
        self.config = EngineConfig.from_mapping(config)
        # a local directory even for a Hub id or a GGUF file, so checkpoints copy its tokenizer
        self.model_path = model_path if model is not None else str(resolve_model(model_path))
        self.device = pick_device()
        self.rank, self.world_size = init_from_env(self.device)
        seed_everything(self.config.seed, self.config.deterministic)
        self.packing = self.config.packing_enabled()
        if model is None:
            self.model = self._load_model(self.model_path, trainable=True)
        else:
            self.model = self._prepare(model.to(self.device), trainable=True)
        if self.config.lora is not None:
            self.model = apply_lora(self.model, self.config.lora)
        elif self.world_size == 1 and self.device.type == "cpu":
            own_memory(self.model)  # no page of the checkpoint file stays mapped
            join_projections(self.model)  # an engine sharing these tensors copies none of them
        self.train_module = wrap_model(self.model, self.config.dp_strategy, self.device)
        self._n_params = sum(p.numel() for p in self.model.parameters())
        self._release_s = 0.0  # this step's seconds in `_release`
        self._threads = threads_for(self.model, self.config.threads, "train_worker.engine.threads")
        self.optimizer = make_adamw(
            [p for p in self.model.parameters() if p.requires_grad],
            lr=self.config.lr,
            betas=self.config.betas,
            eps=self.config.eps,
            weight_decay=self.config.weight_decay,
        )
        self.scheduler = make_scheduler(self.optimizer, self.config)
        self.ref_model = None
        if self.config.ref_model_path:
            ref_path = str(resolve_model(self.config.ref_model_path))
            self.ref_model = self._load_model(ref_path, trainable=False)
        self._step = 0
        self._model_tokens = 0  # real tokens through the model (the shared prefix counts once)
        self._warned_shared_prefix = False

    @property
    def step(self) -> int:
        return self._step

    # ---------------------------------------------------------------- forward

    @torch.no_grad()
    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, T) float32 CPU logprob of each token under the current weights."""
        return self._no_grad_pass(self.model, batch, entropy=False)[0]

    @torch.no_grad()
    def compute_entropy(self, batch: Batch) -> torch.Tensor:
        """(B, T) entropy of the distribution that predicted each token (0 at t = 0)."""
        return self._no_grad_pass(self.model, batch, entropy=True)[1]

    @torch.no_grad()
    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """(B, T) logprobs under the frozen reference model; None when none is configured."""
        if self.ref_model is None:
            return None
        return self._no_grad_pass(self.ref_model, batch, entropy=False)[0]

    def _no_grad_pass(self, model, batch: Batch, entropy: bool):
        use_threads(self._threads)
        values = _tensors(batch, ("input_ids", "attention_mask"), self.device)
        if self.config.logprob_positions == "response" and "loss_mask" not in values:
            raise KeyError("logprob_positions='response' needs the batch field 'loss_mask'")
        shape = values["input_ids"].shape
        lp_out = torch.zeros(shape, dtype=torch.float32)
        ent_out = torch.zeros(shape, dtype=torch.float32) if entropy else None
        was_training = model.training
        model.eval()
        for rows, weight in self._micro_batches(values["attention_mask"]):
            mb = {k: v[rows] for k, v in values.items()}
            lp, ent = self._logprobs(model, mb, entropy)
            if not weight:
                continue
            lp_out[rows] = lp.cpu()
            if ent_out is not None:
                ent_out[rows] = ent.cpu()
        model.train(was_training)
        return lp_out, ent_out

    def _logprobs(self, module, mb: dict[str, torch.Tensor], entropy: bool, select=None):
        """(b, T) logprobs (and entropy) of micro-batch `mb`; `select`: positions wanted.

        With `logprob_chunk_tokens` > 0 the model runs without its output projection and
        `chunked_token_logprobs` projects only the wanted positions, a chunk at a time.
        Rows sharing a prompt may run it once (`shared_prefix`, see `shared_prefix.py`).
        """
        inputs = make_inputs(mb["input_ids"], mb["attention_mask"], self.packing)
        if select is None and self.config.logprob_positions == "response":
            select = mb.get("loss_mask")
        tokens = int(mb["attention_mask"].sum())
        dtype = self.autocast_dtype(tokens)
        autocast = (
            torch.autocast(self.device.type, dtype=dtype)
            if dtype is not None
            else contextlib.nullcontext()
        )
        hf_model = unwrap(module)
        plan = self._shared_prefix_plan(hf_model, mb, select)
        if plan is not None:
            self._model_tokens += plan.model_tokens
            with autocast, without_head(hf_model) as head:
                return shared_prefix_logprobs(
                    module,
                    head,
                    mb["input_ids"],
                    plan,
                    entropy,
                    self.config.logprob_chunk_tokens,
                    dense_masks=dense_masks_apply(hf_model),
                )
        self._model_tokens += tokens
        chunked = self.config.logprob_chunk_tokens > 0 and can_chunk(hf_model, self.config)
        with autocast, without_head(hf_model) if chunked else contextlib.nullcontext() as head:
            mask = inputs.attention_mask
            if mask is not None:  # padded, not packed
                mask = model_attention_mask(mask, mask.shape[1], dense_masks_apply(hf_model))
            out = module(
                input_ids=inputs.input_ids,
                attention_mask=mask,
                position_ids=inputs.position_ids,
                use_cache=False,
            ).logits
            if head is not None:  # chunked
                return chunked_token_logprobs(
                    out, head, inputs, select, entropy, self.config.logprob_chunk_tokens
                )
        return token_logprobs(out, inputs, with_entropy=entropy)

    def autocast_dtype(self, tokens: int) -> torch.dtype | None:
        """The autocast dtype of a micro-batch of `tokens` real tokens (None: float32)."""
        return autocast_for(self.config.dtype, self.device, 6 * self._n_params * tokens)

    def _shared_prefix_plan(self, hf_model, mb: dict[str, torch.Tensor], select):
        """The shared-prefix plan of `mb`, or None for the plain forward."""
        if select is None or not self._shared_prefix_allowed(hf_model):
            return None
        # on a CPU only (two suffix forwards by length, or one per prefix): unmeasured on
        # an accelerator, where a second forward's launches can cost more than it saves
        on_cpu = self.device.type == "cpu"
        grouped = on_cpu and dense_masks_apply(hf_model)  # a grouped plan needs 4D masks
        plan = plan_prefixes(mb["input_ids"], mb["attention_mask"], select, on_cpu, grouped)
        if plan is not None and self.config.shared_prefix is None:
            # auto: only when it computes fewer (padded) tokens than the plain forward; on
            # an accelerator, only when that saves more arithmetic than its second forward
            # costs in launches (a small model's forward is launch-bound there)
            saved = int(mb["attention_mask"].any(0).sum()) * mb["attention_mask"].shape[0]
            saved -= plan.padded_tokens
            if not on_cpu:
                return plan if 6 * self._n_params * saved >= GPU_SHARED_PREFIX_FLOPS else None
            return plan if saved > 0 else None
        return plan

    def _shared_prefix_allowed(self, hf_model: PreTrainedModel) -> bool:
        """Where the shared-prefix forward is exact and safe (`EngineConfig.shared_prefix`):
        one rank (a DDP / FSDP module must run once per backward), padded micro-batches,
        a detachable linear head, a model that takes a full-attention KV cache, and no
        gradient checkpointing in training (HF turns the cache off there)."""
        if self.config.shared_prefix is False:
            return False
        reason = None
        if self.world_size > 1 or self.packing:
            reason = "it needs one rank and padded (not packed) micro-batches"
        elif not can_chunk(hf_model, self.config) or not supports_prefix_cache(hf_model):
            reason = "the model needs a plain linear head and a full-attention KV cache"
        elif hf_model.training and checkpointing_on(hf_model):
            reason = "gradient checkpointing disables the KV cache in training"
        if reason and not self._warned_shared_prefix:
            self._warned_shared_prefix = True
            if self.config.shared_prefix:
                warnings.warn(f"shared_prefix=True: plain forward, {reason}", stacklevel=3)
            else:
                logger.info("shared_prefix (auto): plain forward, %s", reason)
        return reason is None

    # ---------------------------------------------------------------- training

    fills_old_logprobs = True
    """`train_batch` without `old_logprobs` uses this forward's (one update per batch)."""

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: dict[str, Any] | None = None
    ) -> dict[str, float]:
        """One optimizer step on this rank's `batch` with the registered loss `loss_fn`.

        `loss_kwargs` go to `compute_loss` (agg_mode, clip ranges, entropy_coef, ...).
        Returns loss, grad_norm, lr, tokens, loss_tokens, num_seqs, model_tokens (real
        tokens through the model: fewer than `tokens` with a shared prefix) and the loss's
        metrics.
        """
        use_threads(self._threads)
        loss_kwargs = dict(loss_kwargs or {})
        values = _tensors(batch, TRAIN_KEYS, self.device)
        mask = values["loss_mask"].float()
        totals = all_reduce_sum(
            torch.stack(
                [
                    mask.sum(),
                    (mask.sum(-1) > 0).sum().float(),
                    values["attention_mask"].sum().float(),
                ]
            )
        )
        micro = self._micro_batches(values["attention_mask"])
        want_entropy = self.config.entropy or bool(loss_kwargs.get("entropy_coef"))
        self.model.train()
        self._zero_grads()
        sums: dict[str, float] = defaultdict(float)
        self._model_tokens = 0
        for k, (rows, weight) in enumerate(micro):
            mb = {name: v[rows] for name, v in values.items()}
            with self._sync_context(last=k == len(micro) - 1):
                # only the loss's positions need a logprob (the loss masks the rest)
                lp, ent = self._logprobs(self.train_module, mb, want_entropy, mb["loss_mask"])
                filled = fill_old_logprobs(mb, lp)
                loss, metrics = compute_loss(
                    lp,
                    mb,
                    loss_fn=loss_fn,
                    entropy=ent,
                    num_tokens=totals[0],
                    num_seqs=totals[1],
                    **loss_kwargs,
                )
                (loss * (weight * self.world_size)).backward()
            metrics = {**metrics, **filled}
            if weight:
                accumulate_metrics(sums, loss, metrics, float(mb["loss_mask"].sum()))
        sums["model_tokens"] = float(self._model_tokens)
        return self._finish_step(sums, totals)

    def _releases_memory(self) -> bool:
        return release_wanted(self.config.release_host_memory, self.device.type, self._n_params)

    def _release(self) -> None:
        """Hand freed host memory back to the OS (after each update where `_releases_memory`;
        nexrl/host_memory.py: why, and the switch); its seconds are the step's `release_s`
        metric. After each micro-batch too it cost SmolLM2's recipe 5-7 s a step (3%) for
        0.03 GiB less peak RSS: not kept."""
        if self._releases_memory():
            start = time.perf_counter()
            release_freed_memory()
            self._release_s += time.perf_counter() - start

    def _zero_grads(self) -> None:
        """No gradients, or (one rank, releasing host memory) zeros in one block that the
        update frees as a whole (`grads_in_one_block`)."""
        self.optimizer.zero_grad(set_to_none=True)
        if self.world_size == 1 and self._releases_memory():
            grads_in_one_block([p for p in self.model.parameters() if p.requires_grad])

    def _micro_batches(self, attention_mask: torch.Tensor) -> list[tuple[list[int], float]]:
        """(rows, weight) per micro-batch. Every rank runs the same number of forwards
        (FSDP2 / DDP collectives must pair up): a rank with fewer pads with weight-0
        repeats of its first row."""
        groups = split_by_tokens(attention_mask, self.config.micro_batch_tokens)
        if not groups:
            raise ValueError("empty batch: a data-parallel rank needs at least one row")
        n = all_reduce_max(len(groups), self.device)
        return [(g, 1.0) for g in groups] + [(groups[0][:1], 0.0)] * (n - len(groups))

    def _finish_step(self, sums: dict[str, float], totals: torch.Tensor) -> dict[str, float]:
        clip = self.config.grad_clip if self.config.grad_clip > 0 else float("inf")
        grad_norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip)
        if hasattr(grad_norm, "full_tensor"):
            grad_norm = grad_norm.full_tensor()
        lr = self.scheduler.get_last_lr()[0]
        self.optimizer.step()
        self.scheduler.step()
        self._step += 1
        if self._releases_memory():
            self.optimizer.zero_grad(set_to_none=True)  # the gradients' block is unmapped
        self._release()
        metrics = reduce_metrics(sums, float(totals[0]), totals.device)
        if self._releases_memory():
            metrics["release_s"], self._release_s = self._release_s, 0.0
        metrics.update(
            grad_norm=float(grad_norm),
            lr=float(lr),
            tokens=float(totals[2]),
            loss_tokens=float(totals[0]),
            num_seqs=float(totals[1]),
            step=float(self._step),
        )
        return metrics

    def _sync_context(self, last: bool):
        no_sync = getattr(self.train_module, "no_sync", None)
        if no_sync is not None and not last:
            return no_sync()
        set_sync = getattr(self.train_module, "set_requires_gradient_sync", None)
        if set_sync is not None:
            set_sync(last)
        return contextlib.nullcontext()

    # ---------------------------------------------------------------- weights

    def save(self, path: str) -> None:
        """HF safetensors weights + tokenizer + optimizer/scheduler/RNG/step under `path`.

        With LoRA the weights are the adapter (`adapter_model.safetensors`, peft format;
        the frozen base is `model_path`).
        """
        checkpoint.save(self, path)

    def load(self, path: str) -> None:
        """Restore weights, optimizer, scheduler, RNG and step written by `save`."""
        if is_peft(self.model):
            load_lora_checkpoint(self, path)
        else:
            checkpoint.load(self, path)

    def export_weights(
        self, path: str | None = None, copy: bool = True
    ) -> dict[str, torch.Tensor] | str:
        """Full state dict as CPU tensors, or an HF directory written at `path` (returned).

        With LoRA: the base weights with the adapters merged in, under the base names.
        `copy=False` (no `path`): the model's own tensors where it has them, for a caller
        that copies them before the next step.
        """
        if is_peft(self.model):
            state = merged_state_dict(self.model)
            target: checkpoint.HFExportTarget = checkpoint.HFFolderSource(
                rank=self.rank, model=unwrap(self.model), model_path=self.model_path
            )
        else:
            state, target = checkpoint.full_model_state(self.model, copy or path is not None), self
        if path is None:
            return state
        checkpoint.write_hf(target, path, state)
        return path

    def _load_model(self, path: str, trainable: bool) -> torch.nn.Module:
        kwargs = dict(self.config.extra)
        if self.config.attn_implementation:
            kwargs["attn_implementation"] = self.config.attn_implementation
        model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, **kwargs)
        # transformers 4 types `to` through a decorator that loses its signature
        return self._prepare(model.to(self.device), trainable)  # type: ignore[arg-type, unused-ignore]

    def _prepare(self, model: torch.nn.Module, trainable: bool) -> torch.nn.Module:
        if trainable and self.config.gradient_checkpointing:
            # non-reentrant: gradients also reach adapters behind frozen embeddings (LoRA)
            hf_model = unwrap(model)
            enable = getattr(hf_model, "activation_checkpointing_enable", None)  # transformers 5
            (enable or hf_model.gradient_checkpointing_enable)({"use_reentrant": False})
            hf_model.config.use_cache = False
        if not trainable:
            model.eval().requires_grad_(False)
        return model


def _tensors(batch: Batch, required: tuple[str, ...], device: torch.device):
    """Tensor values of `batch` on `device`, checking required keys and (B, T) shapes."""
    values = {k: v for k, v in batch.values.items() if isinstance(v, torch.Tensor)}
    missing = [k for k in required if k not in values]
    if missing:
        raise KeyError(f"batch lacks tensor field(s) {missing}; it has {sorted(values)}")
    shape = values["input_ids"].shape
    for k, v in values.items():
        if v.dim() == 2 and v.shape != shape:
            raise ValueError(
                f"batch field {k!r} has shape {tuple(v.shape)}, input_ids has {tuple(shape)}"
            )
    return {k: v.to(device) for k, v in values.items() if v.dim() >= 1 and v.shape[0] == shape[0]}


def fill_old_logprobs(mb: dict[str, torch.Tensor], lp: torch.Tensor) -> dict[str, torch.Tensor]:
    """One update per batch (the train worker sends no `old_logprobs`): the old policy IS
    the current one, so old = this forward's logprobs, detached (ratio 1, as verl and TRL
    do), saving a forward pass. Returns the engine-vs-trainer gap metric it replaces."""
    if "old_logprobs" in mb:
        return {}
    mb["old_logprobs"] = lp.detach()
    if "behavior_logprobs" not in mb:
        return {}
    mask = mb["loss_mask"].float()
    gap = ((lp.detach() - mb["behavior_logprobs"]).abs() * mask).sum() / mask.sum().clamp(min=1)
    return {"behavior_old_logprob_absdiff": gap}


def autocast_for(name: str, device: torch.device, flops: float) -> torch.dtype | None:
    """The autocast dtype of a micro-batch of `flops` forward + backward arithmetic under
    `EngineConfig.dtype` `name` (None: float32). "auto" is bfloat16 on a GPU from
    `GPU_AUTOCAST_FLOPS` on, float32 below it and on a CPU."""
    if name == "auto":
        return torch.bfloat16 if device.type == "cuda" and flops >= GPU_AUTOCAST_FLOPS else None
    return None if name == "float32" else getattr(torch, name)
