"""Sample-completion tables: the rows every experiment-logger backend receives."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

SAMPLE_COLUMNS = ("prompt", "response", "reward", "version", "staleness")
"""Columns of the sample-completion table every tracker receives."""


def sample_rows(
    trajectories: Sequence[Mapping[str, Any]], trained_version: int | None, limit: int
) -> list[dict[str, Any]]:
    """The first `limit` trajectories as sample-table rows.

    `version` is the oldest weight version that produced a token of the sample
    (`min(token_versions)`, else `model_version`); `staleness` is
    `trained_version - version` (None when either is unknown).
    """
    rows = []
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


def with_staleness(rows: list[dict[str, Any]], trained_version: int) -> list[dict[str, Any]]:
    """Copies of `rows` with `staleness = trained_version - version`: rows built where the
    trained version is not known yet (the algorithm processor) get it at train time."""
    return [
        {
            **row,
            "staleness": None if row.get("version") is None else trained_version - row["version"],
        }
        for row in rows
    ]
