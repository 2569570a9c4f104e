"""What every benchmark result names: the machine (CPU model, cores, GPU) and the command.

Figures from different machines are not comparable (AVX-512 alone moves the engine
ratio from 3x to 5x), so every results file starts with `describe()`.
"""

from __future__ import annotations

import argparse
import os
import platform
import shlex
import subprocess
import sys
import time
from pathlib import Path


def cpu_model() -> str:
    """`lscpu`'s model name (falls back to `platform.processor()`)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return platform.processor() or "unknown CPU"


MATMUL_FLAGS = ("avx2", "avx512f", "avx512_bf16", "amx_bf16")
"""CPU flags that decide which matmul kernels oneDNN / MKL can use (bf16 needs the last two)."""


def cpu_flags() -> list[str]:
    """The `MATMUL_FLAGS` this CPU has (from /proc/cpuinfo; empty where unreadable)."""
    try:
        with open("/proc/cpuinfo") as f:
            line = next((ln for ln in f if ln.startswith("flags")), "")
    except OSError:
        return []
    have = set(line.split(":", 1)[-1].split())
    return [flag for flag in MATMUL_FLAGS if flag in have]


def gpu_name() -> str | None:
    import torch

    return torch.cuda.get_device_name(0) if torch.cuda.is_available() else None


def machine() -> dict[str, object]:
    return {"cpu": cpu_model(), "cores": os.cpu_count(), "flags": cpu_flags(), "gpu": gpu_name()}


def command() -> str:
    return "python " + shlex.join(sys.argv)


def record() -> dict[str, object]:
    """The fields every JSON results file starts with: `machine()` and `command()`."""
    return {"machine": machine(), "command": command()}


def describe() -> str:
    """Markdown lines: machine and the command that produced the figures."""
    m = machine()
    gpu = f", GPU: {m['gpu']}" if m["gpu"] else ""
    flags = f" ({' '.join(m['flags'])})" if m["flags"] else ""
    return f"Machine: {m['cpu']}{flags}, {m['cores']} cores{gpu}\n\nCommand: `{command()}`\n"


def section_head(suffix: str = "") -> list[str]:
    """The first lines of a results section: its UTC time (and `suffix`), then `describe()`."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())
    return [f"## {stamp}{suffix}", "", describe()]


TRACKED_RESULTS = Path(__file__).resolve().parent / "results"
"""The committed results: one current file per benchmark (history is in git)."""
DEFAULT_OUT = Path("bench_results")
"""Where a run writes unless told otherwise (relative to the working directory; git-ignored)."""


def add_out_arguments(parser: argparse.ArgumentParser) -> None:
    """`--out DIR` and `--update-results`: every benchmark writes its results into a folder
    the user chooses, and over the committed files only when asked."""
    parser.add_argument(
        "--out", type=Path, default=None, help=f"results folder (default ./{DEFAULT_OUT})"
    )
    parser.add_argument(
        "--update-results",
        action="store_true",
        help="write the committed files in benchmarks/results/ instead of --out",
    )


def results_dir(args: argparse.Namespace) -> Path:
    """The folder a run writes into (`add_out_arguments`)."""
    if args.update_results:
        return TRACKED_RESULTS
    return args.out or DEFAULT_OUT


def prepend_section(path: Path, title: str, lines: list[str]) -> None:
    """Write `lines` under `title` as the Markdown file `path`: the current result only
    (earlier ones are in git's history of the committed file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join([title, "", *lines]))
