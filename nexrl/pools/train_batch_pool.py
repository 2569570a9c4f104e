"""`TrainBatchPool`: FIFO queues of processed batches, one per model tag.

The algorithm processor puts batches (with the name of the update function
the trainer should apply); the train worker takes them in arrival order. The
update function travels in `batch.metadata["update_fn"]` so that `get_batch`
returns a plain `Batch`, as in seed 000.

Config keys (defaults): `max_size` (None: unbounded; else `put_batch` returns
False when that model tag already holds `max_size` batches).
"""

from __future__ import annotations

import threading
from collections import deque

from nexrl.config.schema import TrainBatchPoolConfig
from nexrl.module import NexRLModule
from nexrl.types import DEFAULT_MODEL_TAG, Batch, ModelTag


class TrainBatchPool(NexRLModule):
    def __init__(self, config: TrainBatchPoolConfig | None = None) -> None:
        super().__init__()
        self._max_size = (config or TrainBatchPoolConfig()).max_size
        self._queues: dict[ModelTag, deque[Batch]] = {}
        self._lock = threading.Condition()  # put_batch notifies waiting get_batch calls

    def put_batch(self, batch: Batch, update_fn: str = "default") -> bool:
        """Queue `batch` under `batch.metadata["model_tag"]`; False if that queue is full."""
        tag = batch.metadata.get("model_tag") or DEFAULT_MODEL_TAG
        with self._lock:
            queue = self._queues.setdefault(tag, deque())
            if self._max_size is not None and len(queue) >= self._max_size:
                return False
            batch.metadata["update_fn"] = update_fn
            queue.append(batch)
            self._lock.notify_all()
            return True

    def get_batch(
        self, model: ModelTag | None = DEFAULT_MODEL_TAG, wait_s: float = 0.0
    ) -> Batch | None:
        """The oldest batch of `model` (None: of any model), or None if there is none
        (after waiting up to `wait_s` seconds for one to be put)."""
        with self._lock:
            queue = self._lock.wait_for(lambda: self._queue_of(model), timeout=wait_s)
            return queue.popleft() if queue else None

    def _queue_of(self, model: ModelTag | None) -> deque[Batch] | None:
        """A non-empty queue of `model` (None: of any model), or None."""
        if model is None:
            return next((q for q in self._queues.values() if q), None)
        return self._queues.get(model) or None

    def clear(self) -> None:
        """Drop every queued batch (a Ray rewind to a checkpoint)."""
        with self._lock:
            self._queues.clear()

    def is_empty(self) -> bool:
        with self._lock:
            return not any(self._queues.values())

    def qsize(self, model: ModelTag | None = None) -> int:
        """Batches waiting for `model`, or for all models."""
        with self._lock:
            if model is not None:
                return len(self._queues.get(model, ()))
            return sum(len(q) for q in self._queues.values())
