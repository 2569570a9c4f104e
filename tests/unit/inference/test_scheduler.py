"""The running batch's kind counts (what lets a step skip the work no row needs) stay
equal to a row-by-row count through any order of adds and compactions."""

from __future__ import annotations

import random
from concurrent.futures import Future

import pytest

from nexrl.inference.protocol import GenerationOutput, GenerationRequest, SamplingParams
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


def test_added_rows_carry_their_own_requests_settings():
    """Each request's settings are read once and spread over its rows: every row ends up
    with its own request's limits, sampling settings and stop ids (padded with -1 to the
    widest), through adds of requests with different settings and stop-id widths."""
    rng = random.Random(1)
    batch = RunningBatch(64, 16)
    for _ in range(30):
        if batch.free < 8:
            batch.compact(rng.sample(range(len(batch.rows)), rng.randint(1, len(batch.rows))))
        rows = [r for _ in range(rng.randint(1, 3)) for r in _request_rows(rng)]
        for r in rows:  # stop-id widths differ by request
            r.pending.stop_ids = r.pending.stop_ids[:1] * (id(r.pending) % 3 + 1)
        lens = [rng.randint(2, 14) for _ in rows]
        idx = batch.add_rows(rows, lens)
        for j, row, plen in zip(range(idx.start, idx.stop), rows, lens, strict=True):
            s = row.pending.request.sampling
            assert int(batch.max_gen[j]) == min(s.max_new_tokens, 16 - plen)
            assert int(batch.pos[j]) == plen - 1 and int(batch.n_gen[j]) == 0
            assert float(batch.temp[j]) == pytest.approx(s.temperature)
            assert float(batch.top_p[j]) == pytest.approx(s.top_p)
            assert int(batch.top_k[j]) == s.top_k
            stops = batch.stop_ids[j].tolist()
            width = len(row.pending.stop_ids)
            assert stops[:width] == row.pending.stop_ids and set(stops[width:]) <= {-1}


def _pending(n: int) -> Pending:
    params = SamplingParams(max_new_tokens=1, n=n)
    stop = StopChecker(None, [])
    return Pending(GenerationRequest([1, 2], params, rid="r"), Future(), [0], stop, [None] * n, n)


def test_resolve_never_hands_out_a_response_with_missing_samples():
    done = GenerationOutput([3], [-0.5], [0], "length")
    pending = _pending(2)
    pending.finish_sample(1, done)
    pending.resolve()  # sample 0 never finished: the caller gets an error, not a None
    with pytest.raises(RuntimeError, match="request r: 1 samples never finished"):
        pending.future.result(timeout=0)
    whole = _pending(2)
    whole.finish_sample(0, done)
    whole.finish_sample(1, done)
    whole.resolve()
    assert whole.future.result(timeout=0).outputs == [done, done]
