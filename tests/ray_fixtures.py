"""One local Ray instance for the session (2 CPUs, no dashboard), shut down at the end.

The job's environment is the one `RaySystem` gives its actors (`actor_env`), so actors
reuse Ray's prestarted worker processes instead of starting fresh ones.
"""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from nexrl.distributed.settings import RaySettings, actor_env

    started = not ray.is_initialized()
    if started:
        ray.init(
            num_cpus=2,
            include_dashboard=False,
            log_to_driver=False,
            runtime_env={"env_vars": actor_env(RaySettings())},
        )
    yield ray
    if started:
        ray.shutdown()
