"""compute_loss on a real (tiny) Qwen2: accumulation over 8 micro-batches of 1 equals one batch."""

import pytest
import torch
from transformers import AutoModelForCausalLM

from nexrl.algorithms import ADVANTAGE_ESTIMATORS, compute_loss
from nexrl.models.tiny import VOCAB_SIZE, build_tiny_qwen2


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    torch.set_num_threads(1)
    path = build_tiny_qwen2(tmp_path_factory.mktemp("algo") / "m")
    return AutoModelForCausalLM.from_pretrained(path, torch_dtype=torch.float32)


def token_logprobs(model, input_ids, attention_mask):
    """(B, T) log p(tok_t | tok_<t), 0 at t = 0 (the nexrl layout)."""
    logits = model(input_ids=input_ids, attention_mask=attention_mask).logits[:, :-1]
    lp = torch.log_softmax(logits.float(), -1).gather(-1, input_ids[:, 1:, None])[..., 0]
    return torch.cat([torch.zeros_like(lp[:, :1]), lp], dim=1)


def test_grpo_step_accumulated_equals_full_batch(model):
    g = torch.Generator().manual_seed(0)
    b, t = 8, 12
    input_ids = torch.randint(4, VOCAB_SIZE, (b, t), generator=g)
    lengths = torch.randint(6, t + 1, (b,), generator=g)
    attention_mask = (torch.arange(t)[None] < lengths[:, None]).long()
    loss_mask = ((torch.arange(t)[None] >= 4) & (attention_mask > 0)).float()  # 4-token prompt
    with torch.no_grad():
        old = token_logprobs(model, input_ids, attention_mask)
    rewards = torch.randint(0, 2, (b,), generator=g).float()
    adv = ADVANTAGE_ESTIMATORS.get("grpo")(rewards, torch.arange(b) // 4, loss_mask)
    batch = {"advantages": adv, "loss_mask": loss_mask, "old_logprobs": old - 0.05}
    kwargs = {"num_tokens": loss_mask.sum(), "clip_high": 0.28}

    model.zero_grad()
    full, _ = compute_loss(token_logprobs(model, input_ids, attention_mask), batch, **kwargs)
    full.backward()
    full_grads = [p.grad.clone() for p in model.parameters()]
    model.zero_grad()
    total = 0.0
    for i in range(b):
        sub = {k: v[i : i + 1] for k, v in batch.items()}
        lp = token_logprobs(model, input_ids[i : i + 1], attention_mask[i : i + 1])
        loss, _ = compute_loss(lp, sub, **kwargs)
        loss.backward()
        total += float(loss.detach())
    assert total == pytest.approx(float(full.detach()), abs=1e-6)
    for p, want in zip(model.parameters(), full_grads, strict=True):
        assert torch.allclose(p.grad, want, atol=1e-6, rtol=1e-4)
    assert any(float(g.abs().sum()) > 0 for g in full_grads)
