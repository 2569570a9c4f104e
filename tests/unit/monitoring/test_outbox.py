"""`Outbox`: calls queued close together travel in one batch; a flush does not wait out
the linger."""

from __future__ import annotations

import time

from nexrl.monitoring import outbox
from nexrl.monitoring.outbox import Outbox


class Recorder:
    """Stands in for the tracker: records each batch it is sent."""

    def __init__(self) -> None:
        self.batches: list[list[tuple]] = []

    def apply(self, calls: list[tuple]) -> None:
        self.batches.append(list(calls))


def test_calls_within_the_linger_share_a_batch_and_a_flush_sends_at_once(monkeypatch):
    monkeypatch.setattr(outbox, "LINGER_S", 5.0)
    central = Recorder()
    box = Outbox(central)
    for n in range(3):  # spaced: without the linger each would go alone
        box.put("increment", "tasks", n)
        time.sleep(0.05)
    t0 = time.monotonic()
    box.flush(timeout=30.0)
    assert time.monotonic() - t0 < 2.5  # not the 5 s linger
    assert central.batches == [[("increment", ("tasks", n), {}) for n in range(3)]]
