"""An engine that takes the trainer's tensors as its weights (a sync run in one process)
holds no joined copy of them: its q/k/v and gate/up matrices are the trainer's own
storage (`model_parts.join_projections`), and it generates the same tokens as an engine
that copied the same weights."""

from __future__ import annotations

import torch

from nexrl.inference.engine import Engine
from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.weights import SharedState
from nexrl.training.synthetic import random_batch
from nexrl.training.torch_engine import TorchTrainEngine

PROMPTS = [[5, 6, 7, 8], [9, 10, 11], [12, 13, 14, 15, 16]]


def _greedy(engine: Engine) -> list[tuple[list[int], list[float]]]:
    outs = []
    for ids in PROMPTS:
        out = engine.generate(
            GenerationRequest(ids, SamplingParams(max_new_tokens=12, temperature=0))
        )
        outs.append((out.outputs[0].output_ids, out.outputs[0].output_logprobs))
    return outs


def _storage(t: torch.Tensor) -> tuple[int, int]:
    return t.untyped_storage().data_ptr(), t.storage_offset()


def test_engine_sharing_the_trainers_weights_keeps_no_joined_copy(tiny_path):
    trainer = TorchTrainEngine({"lr": 1e-2}, str(tiny_path))
    attn = trainer.model.model.layers[0].self_attn
    # the trainer's layout: q, k, v (and their biases) are row blocks of one tensor
    assert _storage(attn.k_proj.weight) == (
        _storage(attn.q_proj.weight)[0],
        attn.q_proj.weight.numel(),
    )
    engines = [Engine(tiny_path, max_batch_size=4, max_model_len=64, matmul="torch") for _ in "ab"]
    shared, copied = engines
    try:
        for version in (1, 2):
            if version == 2:  # a train step changes the trainer's tensors in place
                trainer.train_batch(random_batch(4, 10, seed=5), "ppo_clip", {})
            state = trainer.export_weights(copy=False)
            shared.update_weights(WeightUpdateMeta(version, state_dict=SharedState(state)))
            copied.update_weights(WeightUpdateMeta(version, state_dict=trainer.export_weights()))
            for block, runner_layer, other in zip(
                trainer.model.model.layers,
                shared.runner.layers,
                copied.runner.layers,
                strict=True,
            ):
                q, gate = block.self_attn.q_proj, block.mlp.gate_proj
                assert _storage(runner_layer.qkv_w) == _storage(q.weight)
                assert _storage(runner_layer.qkv_b) == _storage(q.bias)
                assert _storage(runner_layer.gate_up_w) == _storage(gate.weight)
                assert _storage(other.qkv_w)[0] != _storage(q.weight)[0]  # copied: its own
                assert torch.equal(runner_layer.qkv_w, other.qkv_w)
                assert torch.equal(runner_layer.gate_up_w, other.gate_up_w)
            assert _greedy(shared) == _greedy(copied)
    finally:
        for engine in engines:
            engine.shutdown()
