"""Seed 004's `main_grpo` training script, its config loading and its dataset section.

`openai/gsm8k` is read from the `datasets` cache with the Hub offline: the fixture
writes the cache entry a first online download leaves (two rows), so the script keeps
the seed's Hub name and no test touches the network.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import yaml
from omegaconf.errors import ConfigKeyError
from torchdata.stateful_dataloader import StatefulDataLoader

from nexrl.areal import (
    Actor,
    DistributedBatch,
    InferenceEngine,
    LocalScheduler,
    RolloutController,
    TrainController,
    WeightUpdateMeta,
    load_dataset,
    load_expr_config,
    split_dataset_by_node,
)
from tests.seeds.test_seed004_workflows import MyRolloutWorkflow

GSM8K = {
    "question": ["What is 1+1?", "What is 2+2?", "What is 3+3?", "What is 4+4?"],
    "answer": ["#### 2", "#### 4", "#### 6", "#### 8"],
}


@pytest.fixture
def gsm8k_cache(tmp_path, monkeypatch):
    """`openai/gsm8k` (config `main`) in a fresh datasets cache, the Hub offline."""
    import datasets

    cache = tmp_path / "hf_datasets"
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", cache)
    monkeypatch.setenv("HF_DATASETS_CACHE", str(cache))
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_dict(GSM8K).to_parquet(str(parquet))
    built = datasets.load_dataset("parquet", data_files={"train": str(parquet)}, split="train")
    src = Path(built.cache_files[0]["filename"]).parent
    dst = cache / "openai___gsm8k" / "main" / src.parent.name / src.name
    shutil.copytree(src, dst)
    for f in dst.glob("parquet-*"):
        f.rename(f.with_name(f.name.replace("parquet-", "gsm8k-")))
    info = json.loads((dst / "dataset_info.json").read_text())
    info.update(config_name="main", dataset_name="gsm8k")
    (dst / "dataset_info.json").write_text(json.dumps(info))
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    return cache


def write_config(tmp_path, model: str) -> str:
    cfg = {
        "rollout": {"engine": {"path": model, "engine": {"max_batch_size": 8}}},
        "training": {
            "actor": {"path": model, "engine": {"lr": 1e-7}},
            "ref": {"path": model},
            "epochs": 1,
            "batch_size": 2,
        },
    }
    path = tmp_path / "my_config.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


@pytest.mark.slow
def test_main_grpo_as_written(gsm8k_cache, time_model_path, tmp_path, capsys):
    argv = ["--config", write_config(tmp_path, time_model_path), "rollout.workflow.num_turns=1"]
    wcfg = WeightUpdateMeta(
        type="disk", path=str(tmp_path / "sync"), alloc_mode=None, comm_backend=None
    )

    # ---- the seed's main_grpo ----
    dataset = load_dataset("openai/gsm8k", "main", split="train")  # CHANGED: config "main"
    rollout_config, training_config = load_expr_config(argv)

    # Single-controller mode initialization
    scheduler = LocalScheduler()  # CHANGED: SlurmScheduler; nexrl spans machines with Ray
    rollout = RolloutController(
        InferenceEngine(rollout_config.engine),  # CHANGED: SGLangEngine
        rollout_config.controller,
        scheduler,
    )
    actor = TrainController(
        Actor(training_config.actor),  # CHANGED: MegatronGRPOActor
        training_config.training_controller_config,  # CHANGED: `config.` is undefined
        scheduler,
    )
    ref = TrainController(
        Actor(training_config.ref),
        training_config.training_controller_config,
        scheduler,
    )

    rollout.initialize()
    actor.initialize()
    ref.initialize()

    # Synchronous RL
    # CHANGED: StatefulDataLoader (the seed's dataset section spells it so) with its options
    dataloader = StatefulDataLoader(
        dataset, batch_size=training_config.batch_size, collate_fn=lambda x: x
    )
    steps_per_epoch = len(dataloader)  # FILLED: undefined in the seed
    for _epoch in range(training_config.epochs):  # CHANGED: `config.epoches` is undefined
        data_generator = iter(dataloader)
        for _ in range(steps_per_epoch):
            prompt = next(data_generator)
            batch = {}  # CHANGED: the seed indexes `batch` without creating it

            # Update inference engine weights
            future = rollout.update_weights(wcfg)
            actor.upload_weights(wcfg)
            future.result()

            # synchronous rollout
            rollout_batch = rollout.rollout_batch(
                prompt, workflow=MyRolloutWorkflow(rollout_config.workflow)
            )
            # or asynchronous rollout with filtering and off-policyness control
            accepted = rollout.prepare_batch(
                dataloader,
                workflow=MyRolloutWorkflow(rollout_config.workflow),
                should_accept=lambda x: x["rewards"].mean() > 0,
            )

            # In the single-controller mode
            rollout_batch: DistributedBatch
            x = rollout_batch.load_data()

            batch["input_ids"] = rollout_batch["input_ids"]
            batch["rewards"] = rollout_batch["rewards"]
            for key in ("attention_mask", "loss_mask", "logprobs"):  # FILLED: the seed's `...`
                batch[key] = x[key]

            # prepare train inputs
            batch["ref_logp"] = ref.compute_logp(batch)
            adv_batch = actor.compute_advantages_and_returns(batch)
            batch["advantages"] = adv_batch["advantages"]

            # PPO update
            stats = actor.ppo_update(batch)
            print(stats)
    # ---- end of the seed's script ----

    try:
        assert len(accepted["rewards"]) == training_config.batch_size
        assert rollout.version == 1  # the second step's update carried train step 1
        assert actor.engine.engine.step == 2  # controller -> Actor -> torch engine
        assert capsys.readouterr().out.count("'grad_norm'") == 2
        assert batch["ref_logp"].shape == batch["input_ids"].shape
    finally:
        rollout.destroy()


def test_workflow_config_is_typed_and_other_sections_are_checked(tmp_path):
    rollout, training = load_expr_config(["rollout.workflow.x=1", "rollout.workflow.name=abc"])
    assert rollout.workflow.x == 1 and rollout.workflow.name == "abc"
    assert training.actor.ppo_n_minibatches == 1
    with pytest.raises(ConfigKeyError, match="max_concurent"):
        load_expr_config(["rollout.engine.max_concurent=3"])
    with pytest.raises(ValueError, match="unrecognised"):
        load_expr_config(["--cfg", "x.yaml"])


# ---- the seed's "Dataset" section ------------------------------------------------------------
def test_the_dataset_section_runs_on_the_cached_hub_dataset(gsm8k_cache):
    path, name, split, data_files = "openai/gsm8k", "main", "train", None
    rank, world_size, reward_mode, batch_size = 1, 2, "math", 1

    dataset = load_dataset(
        path,
        name=name,
        split=split,
        data_files=data_files,
    )
    dataset = split_dataset_by_node(dataset, rank=rank, world_size=world_size)

    # Access the first data item
    data: dict = dataset[0]

    # Access the "prompt" column
    # CHANGED: the seed reads data["prompt"] before its map below creates the column
    data: list = dataset["question"]

    # Data processing
    def process_example(example, idx):
        # Add query_id column
        example["query_id"] = str(idx)
        example["prompt"] = example["question"]

        # used by the reward function
        example["method"] = reward_mode
        return example

    dataset = dataset.map(
        lambda example, idx: process_example(example, idx),
        with_indices=True,
    )

    # Data loading and shuffle
    dataloader = StatefulDataLoader(
        dataset=dataset,
        batch_size=batch_size,
        shuffle=True,
        drop_last=True,
        collate_fn=lambda x: (
            x
        ),  # Can change the data batch packing method by changing this parameter
    )
    rows = []
    for data in dataloader:
        assert isinstance(data, list)
        rows += data
    # rank 1 of 2 holds the second contiguous half (`datasets` shards a table contiguously)
    assert sorted(r["prompt"] for r in rows) == ["What is 3+3?", "What is 4+4?"]
    assert {r["method"] for r in rows} == {"math"}


def test_a_hub_name_missing_from_the_offline_cache_fails_in_one_line(gsm8k_cache):
    with pytest.raises(ValueError, match=r"'openai/no_such'.*datasets cache \(offline mode\)"):
        load_dataset("openai/no_such", split="train")


def test_the_run_loader_takes_a_hub_name(gsm8k_cache):
    from nexrl.data import HFDataLoader

    loader = HFDataLoader({"path": "openai/gsm8k", "prompt_key": "question", "shuffle": False})
    assert len(loader) == 4 and loader.get_next_item()["question"] == "What is 1+1?"
    with pytest.raises(ValueError, match="'openai/nothing_here'.*offline"):
        HFDataLoader({"path": "openai/nothing_here", "prompt_key": "question"})


def add_query_id(example, idx):
    return {**example, "query_id": str(idx), "prompt": example["question"]}


def test_prepare_dataset_maps_then_keeps_the_ranks_share(gsm8k_cache):
    from nexrl.data.hub import prepare_dataset

    spec = f"{__name__}:add_query_id"
    ds = prepare_dataset("openai/gsm8k", "main", map_fn=spec, rank=0, world_size=2)
    assert ds["query_id"] == ["0", "1"] and ds["prompt"] == GSM8K["question"][:2]
    with pytest.raises(ValueError, match="no function 'missing'"):
        prepare_dataset("openai/gsm8k", "main", map_fn=f"{__name__}:missing")
    with pytest.raises(ValueError, match="outside world_size"):
        prepare_dataset("openai/gsm8k", "main", rank=2, world_size=2)
