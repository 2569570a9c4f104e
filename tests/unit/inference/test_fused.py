"""The decode step's fused C operations (residual add + RMSNorm, SiLU * up): the torch
path's numbers, in fp32 and in bf16 (rounded where the HF modules round), on any number
of threads, and the same decode step with or without them."""

from __future__ import annotations

import shutil

import pytest
import torch

from nexrl.inference.fused import fused_ops, torch_add_rms_norm, torch_silu_mul
from nexrl.inference.model_runner import ModelRunner

pytestmark = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)


def with_threads(threads: int, fn):
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        return fn()
    finally:
        torch.set_num_threads(saved)


@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_add_rms_norm_is_the_torch_path(dtype, threads):
    ops = fused_ops(dtype)
    assert ops is not None, "the fused ops failed to build or failed their self-check"
    gen = torch.Generator().manual_seed(threads)
    x, delta = (torch.randn(7, 40, generator=gen).mul(4).to(dtype) for _ in range(2))
    w = (torch.rand(40, generator=gen) + 0.5).to(dtype)
    want_x, want = torch_add_rms_norm(x, delta, w, 1e-5)
    got_x = x.clone()
    got = with_threads(threads, lambda: ops.add_rms_norm(got_x, delta, w, 1e-5))
    assert torch.equal(got_x, want_x)  # the residual sum, updated in place
    if dtype == torch.bfloat16:  # the same roundings: bit for bit
        assert torch.equal(got, want)
    else:
        torch.testing.assert_close(got, want, atol=1e-6, rtol=1e-5)
    alone = ops.add_rms_norm(want_x.clone(), None, w, 1e-5)  # no residual: the norm only
    torch.testing.assert_close(alone.float(), want.float(), atol=1e-6, rtol=1e-5)
    with pytest.raises(ValueError, match="x must be contiguous"):
        ops.add_rms_norm(
            torch.zeros(40, 7, dtype=dtype).t(), None, torch.ones(7, dtype=dtype), 1e-5
        )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_silu_mul_is_the_torch_path(dtype):
    ops = fused_ops(dtype)
    gen = torch.Generator().manual_seed(0)
    gate_up = torch.randn(9, 2 * 33, generator=gen).mul(3).to(dtype)
    got = with_threads(2, lambda: ops.silu_mul(gate_up))
    want = torch_silu_mul(gate_up)
    assert got.shape == (9, 33) and got.dtype == dtype
    if dtype == torch.bfloat16:  # expf may round silu to the neighbouring bf16, rarely
        assert (got != want).float().mean() < 0.01
        torch.testing.assert_close(got.float(), want.float(), atol=0.1, rtol=0.01)
    else:
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-4), (torch.bfloat16, 0.1)])
def test_decode_step_gives_the_same_logits_with_and_without_them(hf_model, dtype, tol):
    import copy

    model = copy.deepcopy(hf_model).to(dtype)
    runner = ModelRunner(model, 8, 32)
    assert runner.fused is not None
    prompt = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0]])
    lengths, rows = torch.tensor([5, 3]), torch.arange(2)
    runner.prefill(prompt, lengths, rows, rows)
    tokens, pos = torch.tensor([13, 14]), lengths.clone()
    caches = [t.clone() for t in (*runner.k_cache, *runner.v_cache)]
    fused = runner.decode(tokens, pos)
    for t, saved in zip((*runner.k_cache, *runner.v_cache), caches, strict=True):
        t.copy_(saved)
    runner.fused = None
    plain = runner.decode(tokens, pos)
    torch.testing.assert_close(fused, plain, atol=tol, rtol=tol)
