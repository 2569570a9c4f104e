import torch

from nexrl.execute import execute, execute_async, resolve
from nexrl.types import Batch, NexRLRole


def padded_batch():
    ids = torch.tensor([[0, 0, 5, 6, 0], [0, 7, 8, 9, 0]])
    return Batch({"input_ids": ids, "mask": (ids != 0).long(), "uid": ["a", "b"]})


def test_batch_len_copy_and_to_dict():
    b = padded_batch()
    assert len(b) == 2 and b.metadata["batch_size"] == 2
    c = b.copy()
    c.values["input_ids"][0, 0] = 42
    assert b.values["input_ids"][0, 0] == 0  # deep copy
    b.metadata["uid"] = "meta wins"
    assert b.to_dict()["uid"] == "meta wins"


def test_remove_redundant_left_and_right_padding():
    b = padded_batch()
    left = Batch.remove_redundant_left_padding(b, 0, fields=["input_ids", "mask"])
    assert left.values["input_ids"].tolist() == [[0, 5, 6, 0], [7, 8, 9, 0]]
    assert left.values["mask"].shape == (2, 4)
    right = Batch.remove_redundant_right_padding(b, 0, fields=["input_ids"])
    assert right.values["input_ids"].tolist() == [[0, 0, 5, 6], [0, 7, 8, 9]]
    capped = Batch.remove_redundant_left_padding(b, 0, max_strip_threshold=0)
    assert capped.values["input_ids"].shape == (2, 5)


def test_from_trajectories_round_trip_and_select():
    trajs = [{"uid": "a", "reward": 1.0}, {"uid": "b", "reward": 0.0, "extra": 3}]
    b = Batch.from_trajectories(trajs, model_tag="m")
    assert b.metadata == {"batch_size": 2, "model_tag": "m"}
    assert b.to_trajectories()[1] == {"uid": "b", "reward": 0.0, "extra": 3}
    assert b.select([1]).values["uid"] == ["b"] and len(b.select([1])) == 1


def test_from_trajectories_of_one_shape_keeps_each_value_under_its_key():
    # same keys, other insertion orders: each value lands in its own column
    trajs = [{"uid": "a", "reward": 1.0, "ids": [1]}, {"ids": [2, 3], "uid": "b", "reward": 0.5}]
    b = Batch.from_trajectories(trajs)
    assert b.values == {"uid": ["a", "b"], "reward": [1.0, 0.5], "ids": [[1], [2, 3]]}
    assert b.to_trajectories() == trajs and len(b) == 2
    assert Batch.from_trajectories([{"uid": "a"}]).values == {"uid": ["a"]}
    assert Batch.from_trajectories([]).values == {} and len(Batch.from_trajectories([])) == 0


def test_nextrainer_split():
    out = padded_batch().to_nextrainer_batch()
    assert set(out["batch"]) == {"input_ids", "mask"} and set(out["non_tensor_batch"]) == {"uid"}


def test_execute_calls_local_functions_directly():
    assert execute(max, 1, 3) == 3
    assert resolve(execute_async(max, 2, 5)) == 5
    assert NexRLRole("rollout_worker") is NexRLRole.ROLLOUT_WORKER
