"""`weight.transport`: pushed weights reach the engine in memory or as files, and the
engine serves exactly the trainer's weights either way."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from nexrl.config import ConfigError, load_config
from nexrl.controller import NexRLController


def _check_engine_serves_trained_weights(controller: NexRLController) -> None:
    trained = controller.system.train_workers[0]._client._engine.model.state_dict()
    engine = controller.system.weight_sync_controller._llm_client._engine
    served = engine.model.state_dict()
    assert engine.version == 4  # every step pushed
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name


@pytest.mark.parametrize("transport", ["auto", "memory", "file"])
@pytest.mark.parametrize("mode", ["sync", "fully-async"])
def test_pushed_weights_are_the_trained_ones(async_config, transport, mode):
    overrides = [f"weight.transport={transport}", f"weight.sync_mode={mode}"]
    overrides.append("service.train_service.backend=builtin")  # its model is read below
    if mode != "sync":
        overrides.append("weight.staleness_threshold=1")
    controller = NexRLController(async_config(*overrides))
    controller.run()
    _check_engine_serves_trained_weights(controller)
    trained = controller.system.train_workers[0]._client._engine.model.state_dict()
    served = controller.system.weight_sync_controller._llm_client._engine.model.state_dict()
    shared = [served[k].data_ptr() == t.data_ptr() for k, t in trained.items()]
    # a sync run in one process: the engine's weights are the trainer's (no second copy)
    assert all(shared) if mode == "sync" and transport != "file" else not any(shared)
    folder = Path(controller.system.train_workers[0]._sync_weight_path)
    written = sorted(folder.glob("*.safetensors")) if folder.exists() else []
    assert bool(written) == (transport == "file")  # in one process: no files


def test_memory_transport_without_an_engine_beside_the_pusher_is_a_config_error(tmp_path):
    replicas = "+ray.inference_replicas={bundles_per_node: [1]}"
    with pytest.raises(ConfigError, match="weight.transport=memory"):
        load_config(
            [f"output_dir={tmp_path}", "launch_mode=ray", "weight.transport=memory", replicas]
        )
    load_config([f"output_dir={tmp_path}", "launch_mode=ray", "weight.transport=memory"])
    with pytest.raises(ConfigError, match="weight.transport=memory"):
        load_config(
            [
                f"output_dir={tmp_path}",
                "weight.transport=memory",
                "service.inference_service.backend=remote",
                "service.inference_service.url=http://127.0.0.1:1",
            ]
        )


def test_a_trainer_in_its_own_process_pushes_what_it_trained(async_config):
    """`service.train_service.backend=process`: the final checkpoint (written by the child
    at the last step) holds exactly the weights the engine serves (through memory; the
    child's export to a folder, what the file transport uses, is a unit test)."""
    from safetensors.torch import load_file

    controller = NexRLController(
        async_config(
            "service.train_service.backend=process",
            "weight.transport=memory",
            "weight.sync_mode=fully-async",
            "weight.staleness_threshold=1",
            "weight.inflight_weight_update=true",
        )
    )
    controller.run()
    worker = controller.system.train_workers[0]
    child = worker._client._engine._proc
    assert not child.is_alive() and child.exitcode == 0  # the run's end stopped it cleanly
    trained: dict[str, torch.Tensor] = {}
    for part in (worker._checkpoint_path / "global_step_4").glob("*.safetensors"):
        trained.update(load_file(part))
    engine = controller.system.weight_sync_controller._llm_client._engine
    served = engine.model.state_dict()
    assert engine.version == 4 and trained
    for name, tensor in trained.items():
        assert torch.equal(served[name], tensor), name


def test_a_default_fully_async_run_trains_in_a_child_process(async_config):
    """`service.train_service.backend: auto` (docs/training.md)."""
    controller = NexRLController(
        async_config("weight.sync_mode=fully-async", "weight.staleness_threshold=1")
    )
    worker = controller.system.train_workers[0]
    controller.run()
    assert worker._client.backend == "process"
    assert worker._client._engine.pid != os.getpid()
    assert controller.final_metrics  # it trained
