"""The running batch's kind counts (what lets a step skip the work no row needs) stay
equal to a row-by-row count through any order of adds and compactions."""

from __future__ import annotations

import random
from concurrent.futures import Future

from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.inference.sampler import StopChecker, sample_generator
from nexrl.inference.scheduler import _KINDS, Pending, Row, RunningBatch


def _request_rows(rng: random.Random) -> list[Row]:
    seed = rng.choice([None, 7])
    params = SamplingParams(
        max_new_tokens=4,
        n=rng.randint(1, 4),
        temperature=rng.choice([0.0, 1.0, 0.7]),
        top_k=rng.choice([-1, 5]),
        top_p=rng.choice([1.0, 0.9]),
        seed=seed,
    )
    stop = StopChecker(None, rng.choice([[], ["."]]))
    on_token = rng.choice([None, lambda *token: None])
    pending = Pending(GenerationRequest([1, 2], params), Future(), [0], stop, on_token=on_token)
    return [Row(pending, k, sample_generator(seed, k)) for k in range(params.n)]


def _by_row(rows: list[Row]) -> dict[str, int]:
    return {kind: sum(test(r.pending) for r in rows) for kind, test in _KINDS.items()}


def test_kind_counts_follow_adds_and_compactions():
    rng = random.Random(0)
    batch = RunningBatch(64, 16)
    for _ in range(200):
        if batch.free >= 8 and (not batch.rows or rng.random() < 0.5):
            rows = [r for _ in range(rng.randint(1, 2)) for r in _request_rows(rng)]
            batch.add_rows(rows, [2] * len(rows))
        else:
            gone = rng.sample(range(len(batch.rows)), rng.randint(1, len(batch.rows)))
            batch.compact(gone)
        assert batch.counts == _by_row(batch.rows)
        seeded = sum(r.generator is not None for r in batch.rows)
        assert batch.counts["seeded"] == seeded  # a seeded request's rows carry generators
