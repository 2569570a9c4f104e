"""Weights handed between processes as numpy arrays (`weight.transport` memory, Ray)."""

from __future__ import annotations

import pytest
import torch

from nexrl.inference.weights import state_from_arrays, state_to_arrays


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_state_travels_as_arrays_and_comes_back_bit_exact(dtype):
    state = {"a.weight": torch.randn(3, 5).to(dtype), "b.bias": torch.randn(7).to(dtype)}
    arrays = state_to_arrays(state)
    assert all(type(a).__module__ == "numpy" for a, _ in arrays.values())
    back = state_from_arrays(arrays)
    for name, tensor in state.items():
        assert back[name].dtype == dtype and torch.equal(back[name], tensor), name
