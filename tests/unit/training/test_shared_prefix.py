"""The shared-prefix forward equals the plain forward (tiny model, CPU, float32)."""

from __future__ import annotations

import inspect
import math

import pytest
import torch

from nexrl.models.tiny import SPECIALS, VOCAB_SIZE
from nexrl.training import shared_prefix
from nexrl.training.shared_prefix import plan_prefixes
from nexrl.training.torch_engine import GPU_SHARED_PREFIX_FLOPS, TorchTrainEngine
from nexrl.types import Batch

PPO = {"clip_low": 0.2, "clip_high": 0.28, "entropy_coef": 0.03}
# (prompt length, group size, response lengths cycled over the group)
GROUPS = [(5, 4, [3, 6, 1]), (9, 3, [4, 2]), (3, 1, [7]), (5, 2, [5])]


def grouped_batch(seed: int = 0, t: int = 18) -> Batch:
    """GRPO-like rows: groups of equal prompts, responses of different lengths, right
    padding, a group of one, two prompts of equal length, one row with loss-mask holes."""
    g = torch.Generator().manual_seed(seed)
    rows = []
    for plen, size, rlens in GROUPS:
        prompt = torch.randint(len(SPECIALS), VOCAB_SIZE, (plen,), generator=g)
        for i in range(size):
            response = torch.randint(
                len(SPECIALS), VOCAB_SIZE, (rlens[i % len(rlens)],), generator=g
            )
            rows.append((prompt, response))
    n = len(rows)
    ids, att, mask = (torch.zeros(n, t, dtype=torch.long) for _ in range(3))
    for r, (prompt, response) in enumerate(rows):
        length = len(prompt) + len(response)
        ids[r, :length] = torch.cat([prompt, response])
        att[r, :length] = 1
        mask[r, len(prompt) : length] = 1
    mask[1, 7:9] = 0  # tool output inside the response: not trained
    adv = torch.randn(n, 1, generator=g) * mask
    return Batch(
        {"input_ids": ids, "attention_mask": att, "loss_mask": mask.float(), "advantages": adv}
    )


def engine(tiny_model: str, **config) -> TorchTrainEngine:
    return TorchTrainEngine({"logprob_positions": "response", **config}, tiny_model)


def test_plan_groups_rows_by_prompt_and_counts_tokens():
    batch = grouped_batch()
    v = batch.values
    plan = plan_prefixes(v["input_ids"], v["attention_mask"], v["loss_mask"])
    prompts = [p for p, size, _ in GROUPS for _ in range(size)]
    assert plan.start.tolist() == prompts
    assert len(plan.prefix_ids) == len(GROUPS)  # one forward per distinct prompt
    assert plan.row_prefix.tolist() == [k for k, (_, s, _) in enumerate(GROUPS) for _ in range(s)]
    # each suffix stops before the row's last response token
    lengths = v["attention_mask"].sum(-1)
    assert plan.suffix_mask.sum(-1).tolist() == (lengths - plan.start - 1).tolist()
    assert plan.model_tokens == sum(p for p, _, _ in GROUPS) + int(plan.suffix_mask.sum())


def test_grouped_plan_puts_a_prefix_rows_back_to_back(monkeypatch):
    v = grouped_batch().values
    keys = (v["input_ids"], v["attention_mask"], v["loss_mask"])
    plan = plan_prefixes(*keys, group_suffixes=True)
    # suffix lengths per group: [2, 5, 0, 2] (row 1 trains up to its end), [3, 1, 3], [6], [4, 4]
    assert plan.offsets.tolist() == [0, 2, 7, 7, 0, 3, 4, 0, 0, 4]
    assert plan.grouped and plan.group_width == 9
    assert plan.padded_tokens == plan.prefix_mask.numel() + len(GROUPS) * 9
    assert not plan_prefixes(*keys).grouped  # not asked for
    monkeypatch.setattr(shared_prefix, "GROUP_MAX_TOKENS", 8)
    assert not plan_prefixes(*keys, group_suffixes=True).grouped  # past the longest allowed


def test_grouped_mask_shows_each_query_the_prefix_and_its_own_row():
    prefix_mask = torch.tensor([[1, 1, 0]])
    owner = torch.tensor([[4, 4, 7, 7, 7, -1]])  # rows 4 and 7 of the batch, then padding
    mask = shared_prefix.grouped_suffix_mask(prefix_mask, owner)
    assert mask.shape == (1, 1, 6, 9)
    expected = torch.tensor(
        [
            [1, 1, 0, 1, 0, 0, 0, 0, 0],
            [1, 1, 0, 1, 1, 0, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 0, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 0, 0],
            [1, 1, 0, 0, 0, 1, 1, 1, 0],
            [1, 1, 0, 0, 0, 0, 0, 0, 1],  # padding: the prefix and itself, nothing reads it
        ],
        dtype=torch.bool,
    )
    assert torch.equal(mask[0, 0], expected)


def test_a_grouped_plan_needs_dense_masks(tiny_model):
    v = grouped_batch().values
    plan = plan_prefixes(v["input_ids"], v["attention_mask"], v["loss_mask"], group_suffixes=True)
    eng = engine(tiny_model)
    head = eng.model.lm_head.weight
    with pytest.raises(ValueError, match="4D masks"):
        shared_prefix.shared_prefix_logprobs(eng.model, head, v["input_ids"], plan)


@pytest.fixture(params=["grouped", "per-row"])
def layout(request, monkeypatch) -> dict[str, int | str]:
    """Each suffix layout in turn (`GROUP_MAX_TOKENS` 0: per row); counts the forwards of
    each, so that a test can check which one ran."""
    if request.param == "per-row":
        monkeypatch.setattr(shared_prefix, "GROUP_MAX_TOKENS", 0)
    ran = {"asked": request.param, "grouped": 0, "per-row": 0}
    for name, key in (("_grouped_suffix_hidden", "grouped"), ("_row_suffix_hidden", "per-row")):
        real = getattr(shared_prefix, name)

        def counting(*args, _real=real, _key=key, **kwargs):
            ran[_key] += 1
            return _real(*args, **kwargs)

        monkeypatch.setattr(shared_prefix, name, counting)
    return ran


def only_ran(layout: dict[str, int | str], expected: str) -> bool:
    other = "per-row" if expected == "grouped" else "grouped"
    return layout[expected] > 0 and layout[other] == 0


def test_no_shared_prefix_means_no_plan():
    v = grouped_batch().values
    distinct = [0, 4, 7, 8]  # one row of each group
    keys = ("input_ids", "attention_mask", "loss_mask")
    assert plan_prefixes(*(v[k][distinct] for k in keys)) is None


@pytest.mark.parametrize(
    "config",
    [
        {},
        {"logprob_chunk_tokens": 5},
        {"logprob_chunk_tokens": 0},
        {"attn_implementation": "eager"},
    ],
)
def test_logprobs_and_entropy_equal_the_plain_path(tiny_model, config, layout):
    batch = grouped_batch()
    shared = engine(tiny_model, shared_prefix=True, **config)
    plain = engine(tiny_model, shared_prefix=False, **config)
    mask = batch.values["loss_mask"].bool()
    for name in ("compute_logprobs", "compute_entropy"):
        ours, ref = getattr(shared, name)(batch), getattr(plain, name)(batch)
        torch.testing.assert_close(ours[mask], ref[mask], atol=1e-5, rtol=1e-5)
        assert (ours[~mask] == 0).all() and ours[mask].abs().min() > 0
    assert shared._model_tokens < plain._model_tokens
    eager = config.get("attn_implementation") == "eager"  # no 4D masks: per row
    assert only_ran(layout, "per-row" if eager else layout["asked"])


@pytest.mark.parametrize("lora", [None, {"rank": 4}])
def test_train_step_gives_the_plain_gradients_and_update(tiny_model, lora, layout):
    batch = grouped_batch(seed=1)
    # AdamW's first step moves a weight by lr * g / (|g| + eps): with the default eps a
    # gradient of ~1e-9 moves it by a sizeable part of lr, so float rounding in such a
    # gradient decides its update. A large eps makes the step Lipschitz in g (a gradient
    # difference d moves the update by at most lr * d / eps), so equal gradients within
    # the tolerance below must give equal weights within 1e-5.
    opt = {"lora": lora, "micro_batch_tokens": 80, "eps": 1e-3}
    a = engine(tiny_model, shared_prefix=True, **opt)
    b = engine(tiny_model, shared_prefix=False, **opt)
    ma = a.train_batch(batch, "ppo_clip", PPO)
    mb = b.train_batch(batch, "ppo_clip", PPO)
    for key in ("loss", "entropy", "grad_norm"):
        assert ma[key] == pytest.approx(mb[key], rel=1e-5, abs=1e-7), key
    assert ma["model_tokens"] < mb["model_tokens"] == mb["tokens"]
    grads_b = {k: p.grad for k, p in b.model.named_parameters() if p.requires_grad}
    assert grads_b
    for name, p in a.model.named_parameters():
        if p.requires_grad:
            torch.testing.assert_close(p.grad, grads_b[name], atol=1e-5, rtol=1e-4)
    params_b = dict(b.model.named_parameters())
    for name, p in a.model.named_parameters():
        torch.testing.assert_close(p, params_b[name], atol=1e-5, rtol=1e-5)
    assert only_ran(layout, layout["asked"])


def one_long_suffix_batch() -> Batch:
    """Two prompts of 6 rows each: one row of each with a 12-token response, the rest 1 to
    3 tokens (a multi-turn episode beside one-turn answers)."""
    g = torch.Generator().manual_seed(3)
    ids, att, mask = (torch.zeros(12, 20, dtype=torch.long) for _ in range(3))
    for group in range(2):
        prompt = torch.randint(len(SPECIALS), VOCAB_SIZE, (6,), generator=g)
        for i, n in enumerate([2, 1, 12, 3, 2, 1]):
            r = 6 * group + i
            ids[r, : 6 + n] = torch.cat(
                [prompt, torch.randint(len(SPECIALS), VOCAB_SIZE, (n,), generator=g)]
            )
            att[r, : 6 + n], mask[r, 6 : 6 + n] = 1, 1
    adv = torch.randn(12, 1, generator=g) * mask
    return Batch(
        {"input_ids": ids, "attention_mask": att, "loss_mask": mask.float(), "advantages": adv}
    )


def test_a_few_long_suffixes_go_in_a_forward_of_their_own():
    v = one_long_suffix_batch().values
    keys = (v["input_ids"], v["attention_mask"], v["loss_mask"])
    plan = plan_prefixes(*keys)
    assert [b.tolist() for b in plan.buckets] == [[0, 1, 3, 4, 5, 6, 7, 9, 10, 11], [2, 8]]
    # suffix lengths: response - 1; 10 rows padded to 2, 2 rows to 11 (one forward: 12 x 11)
    assert plan.padded_tokens == 12 + 10 * 2 + 2 * 11
    whole = plan_prefixes(*keys, split_suffixes=False)
    assert [b.tolist() for b in whole.buckets] == [list(range(12))]
    assert whole.padded_tokens == 12 + 12 * 11
    assert plan.model_tokens == whole.model_tokens


def test_split_suffix_forwards_give_the_plain_logprobs_and_gradients(tiny_model, monkeypatch):
    calls = spy(monkeypatch)
    monkeypatch.setattr(shared_prefix, "GROUP_MAX_TOKENS", 0)  # the per-row layout splits
    batch = one_long_suffix_batch()
    a = engine(tiny_model, shared_prefix=True, eps=1e-3)
    b = engine(tiny_model, shared_prefix=False, eps=1e-3)
    mask = batch.values["loss_mask"].bool()
    torch.testing.assert_close(
        a.compute_logprobs(batch)[mask], b.compute_logprobs(batch)[mask], atol=1e-5, rtol=1e-5
    )
    ma, mb = a.train_batch(batch, "ppo_clip", PPO), b.train_batch(batch, "ppo_clip", PPO)
    assert ma["loss"] == pytest.approx(mb["loss"], rel=1e-5, abs=1e-7)
    grads_b = dict(b.model.named_parameters())
    for name, p in a.model.named_parameters():
        torch.testing.assert_close(p.grad, grads_b[name].grad, atol=1e-5, rtol=1e-4)
    assert len(calls) == 2  # both passes took the shared-prefix path (with its split)


def spy(monkeypatch) -> list[int]:
    calls: list[int] = []
    real = shared_prefix.shared_prefix_logprobs

    def counting(*args, **kwargs):
        calls.append(1)
        return real(*args, **kwargs)

    monkeypatch.setattr("nexrl.training.torch_engine.shared_prefix_logprobs", counting)
    return calls


def test_fallbacks_take_the_plain_path(tiny_model, monkeypatch, caplog):
    calls = spy(monkeypatch)
    batch = grouped_batch()
    engine(tiny_model).compute_logprobs(batch)  # auto: on
    assert len(calls) == 1
    engine(tiny_model, shared_prefix=False).compute_logprobs(batch)
    engine(tiny_model).compute_logprobs(batch.select([0, 4, 7, 8]))  # nothing shared
    engine(tiny_model, logprob_positions="all").compute_logprobs(batch)  # prompt wanted too
    with caplog.at_level("INFO", logger="nexrl.training.torch_engine"):
        engine(tiny_model, use_packing=True).compute_logprobs(batch)
    assert "shared_prefix (auto): plain forward, it needs one rank" in caplog.text
    checkpointed = engine(tiny_model, shared_prefix=True, gradient_checkpointing=True)
    with pytest.warns(UserWarning, match="gradient checkpointing"):
        checkpointed.train_batch(batch, "ppo_clip", PPO)
    assert len(calls) == 1
    checkpointed.compute_logprobs(batch)  # eval: the cache works under checkpointing
    assert len(calls) == 2


def test_auto_skips_a_plan_that_computes_more_padded_tokens(tiny_model, monkeypatch):
    calls = spy(monkeypatch)
    # two rows share a long prompt; two short prompts have long responses: the suffix
    # forward would pad every row to the long responses (3 x 10 + 4 x 9 > 4 x 11 tokens)
    ids = torch.randint(len(SPECIALS), VOCAB_SIZE, (4, 11), generator=torch.Generator())
    ids[1, :10] = ids[0, :10]
    mask = torch.zeros(4, 11)
    mask[:2, 10] = 1
    mask[2:, 1:] = 1
    batch = Batch({"input_ids": ids, "attention_mask": torch.ones(4, 11), "loss_mask": mask})
    auto, forced = engine(tiny_model), engine(tiny_model, shared_prefix=True)
    torch.testing.assert_close(auto.compute_logprobs(batch), forced.compute_logprobs(batch))
    assert len(calls) == 1  # the forced one
    assert auto._model_tokens == 44 > forced._model_tokens


def test_auto_on_a_gpu_takes_a_plan_only_where_it_saves_real_arithmetic(tiny_model):
    """A second forward and backward cost their launches: on a GPU a small model's are
    launch-bound. The decision reads the device's type only, so it is checked on a CPU."""
    eng = engine(tiny_model)
    v = grouped_batch().values
    mb, select = {k: v[k] for k in ("input_ids", "attention_mask")}, v["loss_mask"]
    assert eng._shared_prefix_plan(eng.model, mb, select) is not None  # CPU: fewer tokens
    eng.device = torch.device("cuda")
    assert eng._shared_prefix_plan(eng.model, mb, select) is None  # tiny: launch-bound
    plan = plan_prefixes(v["input_ids"], v["attention_mask"], select, split_suffixes=False)
    saved = int(v["attention_mask"].any(0).sum()) * len(v["attention_mask"]) - plan.padded_tokens
    eng._n_params = math.ceil(GPU_SHARED_PREFIX_FLOPS / (6 * saved))  # a larger model
    assert eng._shared_prefix_plan(eng.model, mb, select) is not None
    eng._n_params -= 1
    assert eng._shared_prefix_plan(eng.model, mb, select) is None


def test_a_run_with_shared_prefix_trains(tmp_path, tiny_model, monkeypatch):
    from nexrl.config import load_config
    from nexrl.controller import NexRLController

    calls = spy(monkeypatch)
    controller = NexRLController(
        load_config(
            [
                f"model_path={tiny_model}",
                f"run_dir={tmp_path / 'run'}",
                "train_worker.engine.shared_prefix=true",
                "train_worker.total_train_steps=2",
                "rollout_worker.group_size=4",
                "trajectory_pool.batch_size=8",
                "validate.validate_before_train=false",
                "validate.data.max_items=4",
                "logger.backend=[jsonl]",
            ]
        )
    )
    try:
        controller.run()
    finally:
        controller.shutdown()
    assert len(calls) >= 2  # every train step took the shared path


@pytest.mark.parametrize("shared", [True, False])
def test_masks_built_here_give_the_logprobs_of_transformers_own(tiny_model, monkeypatch, shared):
    """Padded batches under SDPA get 4D masks from `nexrl.training.masks` (prefix, suffix
    after a cache, plain forward); transformers' own 2D-mask construction must agree."""
    from nexrl.training import masks, torch_engine

    built = []
    real = masks.causal_padding_mask
    monkeypatch.setattr(masks, "causal_padding_mask", lambda *a: built.append(a) or real(*a))
    batch = grouped_batch()
    eng = engine(tiny_model, shared_prefix=shared)
    ours = eng.compute_logprobs(batch)
    assert built  # the dense path ran
    monkeypatch.setattr(torch_engine, "dense_masks_apply", lambda model: False)
    ref = eng.compute_logprobs(batch)
    mask = batch.values["loss_mask"].bool()
    torch.testing.assert_close(ours[mask], ref[mask], atol=1e-6, rtol=1e-6)


def test_dense_mask_equals_transformers_mask_on_real_queries(tiny_model):
    from transformers import AutoConfig
    from transformers.masking_utils import create_causal_mask

    from nexrl.training.masks import causal_padding_mask

    config = AutoConfig.from_pretrained(tiny_model)
    config._attn_implementation = "sdpa"
    key_mask = torch.tensor([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]])
    # transformers 5 renamed input_embeds / past_key_values and dropped cache_position
    params = inspect.signature(create_causal_mask).parameters
    embeds = "inputs_embeds" if "inputs_embeds" in params else "input_embeds"
    cache = "cache" if "cache" in params else "past_key_values"
    kwargs = {embeds: torch.zeros(3, 5, 1), cache: None}
    if "cache_position" in params:
        kwargs["cache_position"] = torch.arange(5)
    theirs = create_causal_mask(config=config, attention_mask=key_mask, position_ids=None, **kwargs)
    ours = causal_padding_mask(key_mask, 5)
    real = key_mask.bool()[:, None, :, None].expand_as(ours)
    assert torch.equal(ours[real], theirs[real])
    assert ours.any(-1).all()  # every query, padding too, sees at least itself
