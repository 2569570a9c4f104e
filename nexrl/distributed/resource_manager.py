"""Ray actors for nexrl modules: `RayResourceManager`, `ModuleActor`, `RayActorWrapper`.

Seed 000's contract: `register_role(role, builder, config, count, colocation_group)`,
`create_all_actors()`, `get_actor_wrapper(role) -> list[RayActorWrapper]`. Roles that
share a colocation group live in ONE actor process (one `ModuleActor`), which is how
rollout workers and the weight-sync controller share one in-process inference engine.

Why one generic actor class instead of `ray.remote(ModuleClass)`: builders take the
resolved config only (`nexrl.builders`), so the actor builds its modules itself, and
one actor can host any mix of roles. Methods are addressed by a role prefix
(`"rollout_worker_1"` + `"run"`); `RayActorWrapper` rebinds each public method of
the hosted module as an attribute with a `.remote(...)`, so `execute(wrapper.run)`
works exactly as `execute(module.run)` does locally.

A wrapper that is sent to the actor hosting its own module unpickles to the module
object itself, so colocated modules call each other directly (no Ray hop, the same
semantics as local mode). Actors are threaded (`max_concurrency`): module loop threads,
calls from other actors and health checks run concurrently instead of deadlocking.

Restarts (`max_restarts > 0`): Ray re-runs `ModuleActor.__init__`, which rebuilds the
modules from the config and replays the setup calls recorded in a `SetupJournal` actor
(`set_module_name`, `set_activity_tracker`, `set_module_references`,
`initialize_workers`; not `run`), so the group rejoins the run. In-memory state (pool
contents, loader position, the task ledger of the weight-sync controller, optimizer
state, engine weights) is NOT rebuilt in place: the restarted actor is *fenced* (every
module call but `stop` / `health_check` raises `ActorRestartedError`, so no surviving
module reads or writes its fresh state and no checkpoint can be saved from it) and
notes its restart in the journal. The controller sees the note (`restarted()`), pauses
every loop, lifts the fence (`unfence`) and rewinds the whole run to its last complete
checkpoint, whose loader state and pending tasks restore the ledger exactly
(`nexrl.distributed.recovery`, docs/reliability.md). Without a checkpoint the run stops
with an error naming the actor. Work the dead modules had in flight is dropped from the
activity tracker.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import ray
from omegaconf import DictConfig

from nexrl.config.options import RayGroupConfig
from nexrl.config.schema import RayConfig
from nexrl.distributed.recovery import ActorRestartedError
from nexrl.protocols import ModuleLike
from nexrl.types import NexRLRole

logger = logging.getLogger(__name__)

Builder = Callable[[DictConfig], ModuleLike]

# modules hosted by the actor of THIS process: (actor id hex, module key) -> module
_LOCAL_MODULES: dict[tuple[str, str], ModuleLike] = {}
_EXTRA_METHODS = ("__len__",)


def module_key(role: NexRLRole | str, index: int) -> str:
    """The role prefix of one module inside its actor: `"<role>_<index>"`."""
    return f"{_role_name(role)}_{index}"


def public_methods(obj: object) -> list[str]:
    """Names of `obj`'s public callables (plus `__len__` when defined)."""
    names = [n for n in dir(type(obj)) if not n.startswith("_") or n in _EXTRA_METHODS]
    return [n for n in names if callable(getattr(type(obj), n, None))]


def _current_actor_id() -> str | None:
    try:
        actor_id = ray.get_runtime_context().get_actor_id()
    except Exception:  # noqa: BLE001 - not inside a Ray worker
        return None
    return actor_id


JOURNALED = frozenset(
    {
        "set_module_name",
        "set_activity_tracker",
        "set_module_references",
        "initialize_workers",
        "run",
    }
)
NOT_REPLAYED = frozenset({"run"})  # a restarted actor's loops start after the rewind
THROUGH_FENCE = frozenset({"stop", "pause", "health_check", "get_module_name"})


class SetupJournal:
    """Setup calls per actor, kept outside the actors so a restarted actor can replay them."""

    def __init__(self) -> None:
        self._entries: dict[str, list[tuple[str, str, tuple, dict]]] = {}
        self._restarts: list[str] = []

    def append(self, actor_id: str, key: str, method: str, args: tuple, kwargs: dict) -> None:
        self._entries.setdefault(actor_id, []).append((key, method, args, kwargs))

    def entries(self, actor_id: str) -> list[tuple[str, str, tuple, dict]]:
        return list(self._entries.get(actor_id, []))

    def note_restart(self, actor_id: str) -> None:
        """A restarted actor rebuilt its modules (called before it serves any call)."""
        self._restarts.append(actor_id)

    def restarts(self) -> list[str]:
        """The actors that restarted since the last call (each once)."""
        out, self._restarts = self._restarts, []
        return out


class ModuleActor:
    """Hosts the modules of one colocation group; built with `ray.remote(...).options(...)`."""

    def __init__(
        self,
        config: DictConfig,
        specs: list[tuple[str, Builder, int]],
        journal: Any = None,
        tracker: Any = None,
        group: str = "",
    ) -> None:
        self._modules: dict[str, ModuleLike] = {}
        self._fence: str | None = None
        actor_id = _current_actor_id() or "driver"
        for role, builder, count in specs:
            for i in range(count):
                key = module_key(role, i)
                self._modules[key] = builder(config)
                _LOCAL_MODULES[(actor_id, key)] = self._modules[key]
        if journal is not None and ray.get_runtime_context().was_current_actor_reconstructed:
            self._replay(ray.get(journal.entries.remote(actor_id)), tracker)
            self._fence = (
                f"Ray actor {group!r} ({', '.join(sorted(self._modules))}) restarted and lost "
                "its in-memory state; the run rewinds to its last checkpoint"
            )
            ray.get(journal.note_restart.remote(actor_id))

    def _replay(self, entries: list[tuple[str, str, tuple, dict]], tracker: Any) -> None:
        names = [args[0] for _, method, args, _ in entries if method == "set_module_name"]
        logger.warning("actor restarted: rebuilding %s", names)
        if tracker is not None:
            for name in names:
                ray.get(tracker.forget_module.remote(name))
        for key, method, args, kwargs in entries:
            if method not in NOT_REPLAYED:
                getattr(self._modules[key], method)(*args, **kwargs)

    def method_names(self) -> dict[str, list[str]]:
        """Module key -> its public method names (what the wrappers rebind)."""
        return {key: public_methods(m) for key, m in self._modules.items()}

    def call(self, key: str, method: str, *args: Any, **kwargs: Any) -> Any:
        """`modules[key].method(*args, **kwargs)`: the one entry point of every wrapper."""
        if self._fence is not None and method not in THROUGH_FENCE:
            raise ActorRestartedError(f"{key}.{method}: {self._fence}")
        try:
            module = self._modules[key]
        except KeyError:
            hosted = sorted(self._modules)
            raise KeyError(f"no module {key!r} in this actor; hosted: {hosted}") from None
        return getattr(module, method)(*args, **kwargs)

    def ping(self) -> bool:
        return True

    def call_counts(self) -> dict[str, int]:
        """Ray calls this actor's modules made through `execute`, by `module.method`."""
        from nexrl.execute import REMOTE_CALLS

        return dict(REMOTE_CALLS)

    def flush_tracker(self) -> None:
        """Deliver the tracker calls this actor's modules queued (nexrl/monitoring/outbox.py)."""
        from nexrl.monitoring.outbox import flush_all

        flush_all(timeout=30.0)

    def unfence(self) -> None:
        """The controller stopped every loop: calls reach the rebuilt modules again."""
        self._fence = None

    def node_id(self) -> str:
        """The Ray node this actor runs on (hex)."""
        return ray.get_runtime_context().get_node_id()

    def pid(self) -> int:
        """The actor's process id (fault-injection tests kill it)."""
        return os.getpid()

    def torch_threads(self) -> int:
        """Threads torch computes with in this actor (`ray.torch_threads`)."""
        import torch

        return torch.get_num_threads()


class RemoteMethod:
    """`wrapper.<method>`: has `.remote(...)`, so `execute` sends it through Ray."""

    def __init__(self, actor: Any, key: str, method: str, journal: Any = None) -> None:
        self._actor, self._key, self._method = actor, key, method
        self._journal = journal if method in JOURNALED else None
        self.__name__ = f"{key}.{method}"

    def remote(self, *args: Any, **kwargs: Any) -> Any:
        if self._journal is not None:
            actor_id = self._actor._actor_id.hex()
            self._journal.append.remote(actor_id, self._key, self._method, args, kwargs)
        return self._actor.call.remote(self._key, self._method, *args, **kwargs)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise TypeError(
            f"{self.__name__} is a Ray actor method: call execute({self.__name__}, ...)"
        )


class RayActorWrapper:
    """One module inside a (possibly shared) actor; its methods are rebound as attributes."""

    def __init__(
        self,
        actor: Any,
        role: NexRLRole | str,
        index: int,
        methods: list[str],
        is_colocated: bool = True,
        journal: Any = None,
    ) -> None:
        self.actor = actor
        self.role = role
        self.index = index
        self.key = module_key(role, index)
        self.is_colocated = is_colocated
        self._methods = list(methods)
        self._journal = journal
        for name in self._methods:
            setattr(self, name, RemoteMethod(actor, self.key, name, journal))

    def __repr__(self) -> str:
        return f"RayActorWrapper({self.key})"

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        args = (self.actor, self.role, self.index, self._methods, self.is_colocated, self._journal)
        return _restore_wrapper, args


def _restore_wrapper(
    actor: Any, role: NexRLRole | str, index: int, methods: list[str], colocated: bool, journal: Any
) -> ModuleLike | RayActorWrapper:
    """Unpickle: the module object itself inside its own actor, else a wrapper."""
    local = _LOCAL_MODULES.get((actor._actor_id.hex(), module_key(role, index)))
    if local is not None:
        return local
    return RayActorWrapper(actor, role, index, methods, colocated, journal)


@dataclass
class _Registration:
    role: NexRLRole | str
    builder: Builder
    count: int
    group: str


@dataclass
class GroupOptions:
    """Ray options of one colocation group's actor."""

    num_cpus: float = RayGroupConfig.num_cpus
    num_gpus: float = RayGroupConfig.num_gpus
    max_concurrency: int = RayConfig.max_concurrency
    max_restarts: int = RayConfig.max_restarts
    resources: dict[str, float] = field(default_factory=dict)
    scheduling_strategy: Any = None


class RayResourceManager:
    """Registers roles, creates one actor per colocation group, hands out wrappers.

    `group_options`: Ray options per colocation group (default `GroupOptions()`);
    `env_vars`: environment of every actor; `tracker`: the activity tracker actor,
    told to drop the in-flight work of modules whose actor restarted.
    """

    def __init__(
        self,
        group_options: dict[str, GroupOptions] | None = None,
        env_vars: dict[str, str] | None = None,
        tracker: Any = None,
    ) -> None:
        self._config: DictConfig | None = None
        self._registrations: list[_Registration] = []
        self._group_options = dict(group_options or {})
        self._env_vars = dict(env_vars or {})
        self._tracker = tracker
        self._journal: Any = None
        self._wrappers: dict[str, list[RayActorWrapper]] = {}
        self.actors: dict[str, Any] = {}

    def register_role(
        self,
        role: NexRLRole | str,
        builder: Builder | type,
        config: DictConfig,
        count: int,
        colocation_group: str | None = None,
    ) -> None:
        """`count` modules of `role`, built by `builder(config)`; None group = own actor."""
        if count < 0:
            raise ValueError(f"register_role({role}): count must be >= 0, got {count}")
        if _role_name(role) in {_role_name(r.role) for r in self._registrations}:
            raise ValueError(f"register_role: role {_role_name(role)!r} is already registered")
        self._config = config
        group = colocation_group or f"_solo_{_role_name(role)}"
        self._registrations.append(_Registration(role, builder, count, group))

    def create_all_actors(self) -> dict[str, Any]:
        """One actor per colocation group; waits until every module is built."""
        groups: dict[str, list[_Registration]] = {}
        for reg in self._registrations:
            if reg.count > 0:
                groups.setdefault(reg.group, []).append(reg)
        if any(self._options(g).max_restarts for g in groups):
            self._journal = ray.remote(SetupJournal).options(num_cpus=0).remote()
        pending = {}
        for group, regs in groups.items():
            specs = [(r.role, r.builder, r.count) for r in regs]
            self.actors[group] = self._actor_class(group).remote(
                self._config, specs, self._journal, self._tracker, group
            )
            pending[group] = self.actors[group].method_names.remote()
        for group, ref in pending.items():
            names = ray.get(ref)
            journal = self._journal if self._options(group).max_restarts else None
            for reg in groups[group]:
                self._wrappers[_role_name(reg.role)] = [
                    RayActorWrapper(
                        self.actors[group],
                        reg.role,
                        i,
                        names[module_key(reg.role, i)],
                        is_colocated=not group.startswith("_solo_"),
                        journal=journal,
                    )
                    for i in range(reg.count)
                ]
        return self.actors

    def _options(self, group: str) -> GroupOptions:
        return self._group_options.get(group, GroupOptions())

    def _actor_class(self, group: str) -> Any:
        opts = self._options(group)
        extra = (
            {"scheduling_strategy": opts.scheduling_strategy} if opts.scheduling_strategy else {}
        )
        return ray.remote(ModuleActor).options(
            num_cpus=opts.num_cpus,
            num_gpus=opts.num_gpus,
            resources=opts.resources or None,
            max_concurrency=opts.max_concurrency,
            max_restarts=opts.max_restarts,
            max_task_retries=opts.max_restarts,  # retried once the actor is back
            runtime_env=runtime_env_for(self._env_vars),
            **extra,
        )

    def get_actor_wrapper(self, role: NexRLRole | str) -> list[RayActorWrapper]:
        try:
            return self._wrappers[_role_name(role)]
        except KeyError:
            raise KeyError(
                f"role {_role_name(role)!r} has no actors; registered: {sorted(self._wrappers)} "
                "(call create_all_actors() after register_role())"
            ) from None

    def group_of(self, role: NexRLRole | str) -> str:
        """The colocation group (actor) that hosts `role`."""
        for reg in self._registrations:
            if _role_name(reg.role) == _role_name(role):
                return reg.group
        raise KeyError(f"role {_role_name(role)!r} is not registered")

    def placement(self) -> dict[str, str]:
        """Colocation group -> the Ray node (hex id) its actor runs on."""
        ids = ray.get([actor.node_id.remote() for actor in self.actors.values()])
        return dict(zip(self.actors, ids, strict=True))

    def restarted(self, settle: bool = False, timeout: float = 600.0) -> dict[str, list[str]]:
        """Colocation group -> its module keys, for each actor that restarted since the
        last call (fenced until `unfence`); empty without restarts enabled. `settle`: first
        wait until every actor answers a ping (one being restarted answers once rebuilt,
        after its note; a dead one fails at once)."""
        if self._journal is None:
            return {}
        if settle:
            pings = [a.ping.remote() for a in self.actors.values()]
            ray.wait(pings, num_returns=len(pings), timeout=timeout)
        ids = set(ray.get(self._journal.restarts.remote()))
        groups = [g for g, actor in self.actors.items() if actor._actor_id.hex() in ids]
        return {g: self._module_keys(g) for g in groups}

    def _module_keys(self, group: str) -> list[str]:
        regs = [r for r in self._registrations if r.group == group]
        return [module_key(r.role, i) for r in regs for i in range(r.count)]

    def unfence(self, groups: list[str]) -> None:
        ray.get([self.actors[g].unfence.remote() for g in groups])

    def flush_tracker(self) -> None:
        """Every module actor delivers its queued tracker calls (a dead one has none)."""
        for group, actor in self.actors.items():
            try:
                ray.get(actor.flush_tracker.remote(), timeout=60)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError) as exc:
                logger.warning("flush_tracker: the %s actor did not answer: %r", group, exc)

    def kill_all(self) -> None:
        """Kill every actor this manager created (no restart)."""
        for actor in [*self.actors.values(), self._journal]:
            if actor is not None:
                ray.kill(actor, no_restart=True)
        self.actors.clear()
        self._journal = None


def runtime_env_for(env_vars: dict[str, str]) -> dict[str, Any] | None:
    """Per-actor runtime env, or None when the job already sets these variables.

    A per-actor env makes Ray start a fresh worker process (seconds each); matching the
    job's env lets actors reuse the prestarted workers.
    """
    job_env = (ray.get_runtime_context().runtime_env or {}).get("env_vars") or {}
    missing = {k: v for k, v in env_vars.items() if job_env.get(k) != v}
    return {"env_vars": env_vars} if missing else None


def _role_name(role: NexRLRole | str) -> str:
    return role.value if isinstance(role, NexRLRole) else str(role)
