"""One replica of two is SIGKILLed: requests go to the other, Ray restarts the dead one,
the health check finds it on old weights and catches it up; it serves the newest version."""

from __future__ import annotations

import os
import signal
import time

import pytest

from nexrl.inference.protocol import GenerationRequest, SamplingParams, WeightUpdateMeta
from nexrl.inference.replicas import InferenceReplica, ReplicaBalancer

pytestmark = [pytest.mark.ray, pytest.mark.slow]


def _request(i: int) -> GenerationRequest:
    return GenerationRequest([5, 6, 7], SamplingParams(max_new_tokens=4), rid=f"r{i}")


def test_killed_replica_is_routed_around_restarted_and_caught_up(
    ray_local, tiny_model_path, other_weights_path
):
    import ray

    actor = ray.remote(InferenceReplica).options(num_cpus=0, max_concurrency=4, max_restarts=2)
    replicas = [actor.remote({"backend": "builtin", "model": tiny_model_path}) for _ in range(2)]
    try:
        balancer = ReplicaBalancer(replicas, tiny_model_path, timeout_s=60.0, health_timeout_s=60.0)
        balancer.update_weights(WeightUpdateMeta(version=1, path=other_weights_path))
        pid = ray.get(replicas[0].pid.remote())
        os.kill(pid, signal.SIGKILL)
        for i in range(4):  # none fails: the dead replica's share goes to the other one
            out = balancer.generate(_request(i)).outputs[0]
            assert out.output_versions == [1] * len(out.output_ids)
        end = time.monotonic() + 300
        while balancer.current_replicas() != [0, 1]:  # Ray restarts it; catch_up pushes v1
            assert time.monotonic() < end, "the killed replica never came back current"
            balancer.check_health()
            time.sleep(0.5)
        assert ray.get(replicas[0].pid.remote()) != pid
        assert ray.get([r.version.remote() for r in replicas]) == [1, 1]
        out = ray.get(replicas[0].generate.remote(_request(9), 1)).outputs[0]
        assert out.output_versions == [1] * len(out.output_ids)

        # a hang: replica 1 stops; the health check kills it, Ray restarts it, catch-up
        hung = ray.get(replicas[1].pid.remote())
        os.kill(hung, signal.SIGSTOP)
        balancer.health_timeout_s = 5.0
        assert balancer.check_health() == [1]
        assert balancer.generate(_request(10)).outputs[0].output_versions[0] == 1
        while balancer.current_replicas() != [0, 1]:
            assert time.monotonic() < end + 300, "the hung replica never came back current"
            balancer.check_health()
            time.sleep(0.5)
        assert ray.get(replicas[1].pid.remote()) != hung
    finally:
        for r in replicas:
            ray.kill(r)
