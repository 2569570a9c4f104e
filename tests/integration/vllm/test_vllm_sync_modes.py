"""Every sync mode end to end with vLLM as the rollout engine (tiny model, 4 steps each):
the staleness bound, the task ledger and the pushed versions, as on the built-in engine."""

from __future__ import annotations

import importlib

import pytest

from nexrl.config import load_config
from nexrl.controller import NexRLController

_modes = importlib.import_module("tests.integration.async.test_async_modes")  # `async`: a keyword
MODES, check_run, train_lines = _modes.MODES, _modes.check_run, _modes.train_lines

pytestmark = [pytest.mark.vllm, pytest.mark.slow, pytest.mark.timeout(1800)]  # a start: 30 s-10 min

VLLM_MODES = {
    "sync": MODES["sync"],
    "batch-async": MODES["batch-async"],
    "fully-async-inflight": MODES["fully-async-inflight"],  # pause keep -> load -> resume
    "fully-async-partial": MODES["fully-async-partial"],  # aborts, continued samples
}


def run(tmp_path, vllm_config, *extra: str, max_tokens: int = 8) -> NexRLController:
    cfg = load_config(
        [
            f"output_dir={tmp_path / 'out'}",
            f"model_path={vllm_config['model']}",
            "rollout_worker.group_size=4",
            f"rollout_worker.max_tokens={max_tokens}",
            "rollout_worker.num_workers=3",
            "trajectory_pool.batch_size=8",
            "train_worker.total_train_steps=4",
            "train_worker.save_freq=0",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
            "logger.backend=[jsonl]",
            "service.inference_service.backend=vllm",
            f"service.inference_service.url={vllm_config['url']}",
            *extra,
        ]
    )
    controller = NexRLController(cfg)
    controller.run()
    return controller


@pytest.mark.parametrize("mode", list(VLLM_MODES))
def test_each_sync_mode_runs_on_vllm(tmp_path, vllm_config, mode):
    controller = run(tmp_path, vllm_config, *VLLM_MODES[mode])
    check_run(controller, mode.split("-partial")[0].split("-inflight")[0])
    lines = train_lines(controller.run_dir)
    assert lines[-1]["rollout/serving_version"] >= 3  # every push reached the server
    client = controller.system.weight_sync_controller._llm_client
    assert client.version == 4  # read back from vLLM (/weight_info)


def test_a_push_aborts_running_requests_and_they_continue_on_the_new_weights(tmp_path, vllm_config):
    """Partial rollout with in-flight updates off: every push aborts the requests vLLM is
    running (no grace; 128-token samples outlast a tiny-model step, so pushes meet them),
    each aborted sample goes on from its prompt and tokens on the new weights, and the
    trained samples record both versions (`rollout/multi_version_frac`)."""
    extra = [*MODES["fully-async-partial"], "weight.inflight_weight_update=false"]
    controller = run(tmp_path, vllm_config, *extra, max_tokens=128)
    check_run(controller, "fully-async")
    counters = controller.activity_tracker.get_counters()
    assert counters["rollout/aborted_groups"] > 0 and counters["rollout/partial_continuations"] > 0
    assert any(x["rollout/multi_version_frac"] > 0 for x in train_lines(controller.run_dir))
    continued = 0  # each worker client's samples: the aborted ones and their continuations
    for worker in controller.system.rollout_workers:
        samples = worker._llm_client.recent_samples()  # in the order they came back
        for i, cut in enumerate(samples):
            if cut["finish_reason"] != "abort" or not cut["response_ids"]:
                continue  # a cut with no tokens has the prompt as its prefix: not a marker
            prefix = cut["prompt_ids"] + cut["response_ids"]
            after = [s for s in samples[i + 1 :] if s["prompt_ids"] == prefix]
            continued += len(after)
            # a continuation sent while the push is under way waits for the new weights but
            # is labelled with the version it was sent on (staleness over-, never under-stated)
            assert all(s["model_version"] >= cut["model_version"] for s in after), (cut, after)
    assert continued > 0
