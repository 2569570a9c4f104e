"""Trajectory stores: where trajectories wait until their group is complete.

A store turns a stream of trajectories into complete *groups* (the samples
GRPO normalises together) and hands out whole groups only, oldest completed
first, so a batch never splits a group. Three shapes, one interface:

- `SimpleTrajectoryStore`: no grouping; every trajectory is a group of one.
- `GroupedTrajectoryStore`: groups by one key (e.g. `uid`), complete at `group_size`.
- `HierarchicalTrajectoryStore`: nested by several keys (e.g. `user`, then
  `session`); a leaf group is released when it reaches `group_size`.

Stores are not thread-safe on their own: `TrajectoryPoolInstance` holds the lock.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Hashable
from typing import Protocol, TypeAlias

from nexrl.types import Trajectory


class TrajectoryStore(Protocol):
    def add(self, traj: Trajectory) -> None: ...

    def add_group(self, trajs: list[Trajectory]) -> None: ...

    def num_ready(self) -> int: ...

    def take(self, n: int) -> list[Trajectory]: ...

    def __len__(self) -> int: ...

    def clear(self) -> None: ...

    def drain_incomplete(self) -> list[Trajectory]: ...

    def incomplete_groups(self) -> list[tuple[tuple[Hashable, ...], int]]: ...

    def ready_groups(self) -> list[list[Trajectory]]:
        """The complete groups, oldest first (a view: do not modify)."""
        ...

    def pop_groups(self, positions: list[int]) -> list[list[Trajectory]]:
        """Remove and return the complete groups at `positions` of `ready_groups()`."""
        ...


class _ReadyQueue:
    """Complete groups in completion order; `take` pops whole groups only."""

    def __init__(self) -> None:
        self.groups: deque[list[Trajectory]] = deque()
        self.count = 0

    def push(self, group: list[Trajectory]) -> None:
        self.groups.append(group)
        self.count += len(group)

    def take(self, n: int) -> list[Trajectory]:
        """The oldest groups whose sizes add up to at most `n` (stops at the first misfit)."""
        out: list[Trajectory] = []
        while self.groups and len(out) + len(self.groups[0]) <= n:
            group = self.groups.popleft()
            self.count -= len(group)
            out.extend(group)
        return out

    def clear(self) -> None:
        self.groups.clear()
        self.count = 0

    def pop_positions(self, positions: list[int]) -> list[list[Trajectory]]:
        """Remove the groups at `positions` (the rest keep their order)."""
        chosen = set(positions)
        removed = [g for i, g in enumerate(self.groups) if i in chosen]
        if removed:
            self.groups = deque(g for i, g in enumerate(self.groups) if i not in chosen)
            self.count -= sum(len(g) for g in removed)
        return removed


class SimpleTrajectoryStore:
    """No grouping: each trajectory is ready on arrival."""

    def __init__(self) -> None:
        self._ready = _ReadyQueue()

    def add(self, traj: Trajectory) -> None:
        self._ready.push([traj])

    def add_group(self, trajs: list[Trajectory]) -> None:
        for traj in trajs:
            self.add(traj)

    def num_ready(self) -> int:
        return self._ready.count

    def take(self, n: int) -> list[Trajectory]:
        return self._ready.take(n)

    def __len__(self) -> int:
        return self._ready.count

    def clear(self) -> None:
        self._ready.clear()

    def drain_incomplete(self) -> list[Trajectory]:
        return []

    def incomplete_groups(self) -> list[tuple[tuple[Hashable, ...], int]]:
        return []

    def ready_groups(self) -> list[list[Trajectory]]:
        return list(self._ready.groups)

    def pop_groups(self, positions: list[int]) -> list[list[Trajectory]]:
        return self._ready.pop_positions(positions)


def _group_value(traj: Trajectory, key: str) -> Hashable:
    if key not in traj:
        raise KeyError(f"trajectory has no grouping key {key!r} (trajectory_pool.key_list)")
    value: Hashable = traj[key]  # a group key: str / int in practice
    return value


_Node: TypeAlias = "dict[Hashable, _Node | list[Trajectory]]"
"""One level of the grouping tree: value of the level's key -> subtree, or (last level)
the group's trajectories."""


class HierarchicalTrajectoryStore:
    """Nested grouping by `key_list`; leaf groups are released at `group_size`.

    The tree is a dict per level (value of key i -> subtree) with lists at the
    leaves; empty branches are pruned when a leaf is released, so memory tracks
    only incomplete groups. A trajectory arriving for a leaf that was already
    released starts a new group.
    """

    def __init__(self, key_list: list[str], group_size: int) -> None:
        if not key_list:
            raise ValueError("trajectory_pool.key_list must name at least one key for grouping")
        if group_size < 1:
            raise ValueError(f"trajectory_pool.group_size must be >= 1, got {group_size}")
        self._keys = list(key_list)
        self._group_size = group_size
        self._tree: _Node = {}
        self._pending = 0
        self._ready = _ReadyQueue()

    def _path(self, traj: Trajectory) -> list[Hashable]:
        return [_group_value(traj, k) for k in self._keys]

    def add(self, traj: Trajectory) -> None:
        self._add(traj, self._path(traj))

    def _add(self, traj: Trajectory, path: list[Hashable]) -> None:
        nodes = [self._tree]
        for value in path[:-1]:
            child = nodes[-1].setdefault(value, {})
            assert isinstance(child, dict)  # every path has len(key_list) levels
            nodes.append(child)
        leaf = nodes[-1].setdefault(path[-1], [])
        assert isinstance(leaf, list)
        leaf.append(traj)
        self._pending += 1
        if len(leaf) < self._group_size:
            return
        self._pending -= len(leaf)
        self._ready.push(leaf)
        del nodes[-1][path[-1]]
        for depth in range(len(nodes) - 1, 0, -1):  # prune empty parents
            if not nodes[depth]:
                del nodes[depth - 1][path[depth - 1]]

    def add_group(self, trajs: list[Trajectory]) -> None:
        """One put of one key path with nothing of it held is a whole group, whatever its
        length (a rollout worker puts a task's episodes together; a multi-turn episode may
        be several trajectories). Otherwise each trajectory joins its leaf as in `add`."""
        paths = [self._path(traj) for traj in trajs]  # every key checked before any change
        if trajs and self._fresh_group(paths):
            self._ready.push(list(trajs))  # the usual put: one whole group, nothing of it here
            return
        for traj, path in zip(trajs, paths, strict=True):
            self._add(traj, path)

    def _fresh_group(self, paths: list[list[Hashable]]) -> bool:
        """All `paths` are one group's, and the store holds none of its samples yet."""
        if any(path != paths[0] for path in paths):
            return False
        node: _Node | list[Trajectory] = self._tree
        for value in paths[0]:
            assert isinstance(node, dict)  # a list only below the last level
            if value not in node:
                return True
            node = node[value]
        return False

    def num_ready(self) -> int:
        return self._ready.count

    def take(self, n: int) -> list[Trajectory]:
        return self._ready.take(n)

    def __len__(self) -> int:
        return self._ready.count + self._pending

    def ready_groups(self) -> list[list[Trajectory]]:
        return list(self._ready.groups)

    def pop_groups(self, positions: list[int]) -> list[list[Trajectory]]:
        return self._ready.pop_positions(positions)

    def clear(self) -> None:
        self._tree.clear()
        self._pending = 0
        self._ready.clear()

    def incomplete_groups(self) -> list[tuple[tuple[Hashable, ...], int]]:
        """(key path, trajectories held) of every group still waiting for samples."""
        out: list[tuple[tuple[Hashable, ...], int]] = []
        stack: list[tuple[tuple[Hashable, ...], _Node]] = [((), self._tree)]
        while stack:
            path, node = stack.pop()
            for value, child in node.items():
                if isinstance(child, list):
                    out.append(((*path, value), len(child)))
                else:
                    stack.append(((*path, value), child))
        return out

    def drain_incomplete(self) -> list[Trajectory]:
        """Remove and return the trajectories of groups that are not complete."""
        out: list[Trajectory] = []
        stack: list[_Node] = [self._tree]
        while stack:
            node = stack.pop()
            for child in node.values():
                if isinstance(child, list):
                    out.extend(child)
                else:
                    stack.append(child)
        self._tree = {}
        self._pending = 0
        return out


class GroupedTrajectoryStore(HierarchicalTrajectoryStore):
    """Single-key grouping (the one-level case of the hierarchy), e.g. by `uid`."""

    def __init__(self, key: str, group_size: int) -> None:
        super().__init__([key], group_size)


def make_store(key_list: list[str] | None, group_size: int) -> TrajectoryStore:
    """The store type for a `key_list`: none -> simple, one -> grouped, more -> hierarchical."""
    keys = list(key_list or [])
    if not keys:
        return SimpleTrajectoryStore()
    if len(keys) == 1:
        return GroupedTrajectoryStore(keys[0], group_size)
    return HierarchicalTrajectoryStore(keys, group_size)
