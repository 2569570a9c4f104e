"""AReaL-lite's `TrainEngine`, `Actor` and `Critic` (seed 004) over nexrl's engines.

`TrainEngine` wraps the built-in `TorchTrainEngine` (a causal LM: `Actor`) or a
`ValueEngine` (a value model: `Critic`) and gives the seed's calls:

- `train_batch(input_, loss_fn, loss_weight_fn)`: `loss_fn(output, mb)` is any
  callable on the model's output of a micro-batch ((b, T, V) logits for the
  actor, (b, T) values for the critic); micro-batch losses are weighted by
  `loss_weight_fn(mb)` / their sum, so the gradient is the whole batch's. One
  optimizer step; the LR schedule moves only on `step_lr_scheduler()` (PPO
  calls `train_batch` several times per schedule step). A *string* `loss_fn`
  is a name in nexrl's loss registry and goes to the engine's own
  `train_batch` (with `loss_weight_fn` as its keyword arguments), which also
  steps the schedule.
- `forward`, `eval_batch` (no gradient), `upload_weights` (a `disk` or
  `memory` `WeightUpdateMeta` for `InferenceEngine.update_weights`),
  `save` / `load(SaveLoadMeta)`, `get_scheduling_config`, `destroy`.

Inputs are dicts of right-padded (B, T) tensors (`input_ids`, `attention_mask`,
`loss_mask`, ...); the AReaL `DistributedBatch` of a rollout is one.
"""

from __future__ import annotations

import gc
import os
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch

from nexrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nexrl.algorithms.objective import compute_loss
from nexrl.areal.engine import UPLOAD_DONE, WeightUpdateFuture, config_option
from nexrl.areal.types import FinetuneSpec, SaveLoadMeta, WeightUpdateMeta
from nexrl.training import checkpoint
from nexrl.training.critic import ValueEngine, gae, value_loss
from nexrl.training.microbatch import split_by_tokens
from nexrl.types import Batch

TensorDict = dict[str, torch.Tensor]
"""AReaL's batch: named tensors, batch on dim 0 (`input_ids`, `attention_mask`, `loss_mask`)."""
LossFn = Callable[[torch.Tensor, TensorDict], torch.Tensor]
WeightFn = Callable[[TensorDict], float]


def token_count(mb: TensorDict) -> float:
    """The usual `loss_weight_fn`: the micro-batch's loss tokens."""
    return float(mb["loss_mask"].sum())


class TrainEngine:
    """The seed's train engine.

    config: mapping or attribute object with `path` (model directory; None: the embedded
        tiny model), `engine` (nexrl's `EngineConfig` options: lr, micro_batch_tokens,
        grad_clip, lr_schedule, ...), and for PPO `ppo_n_minibatches` (default 1),
        `loss_fn` / `loss_kwargs` (actor; default `ppo_clip`), `value_clip` (critic, 0.2),
        `adv_estimator` (actor without values; default `grpo`), `gamma` / `lam` (GAE, 1.0).
    """

    kind = "actor"

    def __init__(self, config: object = None) -> None:
        self.config = config
        self.engine: Any = None

    def _opt(self, key: str, default: Any = None) -> Any:
        return config_option(self.config, key, default)

    # -- control ----------------------------------------------------------------------
    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None) -> None:
        """Load the model and build the optimizer. `ft_spec` sets the schedule's length
        (`total_steps`) when the options leave it unset; `addr` (a remote trainer) is not
        supported by the in-process engine."""
        if addr is not None:
            raise ValueError(
                f"TrainEngine.initialize(addr={addr!r}): the in-process engine takes no address; "
                "nexrl's remote trainer is service.train_service.backend=remote"
            )
        options = dict(self._opt("engine", {}))
        if ft_spec is not None and options.get("total_steps") is None:
            options["total_steps"] = ft_spec.total_train_steps
        path = self._opt("path")
        if path is None:
            from nexrl.models.tiny import default_model_path

            path = str(default_model_path())
        if self.kind == "critic":
            self.engine = ValueEngine(options, path)
        else:
            from nexrl.training.torch_engine import TorchTrainEngine

            self.engine = TorchTrainEngine(options, path)

    @property
    def model(self) -> torch.nn.Module:
        if self.engine is None:
            raise RuntimeError(f"{type(self).__name__}: call initialize() first")
        return self.engine.model

    def get_scheduling_config(self) -> dict[str, object]:
        """What a scheduler must give this engine: devices, CPUs and memory (GiB)."""
        params = sum(p.numel() for p in self.model.parameters())
        gpu = self.engine.device.type == "cuda"
        return {
            "gpu": 1 if gpu else 0,
            "cpu": os.cpu_count() or 1,
            "mem_gib": round(params * 16 / 2**30, 3),  # fp32 weights, grads, Adam moments
            "device": self.engine.device.type,
            "image": None,
        }

    def destroy(self) -> None:
        """Drop the model and optimizer and release their memory."""
        self.engine = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    # -- data -------------------------------------------------------------------------
    def _micro_batches(self, input_: TensorDict) -> list[TensorDict]:
        mask = input_["attention_mask"]
        n = mask.shape[0]
        groups = split_by_tokens(mask, self.engine.config.micro_batch_tokens)
        return [
            {
                k: (v[rows] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == n else v)
                for k, v in input_.items()
            }
            for rows in groups
        ]

    def _output(self, mb: TensorDict) -> torch.Tensor:
        ids, mask = mb["input_ids"], mb["attention_mask"]
        if self.kind == "critic":
            return self.engine.values(ids, mask)
        dev = self.engine.device
        return self.model(
            input_ids=ids.to(dev), attention_mask=mask.to(dev), use_cache=False
        ).logits

    def train_batch(
        self,
        input_: TensorDict,
        loss_fn: LossFn | str,
        loss_weight_fn: WeightFn | Mapping[str, object] | None = None,
    ) -> dict[str, float]:
        """One optimizer step on `input_` (see the module docstring for the two forms)."""
        if isinstance(loss_fn, str):
            if self.kind == "critic":
                raise ValueError("a Critic's loss_fn must be a callable (e.g. value_loss)")
            if callable(loss_weight_fn):
                raise TypeError(
                    f"train_batch(loss_fn={loss_fn!r}): with a registered loss name the third "
                    "argument is the loss's keyword arguments (a dict), not a weight function"
                )
            batch = Batch(values=dict(input_), metadata={})
            return self.engine.train_batch(batch, loss_fn, dict(loss_weight_fn or {}))
        weight_fn = loss_weight_fn if callable(loss_weight_fn) else token_count
        self.model.train()
        self.engine.optimizer.zero_grad(set_to_none=True)
        mbs = self._micro_batches(input_)
        weights = [float(weight_fn(mb)) for mb in mbs]
        total = sum(weights) or 1.0
        loss_sum = 0.0
        for mb, w in zip(mbs, weights, strict=True):
            loss = loss_fn(self._output(mb), mb)
            (loss * (w / total)).backward()
            loss_sum += float(loss.detach()) * w / total
        clip = self.engine.config.grad_clip
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), clip if clip > 0 else 1e30)
        lr = self.engine.optimizer.param_groups[0]["lr"]
        self.engine.optimizer.step()
        self.engine._step += 1
        return {"loss": loss_sum, "grad_norm": float(norm), "lr": float(lr)}

    @torch.no_grad()
    def eval_batch(
        self, input_: TensorDict, loss_fn: LossFn, loss_weight_fn: WeightFn | None = None
    ) -> torch.Tensor | None:
        """The batch's weighted loss without a gradient (None for an empty batch)."""
        weight_fn = loss_weight_fn or token_count
        mbs = self._micro_batches(input_)
        weights = [float(weight_fn(mb)) for mb in mbs]
        if not mbs or not sum(weights):
            return None
        self.model.eval()
        losses = [
            loss_fn(self._output(mb), mb).float().cpu() * w
            for mb, w in zip(mbs, weights, strict=True)
        ]
        return torch.stack(losses).sum() / sum(weights)

    @torch.no_grad()
    def forward(
        self,
        input_: TensorDict,
        output_seqlens: list[list[int]] | None = None,
        post_hook: Callable[[torch.Tensor, TensorDict], Any] | None = None,
        aggregate_fn: Callable[[list[Any]], Any] = torch.cat,
    ) -> Any | None:
        """The model's output per micro-batch (after `post_hook(output, mb)`), joined by
        `aggregate_fn`. Inputs are padded (B, T) here, so `output_seqlens` (AReaL's
        packed layout) must be None."""
        if output_seqlens is not None:
            raise ValueError("forward: output_seqlens is for packed inputs; nexrl pads (B, T)")
        self.model.eval()
        outs = []
        for mb in self._micro_batches(input_):
            out = self._output(mb)
            outs.append(post_hook(out, mb) if post_hook else out)
        return aggregate_fn(outs) if outs else None

    def step_lr_scheduler(self) -> None:
        self.engine.scheduler.step()

    # -- weights ----------------------------------------------------------------------
    def upload_weights(self, meta: WeightUpdateMeta) -> WeightUpdateFuture:
        """Hand the weights to the inference side: `disk` writes an HF directory at
        `meta.path` then the marker `InferenceEngine.update_weights` waits for; `memory`
        puts the state dict on `meta.state_dict`. The work is done on return; the
        finished future it returns lets the seed's `await actor.upload_weights(meta)` and
        its plain call `actor.upload_weights(meta)` both work."""
        if meta.type == "memory":
            meta.state_dict = self.engine.export_weights()
        else:
            self.engine.export_weights(str(meta.path))
            version = meta.version if meta.version is not None else self.engine.step
            (Path(str(meta.path)) / UPLOAD_DONE).write_text(str(version))
        done = WeightUpdateFuture()
        done.set_result(None)
        return done

    def save(self, meta: SaveLoadMeta | str) -> None:
        """HF weights (+ tokenizer); `with_optim` also optimizer, schedule, RNG and step."""
        meta = meta if isinstance(meta, SaveLoadMeta) else SaveLoadMeta(meta, with_optim=True)
        if meta.with_optim or self.kind == "critic":
            self.engine.save(meta.path)
        else:
            self.engine.export_weights(meta.path)
        if meta.tokenizer is not None:
            meta.tokenizer.save_pretrained(meta.path)
        if meta.base_model_path is not None:
            for name in ("config.json", "generation_config.json"):
                src = Path(meta.base_model_path) / name
                if src.exists():
                    (Path(meta.path) / name).write_bytes(src.read_bytes())

    def load(self, meta: SaveLoadMeta | str) -> None:
        """Weights from an HF directory; optimizer state too when it holds one and
        `with_optim` is set."""
        meta = meta if isinstance(meta, SaveLoadMeta) else SaveLoadMeta(meta, with_optim=True)
        if meta.with_optim:
            self.engine.load(meta.path)
            return
        state = checkpoint.read_hf_weights(Path(meta.path))
        self.model.load_state_dict(state, strict=False)


def _padded(input_: TensorDict) -> Batch:
    return Batch(values=dict(input_), metadata={})


class Actor(TrainEngine):
    """The PPO/GRPO policy: logprobs, advantages and the clipped update."""

    kind = "actor"

    @torch.no_grad()
    def compute_logps(self, input_: TensorDict) -> torch.Tensor:
        """(B, T) logprob of each token under the current weights (0 at t = 0)."""
        return self.engine.compute_logprobs(_padded(input_))

    compute_logp = compute_logps  # the name the seed's training script calls

    def compute_advantages_and_returns(self, input_: TensorDict) -> dict[str, torch.Tensor]:
        """GAE when `input_` has critic `values`, else the group estimator `adv_estimator`
        over `rewards` (B,) with `group_index` (B,) (default: one group)."""
        mask = input_["loss_mask"].float()
        rewards = input_["rewards"].float()
        if "values" in input_:
            adv, ret = gae(
                rewards,
                input_["values"].float(),
                mask,
                self._opt("gamma", 1.0),
                self._opt("lam", 1.0),
            )
            return {"advantages": adv, "returns": ret}
        groups = input_.get("group_index", torch.zeros(len(rewards), dtype=torch.long))
        estimator = ADVANTAGE_ESTIMATORS.get(self._opt("adv_estimator", "grpo"))
        adv = estimator(rewards, groups, mask)
        return {"advantages": adv, "returns": rewards[:, None] * mask}

    def _loss(self, logits: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        ids = mb["input_ids"].to(logits.device)
        pred = logits[:, :-1].float()
        picked = pred.gather(-1, ids[:, 1:, None]).squeeze(-1) - torch.logsumexp(pred, -1)
        logps = torch.nn.functional.pad(picked, (1, 0))
        batch = {k: v.to(logits.device) for k, v in mb.items() if isinstance(v, torch.Tensor)}
        if "ref_logp" in batch:  # the seed's key for the reference logprobs
            batch.setdefault("ref_logprobs", batch.pop("ref_logp"))
        if "old_logprobs" not in batch:
            batch["old_logprobs"] = batch.get("logprobs", logps.detach())
        loss, _ = compute_loss(
            logps, batch, self._opt("loss_fn", "ppo_clip"), **dict(self._opt("loss_kwargs", {}))
        )
        return loss

    def ppo_update(self, input_: TensorDict) -> list[dict[str, float]]:
        """One optimizer step per mini-batch (`ppo_n_minibatches` slices of the rows)."""
        return [
            self.train_batch(mb, loss_fn=self._loss, loss_weight_fn=token_count)
            for mb in _minibatches(input_, int(self._opt("ppo_n_minibatches", 1)))
        ]


class Critic(TrainEngine):
    """The PPO value model: `compute_values` and the clipped value-loss update."""

    kind = "critic"

    @torch.no_grad()
    def compute_values(self, input_: TensorDict) -> torch.Tensor:
        """(B, T) values (the state before each token)."""
        values = self.forward(input_)
        if values is None:
            raise ValueError("compute_values: the batch has no rows")
        return values

    def _loss(self, values: torch.Tensor, mb: TensorDict) -> torch.Tensor:
        batch = {k: v.to(values.device) for k, v in mb.items() if isinstance(v, torch.Tensor)}
        return value_loss(values, batch, self._opt("value_clip", 0.2))

    def ppo_update(self, input_: TensorDict) -> list[dict[str, float]]:
        """Fit `returns` (from `Actor.compute_advantages_and_returns`), one step per
        mini-batch."""
        return [
            self.train_batch(mb, loss_fn=self._loss, loss_weight_fn=token_count)
            for mb in _minibatches(input_, int(self._opt("ppo_n_minibatches", 1)))
        ]


def _minibatches(input_: TensorDict, n: int) -> list[TensorDict]:
    rows = input_["input_ids"].shape[0]
    if n < 1 or n > rows:
        raise ValueError(f"ppo_n_minibatches={n} must be between 1 and the batch's {rows} rows")
    chunks = torch.arange(rows).chunk(n)
    return [
        {
            k: (v[idx] if isinstance(v, torch.Tensor) and v.dim() and v.shape[0] == rows else v)
            for k, v in input_.items()
        }
        for idx in chunks
    ]
