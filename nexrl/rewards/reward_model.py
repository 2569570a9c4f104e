"""Sequence-classification reward model (HF `AutoModelForSequenceClassification`).

Rollouts finish one at a time, but a forward pass costs about the same for 1
or 16 sequences on a CPU/GPU, so concurrent calls are gathered: one scorer
thread takes the first waiting request, then waits at most `max_wait_s` for
up to `batch_size` more and scores them in one padded forward.

Score: with one label the raw logit; with several, the softmax probability of
`label_index` (default: the last label, "good" in a bad/good classifier).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import queue
import threading
import time

from nexrl.rewards.calls import RewardDict


class RewardModelScorer:
    """`await rm(prompt, completion, **row)` -> {"reward", "scores"}; also `rm.score(...)`.

    Usage order: build (loads the model), call from any threads/tasks, `close()`.
    `stats` has `forwards` and `max_batch` (how well requests were batched).
    """

    def __init__(
        self,
        model_path: str,
        *,
        batch_size: int = 16,
        max_wait_s: float = 0.01,
        template: str = "{prompt}{completion}",
        label_index: int = -1,
        max_length: int = 1024,
        device: str = "cpu",
    ) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self._torch = torch
        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.model = AutoModelForSequenceClassification.from_pretrained(model_path).to(device)
        self.model.eval()
        if self.tokenizer.pad_token is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        if self.model.config.pad_token_id is None:
            # classification heads pick the last non-pad token; they need to know the pad id
            self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.batch_size, self.max_wait_s = batch_size, max_wait_s
        self.template, self.label_index = template, label_index
        self.max_length, self.device = max_length, device
        self._queue: queue.Queue = queue.Queue()
        self._closed = False
        self.stats = {"forwards": 0, "scored": 0, "max_batch": 0}
        self._thread = threading.Thread(target=self._loop, daemon=True, name="reward-model")
        self._thread.start()

    async def __call__(self, prompt: str, completion: str, **row: object) -> RewardDict:
        reward = await asyncio.wrap_future(self._submit(prompt, completion, row))
        return {"reward": reward, "scores": {"reward_model": reward}}

    def score(self, prompt: str, completion: str, **row: object) -> float:
        """Blocking form."""
        return self._submit(prompt, completion, row).result()

    def close(self) -> None:
        self._closed = True
        self._queue.put(None)
        self._thread.join(timeout=30)

    def _submit(self, prompt: str, completion: str, row: dict) -> concurrent.futures.Future:
        if self._closed:
            raise RuntimeError("RewardModelScorer is closed")
        fut: concurrent.futures.Future = concurrent.futures.Future()
        text = self.template.format(**{**row, "prompt": prompt, "completion": completion})
        self._queue.put((text, fut))
        return fut

    def _gather(self) -> list[tuple[str, concurrent.futures.Future]] | None:
        first = self._queue.get()
        if first is None:
            return None
        batch = [first]
        deadline = time.monotonic() + self.max_wait_s
        while len(batch) < self.batch_size:
            try:
                item = self._queue.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                break
            if item is None:
                self._queue.put(None)  # stop after this batch
                break
            batch.append(item)
        return batch

    def _loop(self) -> None:
        while (batch := self._gather()) is not None:
            try:
                scores = self._forward([text for text, _ in batch])
            except Exception as exc:  # noqa: BLE001 - every waiting caller gets the error
                for _, fut in batch:
                    fut.set_exception(exc)
                continue
            for (_, fut), value in zip(batch, scores, strict=True):
                fut.set_result(value)

    def _forward(self, texts: list[str]) -> list[float]:
        torch = self._torch
        enc = self.tokenizer(
            texts, return_tensors="pt", padding=True, truncation=True, max_length=self.max_length
        ).to(self.device)
        with torch.no_grad():
            logits = self.model(**enc).logits.float()  # (B, num_labels)
        one_label = logits.shape[-1] == 1
        values = logits[:, 0] if one_label else logits.softmax(-1)[:, self.label_index]
        self.stats["forwards"] += 1
        self.stats["scored"] += len(texts)
        self.stats["max_batch"] = max(self.stats["max_batch"], len(texts))
        return values.tolist()
