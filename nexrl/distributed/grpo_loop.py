"""Seed 002's single-controller GRPO loop (NeMo RL's names), as runnable code.

One process drives three RL actors through small interfaces and writes the main loop
as though everything ran on one device:

- `PolicyInterface` (`Policy`): logprobs, reference logprobs and the update, on any
  nexrl train client: the in-process engine by default, or `RayDataParallelTrainClient`
  (a `RayWorkerGroup` of data-parallel ranks on a `RayVirtualCluster`);
- `GenerationInterface` (`Generation`): nexrl's built-in inference engine; its weights
  follow the policy's after every update (`update_weights`);
- `EnvironmentInterface` (`RewardEnvironment`): a nexrl reward function per sample.

Data moves as `BatchedDataDict` (named columns of one length); `DatumSpec` is a row.
`calculate_grpo_training_data` turns generations, logprobs and rewards into the train
batch with nexrl's GRPO advantages; `GRPOLossFn` names nexrl's clipped PPO loss (with a
KL term to the reference when `kl_coef` > 0). `grpo_train` is the seed's loop plus
the steps it omits (the weight update of the generator, metrics). docs/nemo_rl.md.
"""

from __future__ import annotations

import dataclasses
import statistics
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, TypedDict

import torch

from nexrl.algorithms.advantages import ADVANTAGE_ESTIMATORS
from nexrl.algorithms.processor import collate_columns
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.sampler import encode_text
from nexrl.training.config import EngineConfig
from nexrl.types import Batch

if TYPE_CHECKING:
    from nexrl.training.client import TrainServiceClient

__all__ = [
    "BatchedDataDict",
    "DatumSpec",
    "EnvironmentInterface",
    "GRPOLossFn",
    "Generation",
    "GenerationInterface",
    "Policy",
    "PolicyInterface",
    "RewardEnvironment",
    "batches",
    "calculate_grpo_training_data",
    "grpo_train",
]

GENERATION_KEYS = ("prompt_ids", "response_ids", "response_logprobs")


class DatumSpec(TypedDict, total=False):
    """One row: the prompt text, and any columns the reward reads (e.g. `answer`)."""

    prompt: str
    answer: str
    idx: int


class BatchedDataDict(dict[str, Any]):
    """Named columns of one length (lists or tensors whose first dimension is the row)."""

    @classmethod
    def from_rows(cls, rows: Sequence[Mapping[str, object]]) -> BatchedDataDict:
        keys = list(rows[0]) if rows else []
        missing = [(i, k) for i, r in enumerate(rows) for k in keys if k not in r]
        if missing:
            raise ValueError(f"row {missing[0][0]} has no column {missing[0][1]!r}")
        return cls({k: [r[k] for r in rows] for k in keys})

    @property
    def size(self) -> int:
        return len(next(iter(self.values()))) if self else 0

    def rows(self) -> list[dict[str, object]]:
        return [{k: v[i] for k, v in self.items()} for i in range(self.size)]

    def repeat_interleave(self, num_repeats: int) -> BatchedDataDict:
        """Every row `num_repeats` times in a row, in place (the seed calls it for its
        effect), with `group` = the row's index before repeating; returns self."""
        if num_repeats < 1:
            raise ValueError(f"num_repeats must be >= 1, got {num_repeats}")
        self.setdefault("group", list(range(self.size)))
        for key, col in list(self.items()):
            if isinstance(col, torch.Tensor):
                self[key] = col.repeat_interleave(num_repeats, dim=0)
            else:
                self[key] = [x for x in col for _ in range(num_repeats)]
        return self


def batches(rows: Sequence[Mapping[str, object]], batch_size: int) -> Iterator[BatchedDataDict]:
    """The seed's `dataloader`: consecutive `BatchedDataDict`s of `batch_size` rows."""
    for start in range(0, len(rows) - batch_size + 1, batch_size):
        yield BatchedDataDict.from_rows(rows[start : start + batch_size])


class PolicyInterface(Protocol):
    def get_logprobs(self, data: BatchedDataDict) -> torch.Tensor: ...

    def get_reference_logprobs(self, data: BatchedDataDict) -> torch.Tensor | None: ...

    def train(
        self,
        data: BatchedDataDict,
        logprobs: torch.Tensor,
        reference_logprobs: torch.Tensor | None,
        loss_fn: GRPOLossFn | type[GRPOLossFn],
    ) -> dict[str, float]: ...


class GenerationInterface(Protocol):
    def generate(self, data: BatchedDataDict) -> BatchedDataDict: ...


class EnvironmentInterface(Protocol):
    def step(self, generations: BatchedDataDict) -> list[float]: ...


@dataclass
class GRPOLossFn:
    """nexrl's clipped PPO surrogate over GRPO advantages, with a KL term to the reference
    policy (`kl_estimator`) weighted by `kl_coef`."""

    name: str = "ppo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    agg_mode: str = "token-mean"

    def loss_kwargs(self) -> dict[str, object]:
        """The train engine's `loss_kwargs` (`nexrl.algorithms.objective.compute_loss`)."""
        out = dataclasses.asdict(self)
        del out["name"]
        return out


def calculate_grpo_training_data(
    generations: BatchedDataDict,
    logprobs: torch.Tensor,
    reference_logprobs: torch.Tensor | None,
    rewards: Sequence[float],
    estimator: str = "grpo",
    pad_token_id: int = 0,
) -> BatchedDataDict:
    """The train batch: padded token tensors, `old_logprobs` (the policy's, before the
    update), `ref_logprobs`, and per-token advantages of `estimator` (nexrl's registry)
    over the groups made by `repeat_interleave`."""
    values = collate_columns(dict(generations), pad_token_id)
    if tuple(logprobs.shape) != tuple(values["input_ids"].shape):
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} do not match the generations' tokens "
            f"{tuple(values['input_ids'].shape)}"
        )
    if len(rewards) != generations.size:
        raise ValueError(f"{len(rewards)} rewards for {generations.size} generations")
    reward_t = torch.tensor([float(r) for r in rewards])
    group = torch.tensor(list(generations.get("group", range(generations.size))))
    advantages = ADVANTAGE_ESTIMATORS.get(estimator)(reward_t, group, values["loss_mask"])
    data = BatchedDataDict(values, old_logprobs=logprobs, advantages=advantages, rewards=reward_t)
    if reference_logprobs is not None:
        data["ref_logprobs"] = reference_logprobs
    return data


class Policy:
    """`PolicyInterface` over a nexrl train client (`compute_logprobs`,
    `compute_ref_logprobs`, `train_batch`, `export_weights`). Without one, the in-process
    engine on `model_path` with `engine` options (`EngineConfig`); its reference model
    is the initial policy."""

    def __init__(
        self,
        model_path: str,
        engine: EngineConfig | Mapping[str, Any] | None = None,
        client: TrainServiceClient | None = None,
        pad_token_id: int = 0,
    ) -> None:
        if client is None:
            from nexrl.training.client import TrainServiceClient

            cfg = EngineConfig.from_mapping(engine or {})
            cfg = dataclasses.replace(cfg, ref_model_path=cfg.ref_model_path or model_path)
            client = TrainServiceClient({"backend": "builtin"}, cfg, model_path)
            client.initialize()
        self.client = client
        self.pad_token_id = pad_token_id

    def _batch(self, data: BatchedDataDict) -> Batch:
        if "input_ids" in data:
            return Batch(dict(data))
        return Batch(collate_columns(dict(data), self.pad_token_id))

    def get_logprobs(self, data: BatchedDataDict) -> torch.Tensor:
        return self.client.compute_logprobs(self._batch(data))

    def get_reference_logprobs(self, data: BatchedDataDict) -> torch.Tensor | None:
        return self.client.compute_ref_logprobs(self._batch(data))

    def train(
        self,
        data: BatchedDataDict,
        logprobs: torch.Tensor,
        reference_logprobs: torch.Tensor | None,
        loss_fn: GRPOLossFn | type[GRPOLossFn],
    ) -> dict[str, float]:
        """One optimizer step on `data` (from `calculate_grpo_training_data`);
        `loss_fn` may be the class (its defaults) or an instance."""
        if "advantages" not in data:
            raise ValueError(
                "Policy.train needs `advantages`: pass calculate_grpo_training_data's result"
            )
        loss = loss_fn() if isinstance(loss_fn, type) else loss_fn
        values = dict(data, old_logprobs=logprobs)
        if reference_logprobs is not None:
            values["ref_logprobs"] = reference_logprobs
        elif loss.kl_coef:
            raise ValueError("GRPOLossFn.kl_coef > 0 needs reference_logprobs")
        values.pop("rewards", None)
        return self.client.train_batch(Batch(values), loss.name, loss.loss_kwargs())

    def export_weights(self) -> dict[str, torch.Tensor]:
        return self.client.export_weights()

    def shutdown(self) -> None:
        self.client.close()


class Generation:
    """`GenerationInterface` on nexrl's built-in engine: one sample per row (rows are
    repeated for the group), all submitted at once so they decode as one batch."""

    def __init__(
        self,
        model_path: str,
        max_new_tokens: int = 8,
        temperature: float = 1.0,
        prompt_key: str = "prompt",
        **engine_options: Any,
    ) -> None:
        from nexrl.inference.engine import Engine

        self.engine = Engine(model_path, **engine_options)
        self.max_new_tokens, self.temperature = max_new_tokens, temperature
        self.prompt_key = prompt_key

    def generate(self, data: BatchedDataDict) -> BatchedDataDict:
        """`data` plus `prompt_ids`, `response_ids`, `response_logprobs`, `response`
        (text) and `finish_reason` per row."""
        tok = self.engine.tokenizer
        prompts = data.get(self.prompt_key)
        if prompts is None:
            raise ValueError(f"generate: the batch has no {self.prompt_key!r} column")
        futures = [
            self.engine.submit(GenerationRequest(encode_text(tok, p), self._sampling()))
            for p in prompts
        ]
        out = BatchedDataDict(data)
        responses = [f.result() for f in futures]
        samples = [r.outputs[0] for r in responses]
        out["prompt_ids"] = [list(r.input_ids) for r in responses]
        out["response_ids"] = [list(s.output_ids) for s in samples]
        out["response_logprobs"] = [list(s.output_logprobs) for s in samples]
        out["response"] = [tok.decode(s.output_ids, skip_special_tokens=True) for s in samples]
        out["finish_reason"] = [s.finish_reason for s in samples]
        return out

    def _sampling(self) -> SamplingParams:
        return SamplingParams(max_new_tokens=self.max_new_tokens, temperature=self.temperature)

    def update_weights(self, policy: Policy) -> int:
        """Load the policy's weights; returns the engine's new weight version."""
        version = self.engine.version + 1
        self.engine.update_weights(WeightUpdateMeta(version, state_dict=policy.export_weights()))
        return version

    def shutdown(self) -> None:
        self.engine.shutdown()


class RewardEnvironment:
    """`EnvironmentInterface` scoring each generation with a nexrl reward
    (`reward(prompt, completion, **row) -> float`; a registered name or `module:function`)."""

    def __init__(self, reward_fn: str | Callable[..., float], prompt_key: str = "prompt") -> None:
        from nexrl.rewards import get_reward_fn

        self.reward_fn = get_reward_fn(reward_fn) if isinstance(reward_fn, str) else reward_fn
        self.prompt_key = prompt_key

    def step(self, generations: BatchedDataDict) -> list[float]:
        """One reward per generation; a reward that raises is re-raised naming the row."""
        skip = {self.prompt_key, "response", "group", "finish_reason", *GENERATION_KEYS}
        rewards = []
        for i, r in enumerate(generations.rows()):
            row = {k: v for k, v in r.items() if k not in skip}
            try:
                rewards.append(float(self.reward_fn(r[self.prompt_key], r["response"], **row)))
            except Exception as exc:
                raise ValueError(
                    f"reward on generation {i} (prompt {r[self.prompt_key]!r}): {exc!r}"
                ) from exc
        return rewards


def grpo_train(
    policy: Policy,
    policy_generation: Generation,
    environment: EnvironmentInterface,
    dataloader: Iterable[BatchedDataDict],
    num_generations_per_prompt: int = 4,
    loss_fn: GRPOLossFn | None = None,
    max_steps: int | None = None,
) -> list[dict[str, float]]:
    """Seed 002's GRPO loop: per batch, repeat each prompt for its group, generate, score,
    take the policy's and the reference's logprobs, compute advantages, update the policy,
    then load its weights into the generator. Returns each step's metrics (`reward`: mean
    reward of the step's generations, `loss`, `kl`, ...)."""
    loss_fn = loss_fn or GRPOLossFn()
    history: list[dict[str, float]] = []
    for step, batch in enumerate(dataloader, start=1):
        batch.repeat_interleave(num_generations_per_prompt)  # repeat for GRPO
        generations = policy_generation.generate(batch)
        rewards = environment.step(generations)

        logprobs = policy.get_logprobs(generations)
        reference_logprobs = policy.get_reference_logprobs(generations)

        training_data = calculate_grpo_training_data(
            generations, logprobs, reference_logprobs, rewards
        )
        metrics = policy.train(training_data, logprobs, reference_logprobs, loss_fn)
        version = policy_generation.update_weights(policy)
        history.append(
            {**metrics, "step": step, "reward": statistics.fmean(rewards), "version": version}
        )
        if max_steps is not None and step >= max_steps:
            break
    return history
