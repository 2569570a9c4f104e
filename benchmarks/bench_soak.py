"""Soak: the default recipe under random SIGKILLs of the run, the engine and the trainer.

    python benchmarks/bench_soak.py              # 24 kills over 1024 items: results/soak.md
    python benchmarks/bench_soak.py --smoke      # 3 kills (one of each) over 128 items

The engine runs behind an OpenAI-compatible server in a process of its own (nexrl's
`ProcessEngine`, as `nexrl serve` runs it, with a restart budget that lasts the whole
soak), and `nexrl train` (the packaged recipe, `resume.mode=auto`, a finite dataset,
a checkpoint every step, the trainer in a child process: what `auto` picks for a
fully-async run; sync, the recipe's mode, keeps it in the run's process) uses it as
its remote backend. Kills, in turn:

- `run`: SIGKILL of the whole `nexrl train` process group; the next start resumes;
- `trainer`: SIGKILL of the run's trainer child; the run must notice, stop with an
  error, and the next start resumes;
- `engine`: SIGKILL of the server's engine process; the server restarts it with the
  last weights and replays the requests in flight; the run goes on.

Each kill comes 1 or 2 logged steps after the run's (re)start, plus a random fraction
of a second. `train_worker.log_trained_uids` records each step's items before its
checkpoint; the items trained are rebuilt as in tests/integration/reliability/
test_exactly_once.py (a segment counts its steps in (its resume step, the next
segment's]) and compared with the dataset. Last line: `soak_lost_duplicated: L D`.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
from _machine import prepend_section, section_head

ROOT = Path(__file__).resolve().parents[1]
TITLE = "# Soak: random kills of the run, the engine and the trainer"
KINDS = ("run", "trainer", "engine")
RESUMED = re.compile(r"resumed from (\S+) at step (\d+)")
STEP_LINE = re.compile(r"^step (\d+)/", flags=re.M)
SERVER = """
import signal, sys, uvicorn
from nexrl.inference.process_engine import ProcessEngine
from nexrl.inference.server import create_app
from nexrl.models.tiny import default_model_path
engine = ProcessEngine(default_model_path(), max_restarts=1000, restart_window_s=60,
                       health_interval_s=1.0, health_timeout_s=20.0, max_batch_size=256)
def stop(signum, frame):
    raise SystemExit(0)
signal.signal(signal.SIGTERM, stop)
try:
    uvicorn.run(create_app(engine), host="127.0.0.1", port=int(sys.argv[1]), log_level="error")
finally:
    engine.shutdown()
"""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def children(pid: int) -> list[tuple[int, str]]:
    """(pid, command line) of the processes whose parent is `pid` (from /proc)."""
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                cmd = (stat.parent / "cmdline").read_bytes().replace(b"\0", b" ").decode()
                found.append((int(stat.parent.name), cmd))
        except (OSError, IndexError, ValueError):
            continue
    return found


def spawned_child(pid: int) -> int | None:
    """The multiprocessing child of `pid` (the trainer of a run, the engine of a server)."""
    for child, cmd in children(pid):
        if "spawn_main" in cmd:
            return child
    return None


class Soak:
    def __init__(self, items: int, kills: int, seed: int, work: Path) -> None:
        self.items, self.kills, self.rng, self.work = items, kills, random.Random(seed), work
        self.out = work / "out"
        self.port = free_port()
        self.env = {**os.environ, "PYTHONPATH": str(ROOT), "PYTHONUNBUFFERED": "1"}
        self.segments: list[tuple[int, int]] = []  # (resume step, first trained.jsonl line)
        self.figures: Counter = Counter()
        self.proc: subprocess.Popen | None = None
        self.log: Path | None = None
        self.attempt = 0

    # -- processes ----------------------------------------------------------------------
    def start_server(self) -> None:
        cmd = [sys.executable, "-c", SERVER, str(self.port)]
        log = (self.work / "server.log").open("w")
        self.server = subprocess.Popen(
            cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
        )
        end = time.monotonic() + 180
        while time.monotonic() < end:
            try:
                if httpx.get(f"http://127.0.0.1:{self.port}/health").status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.5)
        raise SystemExit(
            "the engine server did not start:\n" + (self.work / "server.log").read_text()
        )

    def start_run(self) -> None:
        run = self.run_dir()
        lines = len((run / "trained.jsonl").read_text().splitlines()) if run else 0
        self.log = self.work / f"attempt{self.attempt}.log"
        self.attempt += 1
        args = [
            "train",
            f"output_dir={self.out}",
            "resume.mode=auto",
            f"data.max_items={self.items}",
            "data.num_epochs=1",
            "train_worker.save_freq=1",
            "train_worker.log_trained_uids=true",
            "weight.validate_freq=0",
            "validate.validate_before_train=false",
            "service.inference_service.backend=remote",
            f"service.inference_service.url=http://127.0.0.1:{self.port}",
            "service.train_service.backend=process",  # a trainer process to kill
        ]
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "nexrl.cli", *args],
            stdout=self.log.open("w"),
            stderr=subprocess.STDOUT,
            env=self.env,
            start_new_session=True,
        )
        self.segments.append((-1, lines))  # the resume step is read once it is logged

    def stop_all(self) -> None:
        for proc in (self.proc, getattr(self, "server", None)):
            if proc is not None and proc.poll() is None:
                if proc is self.server:  # the server alone: it stops its engine itself
                    os.kill(proc.pid, signal.SIGTERM)
                else:
                    os.killpg(proc.pid, signal.SIGKILL)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()

    # -- what the run logged ------------------------------------------------------------
    def run_dir(self) -> Path | None:
        runs = sorted(self.out.glob("*/*/config.yaml"))
        self.figures["run_folders"] = len(runs)  # 1: every start continued the same run
        return runs[-1].parent if runs else None

    def text(self) -> str:
        return self.log.read_text() if self.log and self.log.exists() else ""

    def resume_step(self) -> int | None:
        """The step the current run started from (0: a fresh run), once logged."""
        found = RESUMED.search(self.text())
        if found:
            return int(found.group(2))
        return 0 if STEP_LINE.search(self.text()) else None  # a fresh start

    def latest_step(self) -> int:
        steps = STEP_LINE.findall(self.text())
        return int(steps[-1]) if steps else 0

    # -- the soak -----------------------------------------------------------------------
    def wait_for_step(self, target: int, limit: float = 600) -> bool:
        """True once step `target` is logged; False if the run ended first."""
        end = time.monotonic() + limit
        while self.latest_step() < target:
            if self.proc.poll() is not None:
                return False
            if time.monotonic() > end:
                raise SystemExit(f"no step {target} within {limit:g} s:\n{self.text()[-3000:]}")
            time.sleep(0.05)
        return True

    def kill(self, kind: str) -> None:
        if kind == "run":
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()
        elif kind == "trainer":
            child = spawned_child(self.proc.pid)
            if child is None:
                raise SystemExit("the run has no trainer child (service.train_service.backend?)")
            os.kill(child, signal.SIGKILL)
            try:  # the run must notice and stop by itself
                rc = self.proc.wait(timeout=120)
                self.figures["trainer_kill_stopped_run"] += rc != 0
            except subprocess.TimeoutExpired:
                self.figures["trainer_kill_unnoticed"] += 1
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait()
        else:
            child = spawned_child(self.server.pid)
            if child is None:
                raise SystemExit("the server has no engine process")
            os.kill(child, signal.SIGKILL)
        self.figures[f"kills_{kind}"] += 1

    def run(self) -> dict[str, int]:
        self.start_server()
        done = 0
        while done < self.kills:
            if self.proc is None or self.proc.poll() is not None:
                if self.proc is not None and self.proc.returncode == 0:
                    break  # the data ran out before the kills did
                self.start_run()
            step = self.settle_resume()
            if step is None:
                continue  # ended before its resume was logged: start again
            target = max(step, self.latest_step()) + self.rng.randint(1, 2)
            target = max(target, 2)  # the first checkpoint exists: every start resumes
            if not self.wait_for_step(target):
                continue
            time.sleep(self.rng.uniform(0.0, 0.5))
            if self.proc.poll() is not None:
                continue
            self.kill(KINDS[done % len(KINDS)])
            done += 1
        if self.proc is None or (self.proc.poll() is not None and self.proc.returncode != 0):
            self.start_run()
            self.settle_resume()
        self.figures["final_rc"] = self.proc.wait(timeout=1800)
        return self.count()

    def settle_resume(self) -> int | None:
        end = time.monotonic() + 600
        while (step := self.resume_step()) is None:
            if self.proc.poll() is not None or time.monotonic() > end:
                self.segments.pop()
                return None
            time.sleep(0.05)
        self.segments[-1] = (step, self.segments[-1][1])
        return step

    def count(self) -> dict[str, int]:
        rows = [json.loads(x) for x in (self.run_dir() / "trained.jsonl").read_text().splitlines()]
        trained: dict[int, list[str]] = {}
        segs = self.segments
        for k, (resumed, first) in enumerate(segs):
            last = segs[k + 1][1] if k + 1 < len(segs) else len(rows)
            upto = segs[k + 1][0] if k + 1 < len(segs) else float("inf")
            for row in rows[first:last]:
                if resumed < row["step"] <= upto:
                    trained[row["step"]] = row["uids"]
        counts = Counter(uid for uids in trained.values() for uid in uids)
        dataset = {f"0-{i}" for i in range(self.items)}
        self.figures.update(
            items=self.items,
            trained=len(counts),
            lost=len(dataset - set(counts)),
            duplicated=sum(n > 1 for n in counts.values()),
            steps=len(trained),
            starts=self.attempt,
        )
        return dict(self.figures)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--smoke", action="store_true", help="3 kills over 128 items")
    parser.add_argument("--kills", type=int, default=24)
    parser.add_argument("--items", type=int, default=1024, help="16 per step of the recipe")
    parser.add_argument("--seed", type=int, default=56)
    parser.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = parser.parse_args()
    kills, items = (3, 128) if args.smoke else (args.kills, args.items)
    work = Path(tempfile.mkdtemp(prefix="bench_soak_"))
    soak = Soak(items, kills, args.seed, work)
    start = time.monotonic()
    try:
        figures = soak.run()
    finally:
        soak.stop_all()
    figures["wall_s"] = round(time.monotonic() - start)
    print("soak:", figures)
    if not args.smoke:
        lines = [*section_head(), "", "```", json.dumps(figures), "```", ""]
        prepend_section(Path(args.out) / "soak.md", TITLE, lines)
    print(f"soak_lost_duplicated: {figures['lost']} {figures['duplicated']}")
    ok = figures["lost"] == 0 and figures["duplicated"] == 0 and figures["final_rc"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    raise SystemExit(main())
