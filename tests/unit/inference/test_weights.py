"""Weights handed between processes as numpy arrays (`weight.transport` memory, Ray),
and copied into a running engine's model."""

from __future__ import annotations

import re

import pytest
import torch

from nexrl.inference.weights import (
    SharedState,
    load_weights_into,
    state_from_arrays,
    state_to_arrays,
)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_travels_as_arrays_and_comes_back_bit_exact(dtype):
    state = {"a.weight": torch.randn(3, 5).to(dtype), "b.bias": torch.randn(7).to(dtype)}
    arrays = state_to_arrays(state)
    assert all(type(a).__module__ == "numpy" for a, _ in arrays.values())
    back = state_from_arrays(arrays)
    for name, tensor in state.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.LayerNorm(3))
    model.register_buffer("scale", torch.ones(2))
    return model


def test_new_weights_are_copied_into_the_parameters_in_place():
    model = _model()
    param = model[0].weight
    state = {k: torch.randn_like(v) for k, v in model.state_dict().items()}
    state["0.bias"] = state["0.bias"].bfloat16()  # converted to the model's dtype
    state["0.weight"] = torch.randn(3, 8)[:, ::2]  # a strided view, as a slice gives
    load_weights_into(model, state)
    assert model[0].weight is param  # views an engine holds on it stay valid
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def test_a_shared_state_becomes_the_parameters_where_it_can():
    """`SharedState` (a sync run's trainer tensors): contiguous CPU tensors of the model's
    dtype become its parameters (no copy); the rest is copied as before."""
    model = _model()
    param = model[0].weight
    state = SharedState({k: torch.randn_like(v) for k, v in model.state_dict().items()})
    state["0.bias"] = state["0.bias"].bfloat16()  # another dtype: copied
    state["1.weight"] = torch.randn(6)[::2]  # not contiguous: copied
    load_weights_into(model, state)
    assert model[0].weight is param and param.data_ptr() == state["0.weight"].data_ptr()
    assert model[1].bias.data_ptr() == state["1.bias"].data_ptr()
    assert model.scale.data_ptr() != state["scale"].data_ptr()  # a buffer: copied
    for name in ("0.bias", "1.weight"):
        assert model.state_dict()[name].data_ptr() != state[name].data_ptr(), name
    state["0.weight"].add_(1.0)  # the owner's later change is what the model sees
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, state[name].to(tensor.dtype)), name


def test_a_partial_update_leaves_the_rest():
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    load_weights_into(model, {"1.weight": torch.full((3,), 2.0)})
    assert torch.equal(model[1].weight, torch.full((3,), 2.0))
    assert torch.equal(model[0].weight, before["0.weight"])


@pytest.mark.parametrize(
    ("state", "error", "words"),
    [
        ({"0.weight": torch.zeros(3, 4), "2.weight": torch.zeros(1)}, KeyError, "2.weight"),
        ({"0.weight": torch.zeros(4, 3)}, ValueError, "0.weight: (4, 3) for the model's (3, 4)"),
        ({}, KeyError, "matched no parameter"),
    ],
)
def test_a_bad_update_is_refused_before_anything_is_copied(state, error, words):
    model = _model()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    with pytest.raises(error, match=re.escape(words)):
        load_weights_into(model, {**state, "1.bias": torch.full((3,), 5.0)} if state else {})
    for name, tensor in model.state_dict().items():
        assert torch.equal(tensor, before[name]), name
