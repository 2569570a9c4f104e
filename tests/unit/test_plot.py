"""`nexrl plot`: PNGs from a metrics.jsonl written here, through the CLI."""

from __future__ import annotations

import json

import pytest

from nexrl.cli import main
from nexrl.plot import plot_run, read_metrics

pytest.importorskip("matplotlib")


def _write_run(run_dir, steps=12) -> None:
    lines = [{"step": 0, "val/reward": 0.0}]
    for s in range(1, steps + 1):
        lines.append(
            {
                "step": s,
                "time": 1.7e9 + s,
                "reward/mean": s / steps,
                "reward/max": 1.0,
                "reward/min": 0.0,
                "staleness/mean": 0.5,
                "staleness/max": 1,
                "staleness/histogram": {"0": 4, "1": 4},
                "throughput/tokens_per_s": 1000.0 + s,
                "throughput/samples_per_s": 50.0,
            }
        )
        if s % 4 == 0:
            lines.append({"step": s, "val/reward": s / steps})
    lines.append({"step": 3, "reward/mean": 0.9})  # resumed run re-logs step 3: last wins
    text = "\n".join(json.dumps(x) for x in lines) + '\n{"step": 13, "rew'  # half-written
    (run_dir / "metrics.jsonl").write_text(text)


def test_read_metrics_sorted_last_value_wins_and_skips_a_partial_last_line(tmp_path) -> None:
    _write_run(tmp_path)
    series = read_metrics(tmp_path / "metrics.jsonl")
    assert series["val/reward"] == [(0, 0.0), (4, 4 / 12), (8, 8 / 12), (12, 1.0)]
    assert series["reward/mean"][2] == (3, 0.9)
    assert not {"staleness/histogram", "step", "time"} & set(series)


def test_bad_lines_name_the_file_and_line(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:2: not a JSON object"):
        read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"reward/mean": 1}\n')
    with pytest.raises(ValueError, match=r"metrics.jsonl:1: a metrics line without 'step'"):
        read_metrics(tmp_path / "metrics.jsonl")


def test_plot_run_writes_one_png_per_panel_and_an_overview(tmp_path) -> None:
    from PIL import Image

    _write_run(tmp_path)
    paths = plot_run(tmp_path)
    names = [p.name for p in paths]
    assert names == [
        "reward.png",
        "validation.png",
        "staleness.png",
        "throughput.png",
        "overview.png",
    ]
    for path in paths:
        with Image.open(path) as image:
            assert image.format == "PNG" and image.size[0] >= 500
            assert len(image.convert("L").getcolors(maxcolors=65536)) > 10  # not a blank canvas


def test_panels_without_data_are_skipped(tmp_path) -> None:
    (tmp_path / "metrics.jsonl").write_text('{"step": 0, "val/reward": 0.5}\n')
    assert [p.name for p in plot_run(tmp_path, tmp_path / "out")] == [
        "validation.png",
        "overview.png",
    ]


def test_cli_plot(tmp_path, capsys) -> None:
    _write_run(tmp_path)
    assert main(["plot", str(tmp_path), "--out", str(tmp_path / "png")]) == 0
    printed = capsys.readouterr().out.split()
    assert printed[-1] == str(tmp_path / "png" / "overview.png")
    assert main(["plot", str(tmp_path / "missing")]) == 2
    assert "no metrics file" in capsys.readouterr().err
