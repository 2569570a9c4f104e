"""Sample-completion tables: the rows every experiment-logger backend receives."""

from __future__ import annotations

from collections.abc import Sequence

from nexrl.types import SampleRow, Trajectory

SAMPLE_COLUMNS = ("prompt", "response", "reward", "version", "staleness")
"""Columns of the sample-completion table every tracker receives."""


def sample_rows(
    trajectories: Sequence[Trajectory], trained_version: int | None, limit: int
) -> list[SampleRow]:
    """The first `limit` trajectories as sample-table rows.

    `version` is the oldest weight version that produced a token of the sample
    (`min(token_versions)`, else `model_version`); `staleness` is
    `trained_version - version` (None when either is unknown).
    """
    rows: list[SampleRow] = []
    for traj in list(trajectories)[: max(0, limit)]:
        versions = traj.get("token_versions") or []
        version = min(versions) if versions else traj.get("model_version")
        stale = None if version is None or trained_version is None else trained_version - version
        reward = traj.get("reward")
        rows.append(
            {
                "prompt": str(traj.get("prompt", "")),
                "response": str(traj.get("response", "")),
                "reward": None if reward is None else float(reward),
                "version": version,
                "staleness": stale,
            }
        )
    return rows


def with_staleness(rows: list[SampleRow], trained_version: int) -> list[SampleRow]:
    """Copies of `rows` with `staleness = trained_version - version`: rows built where the
    trained version is not known yet (the algorithm processor) get it at train time."""
    out: list[SampleRow] = []
    for row in rows:
        version = row.get("version")
        out.append({**row, "staleness": None if version is None else trained_version - version})
    return out
