"""An engine whose step latency emulates generation on a separate accelerator.

On a shared CPU, generation and training compete for the same cores, so the
overlap that the asynchronous modes buy on a GPU cluster (generation on the
inference GPUs while the trainer's GPUs train) cannot show. `DelayedEngine`
is the built-in `Engine` with a fixed sleep added to every scheduler step (one
decode step of the whole running batch): a sleeping thread uses no core, so
with `step_delay_s` well above the real step time, generation behaves like a
device with that per-step latency that runs beside the trainer. The tokens,
logprobs and versions are still the real model's. Used by
`benchmarks/bench_async.py` and the partial-rollout tests (it also makes a
request reliably still running when a weight push arrives).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from nexrl.inference.engine import Engine


class DelayedEngine(Engine):
    """`Engine` + `step_delay_s` seconds per scheduler step (see module docstring)."""

    def __init__(self, model_path: str | Path, *, step_delay_s: float = 0.01, **kwargs: Any):
        self.step_delay_s = float(step_delay_s)
        super().__init__(model_path, **kwargs)

    def _step(self) -> None:
        if self.step_delay_s > 0:
            time.sleep(self.step_delay_s)
        super()._step()
