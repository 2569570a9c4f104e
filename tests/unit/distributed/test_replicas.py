"""Inference replicas: least-outstanding balancing, prefix affinity, stale replicas."""

from __future__ import annotations

import threading
import time

import pytest

from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.replicas import InferenceReplica, ReplicaBalancer, StaleReplicaError

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def request(rid: str | None = None, tokens: int = 2) -> GenerationRequest:
    sampling = SamplingParams(max_new_tokens=tokens, temperature=1.0, ignore_eos=True, seed=0)
    return GenerationRequest([5, 6, 7], sampling, rid=rid)


@pytest.fixture(scope="module")
def replicas(ray_local, tiny_model_path):
    import ray

    actor = ray.remote(InferenceReplica).options(num_cpus=0, max_concurrency=8)
    made = [actor.remote({"backend": "builtin", "model": tiny_model_path}) for _ in range(2)]
    yield made
    for r in made:
        ray.kill(r)


def served(replicas) -> list[int]:
    import ray

    return ray.get([r.served.remote() for r in replicas])


def test_least_outstanding_then_prefix_affinity(replicas, tiny_model_path):
    balancer = ReplicaBalancer(replicas, tiny_model_path)
    before = served(replicas)
    long_one = threading.Thread(target=balancer.generate, args=(request(tokens=240),))
    long_one.start()
    while sum(balancer.outstanding()) < 1:
        time.sleep(0.01)
    busy = balancer.outstanding().index(1)
    out = balancer.generate(request(rid="rollout-a"))  # the idle replica takes it
    assert len(out.outputs[0].output_ids) == 2
    assert balancer.replica_for("rollout-a") == 1 - busy
    long_one.join()
    assert balancer.outstanding() == [0, 0]
    for _ in range(3):  # idle again: a tie, but the continuation goes where its prefix is
        balancer.generate(request(rid="rollout-a"))
    after = [a - b for a, b in zip(served(replicas), before, strict=True)]
    assert after[busy] == 1 and after[1 - busy] == 4


def test_a_replica_that_missed_an_update_serves_nothing_until_current(replicas, tiny_model_path):
    import ray

    meta = WeightUpdateMeta(version=1, path=tiny_model_path)
    ray.get(replicas[0].update_weights.remote(meta))  # replica 1 missed this push
    balancer = ReplicaBalancer(replicas, tiny_model_path)
    assert balancer.version == 1 and balancer.current_replicas() == [0]
    with pytest.raises(StaleReplicaError, match="holds weights v0, request needs v1"):
        ray.get(replicas[1].generate.remote(request(), 1))
    before = served(replicas)
    for i in range(3):
        assert balancer.generate(request(rid=f"r{i}")).outputs[0].output_versions == [1, 1]
    after = [a - b for a, b in zip(served(replicas), before, strict=True)]
    assert after == [3, 0]
    assert balancer.catch_up(meta) == []  # now current: it serves again
    assert balancer.current_replicas() == [0, 1]
    balancer.update_weights(WeightUpdateMeta(version=2, path=tiny_model_path))
    assert ray.get([r.version.remote() for r in replicas]) == [2, 2]
