"""Inference replicas on Ray: `InferenceReplica` actors behind a `ReplicaBalancer`.

Each replica is an actor running the built-in engine on its own bundle. The balancer
is an `InferenceEngine` (so `LLMServiceClient(config, engine=balancer)` needs no
change) that lives in the rollout actor and picks a replica per request:

- a request whose `rid` (or `metadata["prefix_key"]`) was seen before goes back to the
  replica that served it - the one holding its prefix / partial rollout;
- otherwise the current replica with the fewest outstanding requests.

Versions: `update_weights(meta)` pushes to every replica; a replica whose update
failed (or that restarted with old weights) is *stale* and gets no request until
`catch_up()` has brought it to the newest version; the replica itself also refuses a
request that asks for a newer version than it holds (`min_version`), so a stale
replica serves nothing even when called directly.

Faults: a request whose replica died, restarted or refused it is sent again to
another current replica (each replica tried at most once per request). A health
check (`check_health`, or every `health_interval_s` in a background thread) asks
each replica for its version within `health_timeout_s`: a dead one is stale; a
hung one is killed so that Ray restarts it (actors need `max_restarts`); a
restarted one (old version) gets the last weights pushed again by `catch_up`.
"""

from __future__ import annotations

import logging
import threading
from collections import OrderedDict
from collections.abc import Iterable, Mapping
from typing import Any

import ray

from nexrl.inference.health import EngineRestartedError
from nexrl.inference.protocol import GenerationRequest, GenerationResponse, WeightUpdateMeta

logger = logging.getLogger(__name__)
MAX_AFFINITY = 100_000


class StaleReplicaError(RuntimeError):
    """A replica was asked to serve a weight version it does not hold (yet)."""


# what one replica can fail with while another could still serve the request
_REPLICA_FAULTS = (
    ray.exceptions.RayActorError,
    ray.exceptions.GetTimeoutError,
    StaleReplicaError,
    EngineRestartedError,
)


class InferenceReplica:
    """One engine in one actor (create with `ray.remote(InferenceReplica).options(...)`)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        from nexrl.inference.factory import build_local_engine

        self.engine = build_local_engine(config)
        self._served = 0

    def served(self) -> int:
        """How many requests this replica has served."""
        return self._served

    def generate(self, request: GenerationRequest, min_version: int = 0) -> GenerationResponse:
        if self.engine.version < min_version:
            raise StaleReplicaError(
                f"replica holds weights v{self.engine.version}, request needs v{min_version}"
            )
        self._served += 1
        return self.engine.generate(request)

    def update_weights(self, meta: WeightUpdateMeta) -> int:
        self.engine.update_weights(meta)
        return self.engine.version

    def version(self) -> int:
        return self.engine.version

    def pause(self) -> None:
        self.engine.pause()

    def resume(self) -> None:
        self.engine.resume()

    def abort(self, rid: str | None = None) -> None:
        self.engine.abort(rid)

    def health(self) -> bool:
        return bool(self.engine.health())

    def pid(self) -> int:
        """Process id of this replica (fault-injection tests kill it)."""
        import os

        return os.getpid()


class ReplicaBalancer:
    """`InferenceEngine` over replica actors: least outstanding requests + prefix affinity."""

    def __init__(
        self,
        replicas: list[Any],
        model_path: str,
        timeout_s: float = 600.0,
        health_interval_s: float = 0.0,
        health_timeout_s: float = 30.0,
    ) -> None:
        if not replicas:
            raise ValueError("ReplicaBalancer needs at least one replica actor")
        self.replicas = list(replicas)
        self.model_path = model_path
        self.timeout_s = timeout_s
        self._lock = threading.Lock()
        self._outstanding = [0] * len(replicas)
        self._versions = ray.get([r.version.remote() for r in replicas], timeout=timeout_s)
        self._target = max(self._versions)
        self._last_meta: WeightUpdateMeta | None = None
        self._affinity: OrderedDict[str, int] = OrderedDict()
        # loaded now: transformers' lazy imports are not safe from concurrent rollout threads
        from transformers import AutoTokenizer

        self.tokenizer = AutoTokenizer.from_pretrained(model_path)
        self.health_timeout_s = health_timeout_s
        self._stop = threading.Event()
        if health_interval_s > 0:
            threading.Thread(
                target=self._watch, args=(health_interval_s,), name="replica-health", daemon=True
            ).start()

    @classmethod
    def connect(cls, config: Mapping[str, Any]) -> ReplicaBalancer:
        """From `config["replica_actors"]` (named actors) and `config["model"]`."""
        actors = [ray.get_actor(name) for name in config["replica_actors"]]
        return cls(actors, str(config.get("model")))

    # -- InferenceEngine ------------------------------------------------------------
    @property
    def version(self) -> int:
        return self._target

    def generate(self, request: GenerationRequest) -> GenerationResponse:
        """Serve on one current replica; on a replica fault, on the next (each at most once)."""
        tried: set[int] = set()
        while True:
            index = self._acquire(request, exclude=tried)
            try:
                ref = self.replicas[index].generate.remote(request, self._target)
                return ray.get(ref, timeout=self.timeout_s)
            except _REPLICA_FAULTS as exc:
                tried.add(index)
                self._mark_stale(index, exc)
                if len(tried) == len(self.replicas):
                    raise
            finally:
                with self._lock:
                    self._outstanding[index] -= 1

    async def agenerate(self, request: GenerationRequest) -> GenerationResponse:
        import asyncio

        return await asyncio.to_thread(self.generate, request)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Push to every replica; a failed one is stale until `catch_up()` succeeds."""
        self._last_meta = meta
        self._target = max(self._target, meta.version)
        self._push(range(len(self.replicas)), meta)

    def pause(self) -> None:
        ray.get([r.pause.remote() for r in self.replicas], timeout=self.timeout_s)

    def resume(self) -> None:
        ray.get([r.resume.remote() for r in self.replicas], timeout=self.timeout_s)

    def abort(self, rid: str | None = None) -> None:
        ray.get([r.abort.remote(rid) for r in self.replicas], timeout=self.timeout_s)

    def health(self) -> bool:
        return bool(self.current_replicas())

    def shutdown(self) -> None:
        """Stops the health thread; the replicas belong to the Ray system."""
        self._stop.set()

    # -- faults -----------------------------------------------------------------------
    def check_health(self) -> list[int]:
        """Probe every replica; kill hung ones (Ray restarts them), catch up restarted ones.

        Returns the indices that did not answer within `health_timeout_s`.
        """
        refs = [r.version.remote() for r in self.replicas]
        unhealthy = []
        for i, ref in enumerate(refs):
            try:
                version = ray.get(ref, timeout=self.health_timeout_s)
            except ray.exceptions.GetTimeoutError as exc:
                self._mark_stale(i, exc)
                logger.warning("replica %d is hung; killing it so that Ray restarts it", i)
                ray.kill(self.replicas[i], no_restart=False)
                unhealthy.append(i)
                continue
            except ray.exceptions.RayActorError as exc:
                self._mark_stale(i, exc)
                unhealthy.append(i)
                continue
            with self._lock:
                self._versions[i] = version
        if any(i not in self.current_replicas() for i in range(len(self.replicas))):
            self.catch_up()
        return unhealthy

    def _watch(self, interval_s: float) -> None:
        while not self._stop.wait(interval_s):
            try:
                self.check_health()
            except Exception:  # the next round tries again; routing avoids stale replicas
                logger.exception("replica health check failed")

    def _mark_stale(self, index: int, exc: BaseException) -> None:
        logger.warning("replica %d failed (%s); routing around it", index, type(exc).__name__)
        with self._lock:
            self._versions[index] = -1

    # -- routing and versions ---------------------------------------------------------
    def current_replicas(self) -> list[int]:
        with self._lock:
            return [i for i, v in enumerate(self._versions) if v >= self._target]

    def replica_for(self, key: str) -> int | None:
        """The replica that served `key` (a rid or prefix key) last, if any."""
        with self._lock:
            return self._affinity.get(key)

    def outstanding(self) -> list[int]:
        with self._lock:
            return list(self._outstanding)

    def refresh(self) -> list[int]:
        """Ask every replica its version (e.g. after a restart); returns the versions."""
        versions = []
        for replica in self.replicas:
            try:
                versions.append(ray.get(replica.version.remote(), timeout=self.timeout_s))
            except Exception as exc:  # an unreachable replica is stale, not an error here
                logger.warning("replica version query failed: %r", exc)
                versions.append(-1)
        with self._lock:
            self._versions = versions
            self._target = max(self._target, *versions)
        return versions

    def catch_up(self, meta: WeightUpdateMeta | None = None) -> list[int]:
        """Push the newest weights (`meta`, else the last pushed) to stale replicas;
        returns the indices still stale."""
        meta = meta or self._last_meta
        stale = [i for i in range(len(self.replicas)) if i not in self.current_replicas()]
        if stale and meta is not None:
            self._last_meta = meta
            self._push(stale, meta)
        return [i for i in range(len(self.replicas)) if i not in self.current_replicas()]

    def _push(self, indices: Iterable[int], meta: WeightUpdateMeta) -> None:
        refs = {i: self.replicas[i].update_weights.remote(meta) for i in indices}
        for i, ref in refs.items():
            try:
                version = ray.get(ref, timeout=self.timeout_s)
            except Exception as exc:  # recorded as stale; requests avoid it
                logger.warning("replica %d missed weights v%d: %r", i, meta.version, exc)
                continue
            with self._lock:
                self._versions[i] = version

    def _acquire(self, request: GenerationRequest, exclude: set[int] | None = None) -> int:
        prefix = request.metadata.get("prefix_key")
        key = str(prefix) if prefix else request.rid
        exclude = exclude or set()
        current = [i for i in self.current_replicas() if i not in exclude]
        if not current:
            self.catch_up()
            current = [i for i in self.current_replicas() if i not in exclude]
        if not current:
            raise StaleReplicaError(f"no replica holds weights v{self._target}")
        with self._lock:
            index = self._affinity.get(key) if key else None
            if index not in current:
                index = min(current, key=lambda i: (self._outstanding[i], i))
            if key:
                self._affinity[key] = index
                self._affinity.move_to_end(key)
                if len(self._affinity) > MAX_AFFINITY:
                    self._affinity.popitem(last=False)
            self._outstanding[index] += 1
        return index
