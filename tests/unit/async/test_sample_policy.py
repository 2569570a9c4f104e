"""Admission ledger: hand-computed capacities, and the bound under random schedules."""

import pytest
from hypothesis import example, given, settings
from hypothesis import strategies as st

from nexrl.config.schema import TrajectoryPoolConfig, WeightConfig
from nexrl.data import InMemoryDataLoader
from nexrl.monitoring import ActivityTracker, ActivityTrackerProxy
from nexrl.pools import TrajectoryPool
from nexrl.rollout.sample_policy import AdmissionLedger, SamplePolicy
from nexrl.types import StepResult
from tests.rollout_parts import build_task_owner


def ledger(k=1, gpb=2, f=0.0, mode="batch-async"):
    return AdmissionLedger(
        SamplePolicy(
            sync_mode=mode, staleness_threshold=k, over_sample_threshold=f, groups_per_batch=gpb
        )
    )


def test_capacity_is_k_plus_one_batches_ahead_of_the_serving_version():
    led = ledger(k=1, gpb=2)
    assert led.capacity() == 4  # batches 0 and 1 may fill on version 0
    assert [led.acquire() for _ in range(5)] == [True] * 4 + [False]
    assert led.batch_formed(2) == 0  # batch 0 formed: lag 1, (1 + 1 - 1) * 2 = 2 slots
    assert led.capacity() == 2 and led.outstanding == 2 and not led.acquire()
    led.set_version(1)
    assert led.capacity() == 4 and led.acquire()


def test_over_sampling_adds_a_fraction_of_a_batch():
    assert ledger(k=0, gpb=10, f=0.2).capacity() == 12
    assert ledger(k=0, gpb=3, f=0.2).capacity() == 4  # ceil(0.6)


def test_sync_mode_forces_k_zero_and_sync_every_one():
    policy = SamplePolicy.from_config(
        WeightConfig(sync_mode="sync", staleness_threshold=3, sync_every=2), groups_per_batch=2
    )
    assert policy.staleness_threshold == 0 and policy.sync_every == 1


@pytest.mark.parametrize(
    ("key", "value"),
    [
        ("staleness_threshold", -1),
        ("sync_every", 0),
        ("over_sample_threshold", -0.1),
        ("abort_grace_s", -1.0),
    ],
)
def test_bad_values_name_the_key(key, value):
    with pytest.raises(ValueError, match=f"weight.{key}"):
        SamplePolicy.from_config(WeightConfig(sync_mode="fully-async", **{key: value}), 2)


@pytest.mark.parametrize("mode", ["sync", "batch-async"])
def test_inflight_update_is_a_fully_async_option(mode):
    with pytest.raises(ValueError, match="weight.inflight_weight_update"):
        SamplePolicy.from_config(WeightConfig(sync_mode=mode, inflight_weight_update=True), 2)


def test_inflight_update_needs_an_engine_that_pauses():
    from nexrl.builders import build_weight_sync_controller
    from nexrl.config import load_config

    cfg = load_config(
        [
            "weight.sync_mode=fully-async",
            "weight.inflight_weight_update=true",
            "service.inference_service.backend=sglang",
            "service.inference_service.url=http://127.0.0.1:1",
        ]
    )
    with pytest.raises(ValueError, match="backend is 'sglang'"):
        build_weight_sync_controller(cfg)


def test_unknown_mode_lists_the_choices():
    with pytest.raises(ValueError, match="batch-async"):
        SamplePolicy.from_config(WeightConfig(sync_mode="async"), 2)


class NullInference:
    """Stands in for the inference side (no model needed to check bookkeeping)."""

    def update_weights(self, meta):
        pass

    def pause(self):
        pass

    def abort(self, rid=None):
        pass

    def resume(self):
        pass


def make_system(k, gpb, f, group_size=2):
    owner, wsc = build_task_owner(
        WeightConfig(sync_mode="fully-async", staleness_threshold=k, over_sample_threshold=f),
        NullInference(),
        gpb=gpb,
    )
    loader = InMemoryDataLoader({}, items=[{"prompt": f"p{i}"} for i in range(10_000)])
    pool = TrajectoryPool(TrajectoryPoolConfig(batch_size=gpb * group_size, group_size=group_size))
    tracker = ActivityTrackerProxy(ActivityTracker({}))
    for m in (owner, wsc, pool, loader):
        m.set_activity_tracker(tracker)
    pool.set_module_references(loader, owner)
    owner.set_module_references(loader)
    return owner, wsc, pool, loader, tracker


OVER_SENT_LANDS_LATE = [
    ("s", 0),
    ("s", 0),
    ("d", 1),
    ("d", 0),
    ("b", 0),
    ("b", 0),
    ("t", 0),
    ("t", 0),
]


@settings(max_examples=150, deadline=None)
@example(k=0, gpb=1, f=1.0, actions=OVER_SENT_LANDS_LATE)
@given(
    k=st.integers(0, 3),
    gpb=st.integers(1, 3),
    f=st.sampled_from([0.0, 0.5, 1.0]),
    actions=st.lists(st.tuples(st.sampled_from("sdbt"), st.integers(0, 1000)), max_size=60),
)
def test_random_schedules_never_train_a_sample_beyond_the_bound(k, gpb, f, actions):
    """s: a group starts (if admitted); d: a random running group is delivered
    (any order); b: the pool forms a batch; t: the oldest formed batch trains and
    the weights are pushed. Every trained sample has staleness <= k."""
    owner, wsc, pool, loader, tracker = make_system(k, gpb, f)
    running: list[tuple[dict, int]] = []
    formed: list = []
    for action, pick in actions:
        version = wsc.get_rollout_model_version()
        task = owner.acquire("default") if action == "s" else None
        if task is not None:
            running.append((task, version))
        elif action == "d" and running:
            task, v = running.pop(pick % len(running))
            group = [
                {
                    "uid": task.uid,
                    "task_id": task.task_id,
                    "prompt_ids": [1],
                    "response_ids": [2],
                    "response_logprobs": [0.0],
                    "model_version": v,
                    "token_versions": [v, version],
                    "model_tag": "default",
                }
                for _ in range(2)
            ]
            assert pool.put_trajectory_group(group) == "success"
            owner.complete("default", task, StepResult.SUCCESS)
        elif action == "b":
            batch = pool.get_batch()
            if batch is not None:
                formed.append(batch)
        elif action == "t" and formed:
            batch = formed.pop(0)
            step = batch.metadata["batch_index"]
            assert step == owner.snapshot("default")["version"]  # trains in order
            for versions in batch.values["token_versions"]:
                assert step - min(versions) <= k
            wsc.train_worker_notify_weight_update("train_worker_0", "default")
        state = owner.snapshot("default")
        in_pool = pool.num_ready() // 2
        assert state["outstanding"] == len(running) + in_pool  # the ledger is exact
        assert state["outstanding"] <= (k + 1) * gpb + int(-(-f * gpb // 1))


@pytest.mark.parametrize(
    ("extra", "capable", "expected"),
    [
        ({"sync_mode": "fully-async"}, True, True),  # the default where it can work
        ({"sync_mode": "fully-async"}, False, False),  # an engine that cannot swap mid-request
        ({"sync_mode": "batch-async"}, True, False),
        ({"sync_mode": "sync"}, True, False),
        ({"sync_mode": "fully-async", "enable_partial_rollout": True}, True, False),
        ({"sync_mode": "fully-async", "tail_batch_candidate_steps": 1}, True, False),
        ({"sync_mode": "fully-async", "inflight_weight_update": False}, True, False),
        ({"sync_mode": "fully-async", "inflight_weight_update": True}, True, True),
    ],
)
def test_inflight_update_default_follows_the_mode_and_the_engine(extra, capable, expected):
    policy = SamplePolicy.from_config(WeightConfig(**extra), 2, inflight_capable=capable)
    assert policy.inflight_weight_update is expected


def test_default_run_config_leaves_inflight_to_the_mode():
    from nexrl.builders import build_weight_sync_controller
    from nexrl.config import load_config

    fully = build_weight_sync_controller(load_config(["weight.sync_mode=fully-async"]))
    hf = build_weight_sync_controller(
        load_config(["weight.sync_mode=fully-async", "service.inference_service.backend=hf"])
    )
    assert fully.policy.inflight_weight_update and not hf.policy.inflight_weight_update


@pytest.mark.parametrize(
    ("extra", "capable", "expected"),
    [
        ({"sync_mode": "fully-async"}, True, False),  # in-flight: pushes abort nothing
        ({"sync_mode": "fully-async"}, False, True),  # aborting pushes: continue the samples
        ({"sync_mode": "fully-async", "inflight_weight_update": False}, True, True),
        ({"sync_mode": "fully-async", "tail_batch_candidate_steps": 1}, True, True),
        (  # xtuner's async 1: aborted samples start over
            {
                "sync_mode": "fully-async",
                "inflight_weight_update": False,
                "enable_partial_rollout": False,
            },
            True,
            False,
        ),
        ({"sync_mode": "batch-async"}, False, False),  # its pushes wait, abort nothing
        ({"sync_mode": "sync"}, False, False),
    ],
)
def test_partial_rollout_default_is_on_where_pushes_abort(extra, capable, expected):
    policy = SamplePolicy.from_config(WeightConfig(**extra), 2, inflight_capable=capable)
    assert policy.enable_partial_rollout is expected
    assert not (policy.enable_partial_rollout and policy.inflight_weight_update)


def test_rollout_context_resolves_partial_rollout_like_the_policy():
    from nexrl.builders import build_task_admission, inflight_capable
    from nexrl.config import load_config
    from nexrl.rollout.base import RolloutContext

    for extra in (
        ["weight.sync_mode=fully-async"],
        ["weight.sync_mode=fully-async", "service.inference_service.backend=hf"],
        ["weight.sync_mode=fully-async", "weight.inflight_weight_update=false"],
        ["weight.sync_mode=batch-async"],
    ):
        cfg = load_config(extra)
        policy = build_task_admission(cfg).policy
        context = RolloutContext.from_config(cfg, inflight_capable(cfg))
        assert context.enable_partial_rollout is policy.enable_partial_rollout, extra
    hf = load_config(["weight.sync_mode=fully-async", "service.inference_service.backend=hf"])
    assert RolloutContext.from_config(hf, inflight_capable(hf)).enable_partial_rollout
