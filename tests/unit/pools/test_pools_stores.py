"""Trajectory stores: grouping, readiness, whole-group takes, incomplete-group draining."""

from __future__ import annotations

import pytest

from nexrl.pools import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    make_store,
)


def traj(uid: str, i: int = 0, **kw) -> dict:
    return {"uid": uid, "i": i, **kw}


def test_simple_store_every_trajectory_is_ready() -> None:
    store = SimpleTrajectoryStore()
    for i in range(5):
        store.add(traj("a", i))
    assert store.num_ready() == 5 and len(store) == 5
    assert [t["i"] for t in store.take(3)] == [0, 1, 2]
    assert store.num_ready() == 2 and store.drain_incomplete() == []


def test_grouped_store_releases_complete_groups_oldest_first() -> None:
    store = GroupedTrajectoryStore("uid", group_size=3)
    for i in range(2):
        store.add(traj("a", i))
    for i in range(3):
        store.add(traj("b", i))  # b completes first
    assert store.num_ready() == 3 and len(store) == 5
    store.add(traj("a", 2))
    assert store.num_ready() == 6
    first = store.take(3)
    assert [t["uid"] for t in first] == ["b"] * 3  # completion order
    assert [t["uid"] for t in store.take(3)] == ["a"] * 3
    assert len(store) == 0


def test_take_never_splits_a_group() -> None:
    store = GroupedTrajectoryStore("uid", group_size=2)
    for uid in "abc":
        store.add_group([traj(uid, 0), traj(uid, 1)])
    got = store.take(5)  # 5 is not a multiple of 2: two whole groups only
    assert [t["uid"] for t in got] == ["a", "a", "b", "b"]
    assert store.num_ready() == 2


def test_extra_samples_of_a_released_uid_start_a_new_group() -> None:
    store = GroupedTrajectoryStore("uid", group_size=2)
    for i in range(3):
        store.add(traj("a", i))
    assert store.num_ready() == 2 and len(store) == 3
    assert [t["i"] for t in store.drain_incomplete()] == [2]
    assert len(store) == 2


def test_hierarchical_store_groups_by_leaf_and_prunes() -> None:
    store = HierarchicalTrajectoryStore(["user", "session"], group_size=2)
    store.add(traj("x", 0, user="u1", session="s1"))
    store.add(traj("x", 1, user="u1", session="s2"))
    store.add(traj("x", 2, user="u2", session="s1"))
    assert store.num_ready() == 0 and len(store) == 3  # same session name, different users
    store.add(traj("x", 3, user="u1", session="s2"))
    assert store.num_ready() == 2
    assert [t["i"] for t in store.take(2)] == [1, 3]
    leftovers = sorted(t["i"] for t in store.drain_incomplete())
    assert leftovers == [0, 2] and len(store) == 0


def test_missing_group_key_rejects_whole_group() -> None:
    store = GroupedTrajectoryStore("uid", group_size=2)
    with pytest.raises(KeyError, match="uid"):
        store.add_group([traj("a"), {"i": 1}])
    assert len(store) == 0  # nothing from the bad group was kept


def test_make_store_picks_type_by_key_list() -> None:
    assert isinstance(make_store([], 4), SimpleTrajectoryStore)
    assert isinstance(make_store(["uid"], 4), GroupedTrajectoryStore)
    assert type(make_store(["a", "b"], 4)) is HierarchicalTrajectoryStore
    with pytest.raises(ValueError, match="group_size"):
        make_store(["uid"], 0)


@pytest.mark.parametrize("keys", [["uid"], ["user", "uid"]])
def test_a_whole_group_put_at_once_merges_with_samples_of_it_already_held(keys) -> None:
    store = make_store(keys, group_size=2)
    store.add(traj("a", 0, user="u"))
    store.add_group([traj("a", 1, user="u"), traj("a", 2, user="u")])  # a's leaf exists
    assert [t["i"] for t in store.take(2)] == [0, 1] and len(store) == 1
    store.add_group([traj("b", 3, user="u"), traj("b", 4, user="u")])  # nothing of b held
    store.add_group([traj("c", 5, user="u"), traj("d", 6, user="u")])  # two groups' samples
    assert [t["i"] for t in store.take(2)] == [3, 4]
    assert store.num_ready() == 0 and len(store) == 3  # a's 2, c's 5 and d's 6 wait
    store.add_group([traj("a", 7, user="u"), traj("d", 8, user="u")])
    assert sorted(t["i"] for t in store.take(4)) == [2, 6, 7, 8]
    assert [t["i"] for t in store.drain_incomplete()] == [5]
