import pytest
import torch

from nexrl.algorithms.processor import (
    GRPOProcessor,
    ProcessorContext,
    collate,
    group_index,
    rollout_metrics,
)
from nexrl.config.schema import AlgorithmConfig
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrainBatchPool
from nexrl.types import Batch


def traj(uid, prompt, response, logprobs, reward, version=0):
    return {
        "uid": uid,
        "prompt_ids": prompt,
        "response_ids": response,
        "response_logprobs": logprobs,
        "reward": reward,
        "finish_reason": "stop",
        "model_version": version,
        "token_versions": [version] * len(response),
    }


def test_collate_aligns_response_tensors_with_input_ids():
    trajs = [traj("a", [5, 6], [7], [-0.5], 1.0), traj("a", [5], [8, 9, 10], [-1, -2, -3], 0.0)]
    out = collate(trajs, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 9, 10]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 1, 1]]
    assert out["behavior_logprobs"].tolist() == [[0, 0, -0.5, 0], [0, -1, -2, -3]]


def test_collate_keeps_tool_tokens_out_of_the_loss():
    t = traj("a", [1], [2, 3, 4], [-1, 0, -1], 1.0)
    t["loss_mask"] = [1, 0, 1]
    assert collate([t], 0)["loss_mask"].tolist() == [[0, 1, 0, 1]]


CONTEXT = ProcessorContext(batch_size=0, max_tokens=4, pad_token_id=0)


def test_group_index_follows_first_appearance():
    assert group_index(["b", "a", "b", "c"]).tolist() == [0, 1, 0, 2]


def test_grpo_processor_puts_group_normalised_batch():
    pool = TrainBatchPool()
    proc = GRPOProcessor(AlgorithmConfig(advantage_estimator="grpo"), CONTEXT)
    proc.set_activity_tracker(ActivityTrackerProxy(ActivityTracker({})))
    proc.set_module_references(None, pool)
    trajs = [traj("a", [1], [2], [-1.0], r, version=3) for r in (1.0, 0.0)]
    trajs += [traj("b", [1], [2, 3], [-1.0, -1.0], r) for r in (0.5, 0.5)]
    proc._fit(Batch.from_trajectories(trajs, model_tag="default"), "train")
    out = pool.get_batch("default")
    adv = out.values["advantages"]
    # group a: mean 0.5, std 0.7071 -> +-0.7071 on its one response token; group b: all equal -> 0
    assert torch.allclose(adv[0], torch.tensor([0.0, 0.70710, 0.0]), atol=1e-4)
    assert torch.allclose(adv[1], torch.tensor([0.0, -0.70710, 0.0]), atol=1e-4)
    assert torch.count_nonzero(adv[2:]) == 0
    assert out.metadata["min_token_versions"] == [3, 3, 0, 0]
    assert out.metadata["rollout_metrics"]["reward/mean"] == 0.5


def test_a_processor_not_wired_names_what_is_missing():
    proc = GRPOProcessor(AlgorithmConfig(advantage_estimator="grpo"), CONTEXT)
    trajs = [traj("a", [1], [2], [-1.0], r) for r in (1.0, 0.0)]
    with pytest.raises(RuntimeError, match="algorithm processor: no train batch pool"):
        proc._fit(Batch.from_trajectories(trajs, model_tag="default"), "train")
    with pytest.raises(RuntimeError, match="algorithm processor: no trajectory pool"):
        proc._get_batch(2)


def run_processor(config, trajs, max_tokens=4):
    pool = TrainBatchPool()
    context = ProcessorContext(batch_size=0, max_tokens=max_tokens, pad_token_id=0)
    proc = GRPOProcessor(AlgorithmConfig(advantage_estimator="grpo", **config), context)
    proc.set_activity_tracker(ActivityTrackerProxy(ActivityTracker({})))
    proc.set_module_references(None, pool)
    proc._fit(Batch.from_trajectories(trajs, model_tag="default"), "train")
    return pool.get_batch("default")


def test_overlong_shaping_penalises_the_long_sample():
    # equal raw rewards; only the 4-token response falls in the 2-token overlong buffer
    trajs = [traj("a", [1], [2, 3], [-1.0] * 2, 1.0), traj("a", [1], [2, 3, 4, 5], [-1.0] * 4, 1.0)]
    out = run_processor({"overlong_buffer_len": 2}, trajs, max_tokens=4)
    assert out.values["rewards"].tolist() == [1.0, 0.0]  # 1 + (2 - 4) / 2 * 1.0
    assert out.values["advantages"][0, 1] > 0 > out.values["advantages"][1, 1]


def test_mask_truncated_removes_cut_off_samples_from_the_loss():
    trajs = [traj("a", [1], [2], [-1.0], 1.0), traj("a", [1], [2], [-1.0], 0.0)]
    trajs[1]["finish_reason"] = "length"
    out = run_processor({"mask_truncated": True}, trajs)
    assert out.values["loss_mask"].tolist() == [[0.0, 1.0], [0.0, 0.0]]


def test_kl_in_reward_without_reference_model_names_the_key():
    class NoReference:
        def compute_ref_logprobs(self, batch):
            return None

    pool = TrainBatchPool()
    proc = GRPOProcessor(AlgorithmConfig(kl_in_reward_coef=0.1), CONTEXT)
    proc.set_activity_tracker(ActivityTrackerProxy(ActivityTracker({})))
    proc.set_module_references(None, pool, NoReference())
    trajs = [traj("a", [1], [2], [-1.0], r) for r in (0.0, 1.0)]
    import pytest

    with pytest.raises(ValueError, match="ref_model_path"):
        proc._fit(Batch.from_trajectories(trajs), "train")


def test_collate_pads_rows_and_names_a_ragged_trajectory() -> None:
    rows = [
        {"uid": "a", "prompt_ids": [5, 6], "response_ids": [7], "response_logprobs": [-0.5]},
        {
            "uid": "b",
            "prompt_ids": [5],
            "response_ids": [8, 9, 10],
            "response_logprobs": [-1.0, -2.0, -3.0],
            "loss_mask": [1, 0, 1],
        },
    ]
    out = collate(rows, pad_token_id=0)
    assert out["input_ids"].tolist() == [[5, 6, 7, 0], [5, 8, 9, 10]]
    assert out["attention_mask"].tolist() == [[1, 1, 1, 0], [1, 1, 1, 1]]
    assert out["loss_mask"].tolist() == [[0, 0, 1, 0], [0, 1, 0, 1]]
    assert out["behavior_logprobs"].tolist() == [[0, 0, -0.5, 0], [0, -1.0, -2.0, -3.0]]
    rows[1]["response_logprobs"] = [-1.0]
    with pytest.raises(ValueError, match="uid='b': response_logprobs has 1 entries for 3"):
        collate(rows, pad_token_id=0)


def _collate_row_by_row(rows, pad):
    """The layout `collate` must give, built one row at a time."""
    width = max(len(r["prompt_ids"]) + len(r["response_ids"]) for r in rows)
    out = {"input_ids": [], "attention_mask": [], "loss_mask": [], "behavior_logprobs": []}
    for r in rows:
        p, resp = r["prompt_ids"], r["response_ids"]
        pad_n = width - len(p) - len(resp)
        mask = r.get("loss_mask") or [1.0] * len(resp)
        out["input_ids"].append(p + resp + [pad] * pad_n)
        out["attention_mask"].append([1] * (len(p) + len(resp)) + [0] * pad_n)
        out["loss_mask"].append([0.0] * len(p) + [float(m) for m in mask] + [0.0] * pad_n)
        lps = r["response_logprobs"]
        out["behavior_logprobs"].append([0.0] * len(p) + lps + [0.0] * pad_n)
    return out


def test_collate_equals_a_row_by_row_layout_on_random_batches():
    import random

    rng = random.Random(0)
    for _ in range(40):
        rows = []
        for i in range(rng.randrange(1, 30)):
            resp = [rng.randrange(50) for _ in range(rng.randrange(0, 6))]  # empty ones too
            row = {
                "uid": i // 4,
                "prompt_ids": [rng.randrange(50) for _ in range(rng.randrange(1, 9))],
                "response_ids": resp,
                "response_logprobs": [-rng.random() for _ in resp],
            }
            if rng.random() < 0.5:
                row["loss_mask"] = [rng.choice([0, 1]) for _ in resp]
            rows.append(row)
        got, want = collate(rows, pad_token_id=7), _collate_row_by_row(rows, 7)
        assert got["input_ids"].dtype == torch.long and got["loss_mask"].dtype == torch.float32
        for key, values in want.items():
            assert torch.equal(got[key], torch.tensor(values, dtype=got[key].dtype)), key


def test_batch_metrics_read_columns_where_samples_differ_in_keys():
    rows = [
        {**traj("a", [1], [2, 3], [-1.0, -1.0], 1.0), "scores": {"format": 1.0}},
        {**traj("a", [1], [2], [-1.0], 0.0), "agent_metrics": {"turns": 3, "note": "x"}},
        {**traj("b", [1], [2], [-1.0], 0.5), "scores": {"format": 0.0, "answer": 1}},
    ]
    rows[1]["finish_reason"] = "length"
    columns = Batch.from_trajectories(rows).values
    assert columns["scores"] == [{"format": 1.0}, None, {"format": 0.0, "answer": 1}]
    m = rollout_metrics(columns)
    assert m["reward/format"] == 0.5 and m["reward/answer"] == 1.0
    assert m["agent/turns"] == 3.0 and "agent/note" not in m
    assert m["reward/mean"] == 0.5 and m["response_length/mean"] == 4 / 3
    assert m["response/truncated_frac"] == 1 / 3
    rows[2]["reward"] = None
    with pytest.raises(ValueError, match="task 'b' has no 'reward'"):
        rollout_metrics(Batch.from_trajectories(rows).values)
