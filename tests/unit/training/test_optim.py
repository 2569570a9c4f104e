"""The train engine's AdamW: fused where torch has the kernel, the same update."""

import torch

from nexrl.training.optim import make_adamw


def _params(device="cpu"):
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(n, 7, generator=gen).to(device)) for n in (3, 11)]


def test_cpu_parameters_get_the_fused_adamw_with_the_default_update():
    fused_params, plain_params, initial = _params(), _params(), _params()
    fused = make_adamw(fused_params, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(plain_params, lr=1e-2, weight_decay=0.1)
    assert fused.defaults["fused"] and not plain.defaults["fused"]
    for step in range(3):
        for a, b in zip(fused_params, plain_params, strict=True):
            a.grad = b.grad = torch.full_like(a, 0.5 - step) * torch.arange(a.numel()).view_as(a)
        fused.step()
        plain.step()
    for a, b, before in zip(fused_params, plain_params, initial, strict=True):
        torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-6)
        assert not torch.equal(a, before)  # the steps moved it


def test_parameters_without_the_fused_kernel_get_the_default_adamw():
    meta = make_adamw(_params("meta"), lr=1e-3)  # a device torch has no fused AdamW for
    assert not meta.defaults["fused"]
