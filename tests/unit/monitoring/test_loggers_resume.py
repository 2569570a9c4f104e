"""A resumed run drops the metrics its killed predecessor logged past the checkpoint."""

import json

from nexrl.monitoring.loggers import JsonlBackend


def test_resume_keeps_only_steps_up_to_the_checkpoint(tmp_path):
    lines = [json.dumps({"step": s, "reward/mean": s / 10}) for s in range(1, 6)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    resume = {"resumed": True, "resumed_from": str(tmp_path / "checkpoints" / "global_step_3")}
    backend = JsonlBackend(tmp_path, run_config={"resume": resume})
    backend.log({"reward/mean": 0.4}, step=4)
    backend.close()
    steps = [json.loads(x)["step"] for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4]


def test_a_fresh_run_appends(tmp_path):
    (tmp_path / "metrics.jsonl").write_text(json.dumps({"step": 9}) + "\n")
    backend = JsonlBackend(tmp_path, run_config={"resume": {"resumed": False}})
    backend.log({"x": 1}, step=10)
    backend.close()
    assert len((tmp_path / "metrics.jsonl").read_text().splitlines()) == 2
