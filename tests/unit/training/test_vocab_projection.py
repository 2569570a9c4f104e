"""`ProjectedLogprobs`: the hand-written backward equals autograd through full logits."""

import pytest
import torch

from nexrl.training.microbatch import _project
from nexrl.training.vocab_projection import projected_logprobs


def _inputs(dtype=torch.float64, n=23, hidden=16, vocab=97):
    gen = torch.Generator().manual_seed(0)
    rows = torch.randn(n, hidden, generator=gen, dtype=dtype).requires_grad_()
    head = (torch.randn(vocab, hidden, generator=gen, dtype=dtype) * 0.5).requires_grad_()
    targets = torch.randint(0, vocab, (n,), generator=gen)
    weights = torch.randn(2, n, generator=gen, dtype=dtype)
    return rows, head, targets, weights


def _reference(rows, head, targets, with_entropy):
    logp = torch.log_softmax(rows @ head.T, dim=-1)
    lp = logp.gather(-1, targets[:, None]).squeeze(-1)
    ent = -(logp.exp() * logp).sum(-1) if with_entropy else None
    return lp, ent


def _grads(fn, rows, head, targets, weights, with_entropy, use_entropy=True):
    rows.grad = head.grad = None
    lp, ent = fn(rows, head, targets, with_entropy)
    loss = (lp * weights[0]).sum()
    if with_entropy and use_entropy:
        loss = loss + (ent * weights[1]).sum()
    loss.backward()
    return lp.detach(), (None if ent is None else ent.detach()), rows.grad, head.grad


@pytest.mark.parametrize("with_entropy", [False, True])
def test_values_and_gradients_equal_autograd_through_full_logits(with_entropy):
    rows, head, targets, weights = _inputs()
    want = _grads(_reference, rows, head, targets, weights, with_entropy)
    got = _grads(projected_logprobs, rows, head, targets, weights, with_entropy)
    for name, a, b in zip(("lp", "entropy", "d rows", "d head"), got, want, strict=True):
        if b is None:
            assert a.numel() == 0, name  # no entropy asked: an empty tensor
            continue
        assert torch.allclose(a.double(), b, atol=1e-5, rtol=1e-5), name


def test_entropy_computed_but_unused_gives_the_logprob_gradient_only():
    rows, head, targets, weights = _inputs()
    want = _grads(_reference, rows, head, targets, weights, False)
    got = _grads(projected_logprobs, rows, head, targets, weights, True, use_entropy=False)
    assert torch.allclose(got[2], want[2], atol=1e-6)
    assert torch.allclose(got[3], want[3], atol=1e-6)


def test_only_the_inputs_that_need_a_gradient_get_one():
    rows, head, targets, weights = _inputs()
    frozen = head.detach()
    lp, _ = projected_logprobs(rows, frozen, targets)
    (lp * weights[0]).sum().backward()
    ref_rows = rows.detach().requires_grad_()
    ref_lp, _ = _reference(ref_rows, frozen, targets, False)
    (ref_lp * weights[0]).sum().backward()
    assert frozen.grad is None
    assert torch.allclose(rows.grad, ref_rows.grad, atol=1e-6)


def test_backward_keeps_no_rows_by_vocabulary_tensor():
    rows, head, targets, _ = _inputs(n=40, vocab=500)
    lp, ent = projected_logprobs(rows, head, targets, True)
    saved = lp.grad_fn.saved_tensors
    assert max(t.numel() for t in saved) == head.numel()  # the head itself, no logits
    assert sum(t.numel() for t in saved) == rows.numel() + head.numel() + 3 * 40


def test_bf16_autocast_matches_the_plain_autograd_path():
    rows, head, targets, weights = _inputs(dtype=torch.float32)

    with torch.autocast("cpu", dtype=torch.bfloat16):  # reference: plain autograd
        want = _grads(_project, rows, head, targets, weights.float(), False)
        got = _grads(projected_logprobs, rows, head, targets, weights.float(), False)
    assert got[2].dtype == rows.dtype and got[3].dtype == head.dtype
    for i in (0, 2, 3):  # lp, d rows, d head
        assert torch.allclose(got[i], want[i], atol=2e-2, rtol=2e-2)
