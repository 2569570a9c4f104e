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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from matplotlib.axes import Axes


@dataclass(frozen=True)
class Panel:
    """One plot: a file name, a title, the metric keys drawn as lines (when present),
    an optional (low, high) pair drawn as a shaded band, and keys on a right-hand axis
    (a second unit)."""

    name: str
    title: str
    keys: tuple[str, ...]
    ylabel: str
    band: tuple[str, str] | None = None
    right: tuple[str, ...] = ()
    integer: bool = False


PANELS = (
    Panel(
        "reward",
        "Train reward (band: min-max)",
        ("reward/mean",),
        "reward",
        band=("reward/min", "reward/max"),
    ),
    Panel("validation", "Validation", ("val/reward",), "reward"),
    Panel(
        "staleness",
        "Staleness (train step - oldest token version; band: min-max)",
        ("staleness/mean",),
        "steps",
        band=("staleness/min", "staleness/max"),
        integer=True,
    ),
    Panel(
        "throughput",
        "Throughput",
        ("throughput/tokens_per_s",),
        "tokens / s",
        right=("throughput/samples_per_s",),
    ),
)


Series = dict[str, list[tuple[int, float]]]
AXES = ("step", "time")  # what every line has: the x-axis and when it was logged


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
            if isinstance(value, int | float) and not isinstance(value, bool) and key not in AXES:
                by_key.setdefault(key, {})[int(row["step"])] = float(value)
    return {key: sorted(points.items()) for key, points in by_key.items()}


def _smooth(values: list[float]) -> list[float]:
    """Trailing moving average over ~2% of the points (noisy per-step series)."""
    window = max(1, len(values) // 50)
    out, total = [], 0.0
    for i, v in enumerate(values):
        total += v - (values[i - window] if i >= window else 0.0)
        out.append(total / min(i + 1, window))
    return out


def _lines(
    ax: Axes, keys: tuple[str, ...], series: Series, colors: Iterator[str], dashed: bool = False
) -> bool:
    drawn = False
    for key in keys:
        points = series.get(key)
        if not points:
            continue
        steps, values = zip(*points, strict=True)
        color = next(colors)
        if len(points) < 30:
            ax.plot(steps, values, "o-", color=color, label=key, markersize=3, linewidth=1.2)
        elif dashed:  # a second axis over the first: the smoothed line only
            ax.plot(steps, _smooth(list(values)), "--", color=color, label=key, linewidth=1.2)
        else:
            ax.plot(steps, values, color=color, alpha=0.3, linewidth=0.8)
            ax.plot(steps, _smooth(list(values)), color=color, label=key, linewidth=1.5)
        drawn = True
    return drawn


def _draw(ax: Axes, panel: Panel, series: Series) -> bool:
    colors = iter(["tab:blue", "tab:orange", "tab:green", "tab:red", "tab:purple"])
    drawn = False
    if panel.band and all(series.get(k) for k in panel.band):
        low, high = (dict(series[k]) for k in panel.band)
        steps = sorted(set(low) & set(high))
        ax.fill_between(
            steps,
            [low[s] for s in steps],
            [high[s] for s in steps],
            color="tab:blue",
            alpha=0.15,
            linewidth=0,
            label=" - ".join(panel.band),
        )
        drawn = True
    drawn = _lines(ax, panel.keys, series, colors) or drawn
    handles, labels = ax.get_legend_handles_labels()
    if panel.right and any(series.get(k) for k in panel.right):
        twin = ax.twinx()
        next(colors)
        _lines(twin, panel.right, series, colors, dashed=True)
        twin.set_ylabel(" / ".join(k.rsplit("/", 1)[-1] for k in panel.right))
        more = twin.get_legend_handles_labels()
        handles, labels = handles + more[0], labels + more[1]
        drawn = True
    ax.set_title(panel.title, fontsize=10)
    ax.set_xlabel("step")
    ax.set_ylabel(panel.ylabel)
    ax.grid(alpha=0.3)
    if panel.integer:
        from matplotlib.ticker import MaxNLocator

        ax.yaxis.set_major_locator(MaxNLocator(integer=True))
        bottom, top = ax.get_ylim()
        ax.set_ylim(min(bottom, -0.5), max(top, 1.5))  # a sync run is all zeros
    if drawn:
        ax.legend(handles, labels, fontsize=8)
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
