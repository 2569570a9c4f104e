"""`nexrl plot RUN_DIR`: PNG curves of a run from its `metrics.jsonl`.

One figure per topic (reward, validation, staleness, throughput) plus an
`overview.png` with the four side by side, written to `RUN_DIR/plots/`. Drawn
with matplotlib's object API on the Agg canvas (no display, no pyplot global
state), so it works on a headless server and while the run is still writing.

A resumed run may log a step twice (the steps after its checkpoint are
re-trained); the last value logged for a step wins, as it is the one the
resumed run continued from.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class Panel:
    """One plot: a file name, a title and the metric keys it draws (when present)."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str


PANELS = (
    Panel("reward", "Train reward", ("reward/mean", "reward/max", "reward/min"), "reward"),
    Panel("validation", "Validation", ("val/reward",), "reward"),
    Panel(
        "staleness",
        "Staleness (train step - oldest token version)",
        ("staleness/mean", "staleness/max", "staleness/min"),
        "steps",
    ),
    Panel(
        "throughput",
        "Throughput",
        ("throughput/tokens_per_s", "throughput/samples_per_s"),
        "per second",
    ),
)


Series = dict[str, list[tuple[int, float]]]


def read_metrics(path: str | Path) -> Series:
    """{metric key: [(step, value), ...] sorted by step} from a metrics.jsonl file."""
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"nexrl plot: no metrics file {path}")
    by_key: dict[str, dict[int, float]] = {}
    lines = path.read_text(encoding="utf-8").splitlines()
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row: dict[str, Any] = json.loads(line)
        except json.JSONDecodeError as exc:
            if number == len(lines):
                break  # a line still being written by a live run
            raise ValueError(f"{path}:{number}: not a JSON object ({exc})") from exc
        if "step" not in row:
            raise ValueError(f"{path}:{number}: a metrics line without 'step'")
        for key, value in row.items():
            if isinstance(value, int | float) and not isinstance(value, bool) and key != "step":
                by_key.setdefault(key, {})[int(row["step"])] = float(value)
    return {key: sorted(points.items()) for key, points in by_key.items()}


def _draw(ax: Any, panel: Panel, series: Series) -> bool:
    drawn = False
    for key in panel.keys:
        points = series.get(key)
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        style = "o-" if len(points) < 30 else "-"
        ax.plot(steps, values, style, label=key, markersize=3, linewidth=1.2)
        drawn = True
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if drawn:
        ax.legend(fontsize=8)
    else:
        ax.text(0.5, 0.5, "not logged", ha="center", va="center", transform=ax.transAxes)
    return drawn


def plot_run(
    run_dir: str | Path, out_dir: str | Path | None = None, panels: Iterable[Panel] = PANELS
) -> list[Path]:
    """Write `<panel>.png` for each panel with data, and `overview.png`; return the paths."""
    from matplotlib.figure import Figure

    run_dir = Path(run_dir)
    series = read_metrics(run_dir / "metrics.jsonl")
    if not series:
        raise ValueError(f"nexrl plot: {run_dir / 'metrics.jsonl'} holds no numeric metric")
    out = Path(out_dir) if out_dir else run_dir / "plots"
    out.mkdir(parents=True, exist_ok=True)
    panels = list(panels)
    written = []
    for panel in panels:
        fig = Figure(figsize=(6, 3.5), layout="constrained")
        if _draw(fig.add_subplot(), panel, series):
            fig.savefig(out / f"{panel.name}.png", dpi=100)
            written.append(out / f"{panel.name}.png")
    fig = Figure(figsize=(11, 7), layout="constrained")
    for i, panel in enumerate(panels):
        _draw(fig.add_subplot(2, (len(panels) + 1) // 2, i + 1), panel, series)
    fig.suptitle(run_dir.name)
    fig.savefig(out / "overview.png", dpi=90)
    return [*written, out / "overview.png"]


def main(argv: list[str] | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(
        prog="nexrl plot", description="PNG plots of a run's metrics.jsonl."
    )
    parser.add_argument("run_dir", help="a run directory (holds metrics.jsonl)")
    parser.add_argument("--out", default=None, help="output folder (default: RUN_DIR/plots)")
    parser.add_argument("--log-level", default="WARNING", help="logging level")
    args = parser.parse_args(argv)
    try:
        paths = plot_run(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as exc:
        print(exc, file=sys.stderr)
        return 2
    except ImportError as exc:
        print(f"nexrl plot needs matplotlib: pip install 'nexrl[plot]' ({exc})", file=sys.stderr)
        return 2
    for path in paths:
        print(path)
    return 0
