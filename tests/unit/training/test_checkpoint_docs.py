"""docs/reliability.md: its Python example runs against a run folder with one bad checkpoint."""

from __future__ import annotations

import json
import re
from pathlib import Path

from nexrl.run_setup import WORKER_STATE_FILE
from nexrl.training.checkpoint import atomic_directory

DOC = Path(__file__).resolve().parents[3] / "docs" / "reliability.md"


def test_reliability_doc_example_runs(tmp_path, monkeypatch, capsys):
    folder = tmp_path / "outputs" / "shift_letters" / "20260101-000000" / "checkpoints"
    for step in (2, 4):
        with atomic_directory(folder / f"global_step_{step}") as staging:
            (staging / "model.safetensors").write_bytes(b"w" * 16)
            (staging / WORKER_STATE_FILE).write_text(json.dumps({"step": step}))
    (folder / "global_step_4" / "model.safetensors").write_bytes(b"w")  # truncated
    blocks = re.findall(r"```python\n(.*?)```", DOC.read_text(), flags=re.S)
    assert blocks
    monkeypatch.chdir(tmp_path)
    for block in blocks:
        exec(compile(block, str(DOC), "exec"), {})
    out = capsys.readouterr().out
    assert "4 model.safetensors has 1 bytes, the manifest says 16" in out
    assert "2 complete" in out
    assert out.strip().endswith("global_step_2")
