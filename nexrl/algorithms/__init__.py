"""The algorithm library: small pure functions chosen by name from registries.

`ADVANTAGE_ESTIMATORS`, `POLICY_LOSSES`, `AGGREGATIONS` and `KL_ESTIMATORS`
map config names to functions; `compute_loss` is the only entry point a
trainer calls. See docs/algorithms.md for every name and its paper.
"""

from nexrl.algorithms.advantages import ADVANTAGE_ESTIMATORS, group_stats
from nexrl.algorithms.aggregation import AGGREGATIONS
from nexrl.algorithms.dapo import (
    filter_informative,
    informative_groups,
    mask_truncated,
    overlong_penalty,
)
from nexrl.algorithms.kl import KL_ESTIMATORS, apply_kl_penalty, kl_per_token
from nexrl.algorithms.losses import POLICY_LOSSES
from nexrl.algorithms.objective import compute_loss
from nexrl.algorithms.off_policy import decoupled_weights, is_weights
from nexrl.algorithms.registry import Registry, check_kwargs

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "AGGREGATIONS",
    "KL_ESTIMATORS",
    "POLICY_LOSSES",
    "Registry",
    "apply_kl_penalty",
    "check_kwargs",
    "compute_loss",
    "decoupled_weights",
    "filter_informative",
    "group_stats",
    "informative_groups",
    "is_weights",
    "kl_per_token",
    "mask_truncated",
    "overlong_penalty",
]
