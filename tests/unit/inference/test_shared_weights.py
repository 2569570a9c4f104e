"""An engine that takes the trainer's tensors as its weights (a sync run in one process)
holds no joined copy of them: its q/k/v and gate/up matrices are the trainer's own
storage (`weights.join_projections`), and it generates the same tokens as an engine that
copied the same weights. A weight update hands back the prefix cache's pages."""

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
    shared, copied = engines = [
        Engine(tiny_path, max_batch_size=4, max_model_len=64, matmul="torch") for _ in "ab"
    ]
    try:
        for version in (1, 2):
            if version == 2:  # a train step changes the trainer's tensors in place
                trainer.train_batch(random_batch(4, 10, seed=5), "ppo_clip", {})
            state = trainer.export_weights(copy=False)
            shared.update_weights(WeightUpdateMeta(version, state_dict=SharedState(state)))
            copied.update_weights(WeightUpdateMeta(version, state_dict=trainer.export_weights()))
            layers = zip(
                trainer.model.model.layers, shared.runner.layers, copied.runner.layers, strict=True
            )
            for block, runner_layer, copy_layer in layers:
                q, gate = block.self_attn.q_proj, block.mlp.gate_proj
                assert _storage(runner_layer.qkv_w) == _storage(q.weight)
                assert _storage(runner_layer.qkv_b) == _storage(q.bias)
                assert _storage(runner_layer.gate_up_w) == _storage(gate.weight)
                assert _storage(copy_layer.qkv_w)[0] != _storage(q.weight)[0]  # its own copy
                assert torch.equal(runner_layer.qkv_w, copy_layer.qkv_w)
                assert torch.equal(runner_layer.gate_up_w, copy_layer.gate_up_w)
            assert _greedy(shared) == _greedy(copied)
    finally:
        for engine in engines:
            engine.shutdown()


def test_a_weight_update_hands_back_the_prefix_caches_pages(tiny_path):
    """The prefix cache's store is allocated anew at the clear of a weight update (once
    something was cached), so the engine does not hold the most it ever cached; what it
    generates is the same."""
    engine = Engine(tiny_path, max_batch_size=4, max_model_len=64, matmul="torch")
    try:
        prefix = engine.prefix
        empty = prefix.k[0].data_ptr()
        engine.reset_prefix_cache()  # nothing cached yet: the same store
        assert prefix.k[0].data_ptr() == empty
        before = _greedy(engine)
        assert prefix.stats["cached_tokens"] > 0
        filled = prefix.k[0].untyped_storage().data_ptr()
        state = {k: v.clone() for k, v in engine.model.state_dict().items()}
        engine.update_weights(WeightUpdateMeta(1, state_dict=state))
        assert prefix.stats["cached_tokens"] == 0
        assert prefix.k[0].untyped_storage().data_ptr() != filled
        assert _storage(prefix.v[-1])[0] == _storage(prefix.k[0])[0]  # one block
        assert _greedy(engine) == before
    finally:
        engine.shutdown()
