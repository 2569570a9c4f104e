"""Pools between stages: trajectories waiting for a batch, batches waiting for training."""

from nexrl.pools.stores import (
    GroupedTrajectoryStore,
    HierarchicalTrajectoryStore,
    SimpleTrajectoryStore,
    TrajectoryStore,
    make_store,
)
from nexrl.pools.train_batch_pool import TrainBatchPool
from nexrl.pools.trajectory_pool import (
    CHECK_BATCH_READY_FUNCTIONS,
    TrajectoryPool,
    TrajectoryPoolInstance,
)

__all__ = [
    "CHECK_BATCH_READY_FUNCTIONS",
    "GroupedTrajectoryStore",
    "HierarchicalTrajectoryStore",
    "SimpleTrajectoryStore",
    "TrainBatchPool",
    "TrajectoryPool",
    "TrajectoryPoolInstance",
    "TrajectoryStore",
    "make_store",
]
