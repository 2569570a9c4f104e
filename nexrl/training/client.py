"""`TrainServiceClient`: what the TrainWorker holds to reach a train engine.

Three backends behind one class, chosen by `service.train_service.backend`:

- "builtin": a `TorchTrainEngine` in this process;
- "process": a `TorchTrainEngine` in a child process of its own, weights through
  shared memory (`ProcessTrainEngine`);
- "remote": the HTTP train service (`nexrl train-service`) at `url`.

The config's default, "auto", is made concrete by the config loader (`process` for a
local fully-async run with staleness >= 1, nexrl/config/derived.py); a client built on
its own takes it as "builtin".

The client adds only transport concerns (timeouts, retries, auth); no
algorithm logic. Retries: calls that do not change state (logprobs, export,
save, load) retry on any transport error; `train_batch` retries only when the
connection could not be made, so an optimizer step is never applied twice.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any, overload

import httpx
import torch
from tenacity import retry, retry_if_exception_type, stop_after_attempt, wait_exponential

from nexrl.config.schema import TrainServiceConfig
from nexrl.training import wire
from nexrl.training.backends import REMOTE, TRAIN_ENGINES
from nexrl.training.config import EngineConfig
from nexrl.types import Batch


def as_service_config(config: TrainServiceConfig | Mapping[str, Any] | None) -> TrainServiceConfig:
    """The typed `service.train_service` section; a dict must use its keys only."""
    if isinstance(config, TrainServiceConfig):
        return config
    raw = {k: v for k, v in dict(config or {}).items() if v is not None}
    valid = set(TrainServiceConfig.__dataclass_fields__)
    unknown = sorted(set(raw) - valid)
    if unknown:
        raise ValueError(f"unknown train_service key(s) {unknown}; valid: {sorted(valid)}")
    return TrainServiceConfig(**raw)


class TrainServiceClient:
    """Train engine handle: in-process ("builtin"), in a child process ("process") or
    over HTTP ("remote")."""

    def __init__(
        self,
        config: TrainServiceConfig | Mapping[str, Any],
        engine_config: Mapping[str, Any] | EngineConfig,
        model_path: str,
    ) -> None:
        cfg = as_service_config(config)
        self.backend = "builtin" if cfg.backend == "auto" else cfg.backend
        if self.backend != REMOTE:
            TRAIN_ENGINES.check(self.backend)  # an unknown name fails here, naming the choices
        if self.backend == REMOTE and not cfg.url:
            raise ValueError("train_service.backend='remote' needs train_service.url")
        self.config = cfg
        self.engine_config = EngineConfig.from_mapping(engine_config)
        self.model_path = str(model_path)
        self.model_tag = cfg.model_tag
        self._engine: Any = None
        self._http: _Http | None = None
        self._remote_fills_old_logprobs = False

    @property
    def fills_old_logprobs(self) -> bool:
        """Whether `train_batch` fills missing old logprobs from its own forward: the
        in-process engine's flag, or what the HTTP service's `/health` said (False for a
        service that does not say)."""
        if self._engine is not None:
            return bool(getattr(self._engine, "fills_old_logprobs", False))
        return self._remote_fills_old_logprobs

    def initialize(self) -> None:
        """Build the engine (here or in its child process), or check that the remote
        service answers."""
        if self.backend != REMOTE:
            self._engine = TRAIN_ENGINES.get(self.backend)(self.engine_config, self.model_path)
        else:
            self._http = _Http(self.config)
            health = self._http.json("GET", "/health", idempotent=True)
            self._remote_fills_old_logprobs = bool(health.get("fills_old_logprobs", False))

    def compute_logprobs(self, batch: Batch) -> torch.Tensor:
        """(B, T) logprobs under the current weights."""
        if self._engine is not None:
            return self._engine.compute_logprobs(batch)
        return self._remote().some_tensors("/compute_logprobs", wire.pack_batch(batch))["logprobs"]

    def compute_ref_logprobs(self, batch: Batch) -> torch.Tensor | None:
        """(B, T) logprobs under the reference model; None when none is configured."""
        if self._engine is not None:
            return self._engine.compute_ref_logprobs(batch)
        out = self._remote().tensors("/compute_ref_logprobs", wire.pack_batch(batch))
        return None if out is None else out["logprobs"]

    def train_batch(
        self, batch: Batch, loss_fn: str, loss_kwargs: dict[str, Any]
    ) -> dict[str, float]:
        """One optimizer step; returns the engine's metrics."""
        if self._engine is not None:
            return self._engine.train_batch(batch, loss_fn, loss_kwargs)
        body = wire.pack_batch(batch, {"loss_fn": loss_fn, "loss_kwargs": dict(loss_kwargs or {})})
        return self._remote().json("POST", "/train_batch", content=body, idempotent=False)

    def save_checkpoint(self, path: str) -> None:
        if self._engine is not None:
            return self._engine.save(path)
        self._remote().json("POST", "/save", json={"path": path}, idempotent=True)

    def load_checkpoint(self, path: str) -> None:
        if self._engine is not None:
            return self._engine.load(path)
        self._remote().json("POST", "/load", json={"path": path}, idempotent=True)

    @overload
    def export_weights(self, path: None = None, copy: bool = True) -> dict[str, torch.Tensor]: ...
    @overload
    def export_weights(self, path: str, copy: bool = True) -> str: ...
    def export_weights(
        self, path: str | None = None, copy: bool = True
    ) -> dict[str, torch.Tensor] | str:
        """State dict (CPU tensors), or the HF directory written at `path`. `copy=False`:
        an engine in this process may hand out its own tensors (`TorchTrainEngine.export_weights`);
        a remote one always sends a copy."""
        if self._engine is not None:
            return self._engine.export_weights(path, copy=copy)
        if path is not None:
            out = self._remote().json(
                "POST", "/export_weights", json={"path": path}, idempotent=True
            )
            return out["path"]
        return self._remote().some_tensors("/export_weights", None, json={"path": None})

    def get_step(self) -> int:
        if self._engine is not None:
            return self._engine.step
        return int(self._remote().json("GET", "/health", idempotent=True)["step"])

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
        if self._engine is not None and hasattr(self._engine, "close"):
            self._engine.close()

    def _remote(self) -> _Http:
        if self._http is None:
            raise RuntimeError("TrainServiceClient.initialize() was not called")
        return self._http


class _Http:
    """httpx client with auth, timeout and tenacity retries."""

    def __init__(self, cfg: TrainServiceConfig) -> None:
        headers = {"authorization": f"Bearer {cfg.api_key}"} if cfg.api_key else {}
        self.client = httpx.Client(
            base_url=str(cfg.url).rstrip("/"),
            headers=headers,
            timeout=cfg.timeout,
        )
        self.attempts = cfg.max_retries + 1

    def request(self, method: str, path: str, idempotent: bool, **kw: Any) -> httpx.Response:
        errors = httpx.TransportError if idempotent else httpx.ConnectError
        call = retry(
            retry=retry_if_exception_type(errors),
            stop=stop_after_attempt(self.attempts),
            wait=wait_exponential(multiplier=0.2, max=5.0),
            reraise=True,
        )(self.client.request)
        response = call(method, path, **kw)
        if response.status_code >= 400:
            raise RuntimeError(
                f"train service {method} {path} failed "
                f"({response.status_code}): {response.text[:500]}"
            )
        return response

    def json(self, method: str, path: str, idempotent: bool, **kw: Any) -> Any:
        return self.request(method, path, idempotent, **kw).json()

    def tensors(self, path: str, body: bytes | None, **kw: Any) -> dict[str, torch.Tensor] | None:
        if body is not None:
            kw["content"] = body
        response = self.request("POST", path, True, **kw)
        if response.status_code == 204:
            return None
        return wire.unpack(response.content)[0]

    def some_tensors(self, path: str, body: bytes | None, **kw: Any) -> dict[str, torch.Tensor]:
        """`tensors` of an endpoint that always answers with tensors: 204 is an error."""
        out = self.tensors(path, body, **kw)
        if out is None:
            raise RuntimeError(f"train server answered {path} with no tensors (204)")
        return out

    def close(self) -> None:
        self.client.close()
