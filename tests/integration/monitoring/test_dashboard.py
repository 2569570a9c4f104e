"""The live status page: its JSON over real HTTP, and the page in real headless Chromium.

The browser test runs a real short training in a thread with a `Dashboard` on its
tracker and run directory, and reads what Chromium renders while the run goes on.
It fails (never skips) without Chromium: CI installs it in `.ci/run`.
"""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from nexrl.config import load_config
from nexrl.monitoring.activity import ActivityTracker
from nexrl.monitoring.dashboard import Dashboard, MetricsTail, pipeline_state_fn

CHROMIUM_FLAGS = (
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--disable-dev-shm-usage",
    "--window-size=1400,1000",
)


def _get_json(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=10) as resp:
        return json.load(resp)


def _write(path: Path, *rows: dict) -> None:
    with path.open("a") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


@pytest.fixture
def tracker():
    t = ActivityTracker({"logger": {"backend": []}})
    yield t
    t.close()


def test_metrics_tail_reads_new_lines_once_and_rereads_a_rewritten_file(tmp_path):
    path = tmp_path / "metrics.jsonl"
    tail = MetricsTail(path)
    tail.poll()  # no file yet: nothing, no error
    _write(path, {"step": 1, "reward/mean": 0.25, "staleness/histogram": {"0": 16}})
    with path.open("a") as f:
        f.write('{"step": 2, "reward/me')  # a line still being written
    tail.poll()
    tail.poll()
    snap = tail.snapshot()
    assert snap["series"]["reward"] == [[1, 0.25]]
    assert snap["staleness"] == {"step": 1, "histogram": {"0": 16}}
    with path.open("a") as f:
        f.write('an": 0.5, "val/reward": 0.75, "throughput/samples_per_s": 3.0}\n')
    tail.poll()
    snap = tail.snapshot()
    assert snap["series"] == {
        "reward": [[1, 0.25], [2, 0.5]],
        "validation": [[2, 0.75]],
        "throughput": [[2, 3.0]],
    }
    path.write_text(json.dumps({"step": 1, "reward/mean": 0.1}) + "\n")  # resume truncation
    tail.poll()
    assert tail.snapshot()["series"]["reward"] == [[1, 0.1]]


def test_status_endpoint_shows_tracker_metrics_and_pipeline(tmp_path, tracker):
    _write(tmp_path / "metrics.jsonl", {"step": 3, "reward/mean": 0.5})
    tracker.set_training_step(3)
    tracker.increment("tasks_trained", 7)
    token = tracker.start("rollout_worker_1", "generate")
    tracker.start("train_worker_0", "train_step")
    tracker.report_error("validator", "validate", "reward fn raised")
    tracker.end(token)
    tracker.start("rollout_worker_0", "generate")
    dash = Dashboard(tracker, tmp_path, state_fn=lambda: {"trajectory_pool_ready": 5})
    url = dash.start()
    try:
        assert url.startswith("http://127.0.0.1:")
        status = _get_json(url + "api/status")
        page = urllib.request.urlopen(url, timeout=10).read().decode()
    finally:
        dash.stop()
    assert status["step"] == 3
    assert status["counters"] == {"tasks_trained": 7}
    assert status["inflight_per_module"] == {"train_worker_0": 1, "rollout_worker_0": 1}
    assert status["rollout_workers_busy"] == 1
    assert status["pipeline"] == {"trajectory_pool_ready": 5}
    assert status["series"]["reward"] == [[3, 0.5]]
    assert status["health"]["status"] == "error"
    assert [e["message"] for e in status["errors"]] == ["reward fn raised"]
    assert "/api/status" in page and "<script>" in page
    assert "src=" not in page and "<link" not in page  # self-contained: nothing fetched but JSON
    with pytest.raises(urllib.error.URLError):  # stopped: the port is released
        urllib.request.urlopen(url, timeout=2)


def test_non_loopback_host_and_bad_port_are_refused(tmp_path, tracker):
    with pytest.raises(ValueError, match="dashboard.host"):
        Dashboard(tracker, tmp_path, host="0.0.0.0")
    with pytest.raises(ValueError, match="dashboard.port"):
        Dashboard(tracker, tmp_path, port=70000)


@pytest.fixture
def short_run_config(tmp_path, tiny_model_path):
    """A few-second local run on the built-in task (as tests/integration/core's small_config)."""
    return load_config(
        [
            f"output_dir={tmp_path / 'out'}",
            f"model_path={tiny_model_path}",
            "rollout_worker.group_size=4",
            "rollout_worker.max_tokens=4",
            "rollout_worker.num_workers=2",
            "trajectory_pool.batch_size=16",
            "train_worker.total_train_steps=6",
            "train_worker.save_freq=100",
            "weight.validate_freq=3",
            "validate.data.max_items=8",
            "logger.backend=[jsonl]",
        ]
    )


def _chromium_driver(tmp_path: Path):
    binary, driver_path = shutil.which("chromium"), shutil.which("chromedriver")
    if binary is None or driver_path is None:
        pytest.fail(
            "the dashboard browser test needs Debian's chromium and chromium-driver: "
            "apt-get install -y chromium chromium-driver (.ci/run installs them)"
        )
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in CHROMIUM_FLAGS:
        options.add_argument(flag)
    options.add_argument(f"--user-data-dir={tmp_path / 'chromium-profile'}")
    return webdriver.Chrome(service=Service(executable_path=driver_path), options=options)


def _page_state(driver) -> dict:
    return driver.execute_script(
        """
        const rows = [...document.querySelectorAll('#counters tr')].map(
            tr => [...tr.cells].map(c => c.textContent));
        return {
            step: Number(document.getElementById('step').textContent),
            conn: document.getElementById('conn').textContent,
            reward_points: Number(document.getElementById('chart-reward').dataset.points),
            reward_paths: document.querySelectorAll('#chart-reward path').length,
            val_points: Number(document.getElementById('chart-validation').dataset.points),
            counters: rows,
            pipeline: document.getElementById('pipeline').textContent,
        };
        """
    )


def _wait_for_page(driver, what: str, ok, timeout: float, alive=lambda: True) -> dict:
    """Poll the rendered page until `ok(state)`; fail naming `what` and the last state seen
    (3 s after `alive()` turns false: the run ended without the page showing it)."""
    deadline = time.monotonic() + timeout
    while True:
        state = _page_state(driver)
        if ok(state):
            return state
        if not alive():  # the page polls every second: give it a last few polls
            deadline = min(deadline, time.monotonic() + 3)
        if time.monotonic() > deadline:
            pytest.fail(f"the page never showed {what}; last rendered state: {state}")
        time.sleep(0.25)


@pytest.mark.slow
def test_page_in_headless_chromium_follows_a_real_training_run(short_run_config, tmp_path):
    from nexrl.controller import NexRLController

    driver = _chromium_driver(tmp_path)  # first: without Chromium, fail before any run
    controller = NexRLController(short_run_config)
    dash = Dashboard(
        controller.activity_tracker, controller.run_dir, pipeline_state_fn(controller.system)
    )
    url = dash.start()
    errors: list[BaseException] = []

    def train() -> None:
        try:
            controller.run()
        except BaseException as exc:  # re-raised in the test's thread below
            errors.append(exc)

    try:
        driver.get(url)
        before = _wait_for_page(
            driver, "a live connection", lambda st: st["conn"].startswith("live"), 60
        )
        assert before["step"] == 0 and before["reward_points"] == 0
        trainer = threading.Thread(target=train, name="train", daemon=True)
        trainer.start()
        during = _wait_for_page(
            driver,
            "step >= 2 with >= 2 reward points during the run",
            lambda st: st["step"] >= 2 and st["reward_points"] >= 2,
            300,
            alive=trainer.is_alive,
        )
        shot = os.environ.get("NEXRL_DASHBOARD_SCREENSHOT")  # docs/dashboard.png is made so
        if shot:
            Path(shot).write_bytes(driver.get_screenshot_as_png())
        trainer.join(timeout=300)
        assert not trainer.is_alive() and not errors, errors
        final = _wait_for_page(
            driver,
            "the final step 6 and a validation point",
            lambda st: st["val_points"] >= 1 and st["step"] == 6,
            30,
        )
    finally:
        driver.quit()
        dash.stop()
        controller.shutdown()
    assert during["reward_paths"] == 1
    assert "trajectory_pool_ready" in final["pipeline"]
    assert "admission.outstanding" in final["pipeline"]
    counters = {name: int(value) for name, value in final["counters"]}
    assert counters["tasks_trained"] > 0
    assert final["reward_points"] == 6
