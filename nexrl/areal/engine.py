"""AReaL-lite's `InferenceEngine` (seed 004) over nexrl's engines.

One object with the seed's whole rollout API: `initialize`, `agenerate`
(text or token ids), `submit` / `wait` / `rollout_batch` / `prepare_batch`,
async `update_weights(WeightUpdateMeta)`, `check_health`, `destroy`. Under it
sit nexrl's pieces, unchanged: the built-in `Engine` (or a `RemoteBackend` when
`initialize` gets an address) generates, and `WorkflowExecutor` runs the
episodes on its event-loop thread.

`update_weights` returns a future that is both awaitable (the seed's `async`
signature) and has `.result()` (the seed's training script: start the update,
`actor.upload_weights(meta)`, then `future.result()`). For a `disk` update it
waits until the trainer has finished writing `meta.path` (the marker
`upload_weights` writes last), then loads it.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import time
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any, cast

from nexrl.areal.types import FinetuneSpec, LLMRequest, LLMResponse, WeightUpdateMeta
from nexrl.areal.workflow import DistributedBatch, accept_fn, as_nexrl_workflow
from nexrl.inference import protocol as proto
from nexrl.rollout.workflow import Row, WorkflowExecutor

UPLOAD_DONE = ".nexrl_upload_done"
"""Written last into a `disk` update's directory by `TrainEngine.upload_weights`; holds
the version. The inference side loads only once it exists."""


def config_option(config: object, key: str, default: Any = None) -> Any:
    """`config[key]` (a mapping) or `config.key` (a dataclass), `default` when unset or None."""
    if config is None:
        return default
    if isinstance(config, Mapping):
        value = config.get(key, default)
    else:
        value = getattr(config, key, default)
    return default if value is None else value


class WeightUpdateFuture(concurrent.futures.Future):
    """A `concurrent.futures.Future` that can also be awaited."""

    def __await__(self):
        return asyncio.wrap_future(self).__await__()


class InferenceEngine:
    """The seed's inference engine.

    config: a mapping (or attribute object) with `path` (model directory; None: the
        embedded tiny model), `engine` (built-in `Engine` options), `max_concurrent`
        (episodes in flight, default 64), `upload_timeout_s` (how long a disk update waits
        for the trainer, default 600), and for a remote server `api_key` / `timeout`.
    engine: an already built nexrl engine to wrap instead (`initialize` keeps it).
    """

    def __init__(self, config: object = None, engine: proto.InferenceEngine | None = None) -> None:
        self.config = config
        self._engine = engine
        self._executor: WorkflowExecutor | None = None
        self._updates = concurrent.futures.ThreadPoolExecutor(1, "nexrl-weight-update")
        self._consumed: dict[str, tuple[int, int]] = {}  # path -> upload marker loaded

    def _opt(self, key: str, default: Any = None) -> Any:
        return config_option(self.config, key, default)

    # -- control ----------------------------------------------------------------------
    def initialize(self, addr: str | None = None, ft_spec: FinetuneSpec | None = None) -> None:
        """Start the engine: the built-in engine on `config.path`, or a client of the
        server at `addr` (`nexrl serve`, vLLM or SGLang). `ft_spec` is unused here."""
        addresses = list(self._opt("addresses", []))
        if addr is None and addresses:
            if len(addresses) > 1:
                raise ValueError(
                    f"rollout.engine.addresses={addresses}: one server per InferenceEngine; "
                    "nexrl balances replicas with ray.inference_replicas"
                )
            addr = addresses[0]
        if self._engine is None:
            if addr is not None:
                from nexrl.inference.remote import RemoteBackend

                url = addr if "://" in addr else f"http://{addr}"
                self._engine = RemoteBackend(
                    {
                        "url": url,
                        "api_key": self._opt("api_key"),
                        "timeout": self._opt("timeout", 600),
                        "model": self._opt("path"),
                    }
                )
            else:
                from nexrl.inference.engine import Engine

                self._engine = Engine(self._opt("path"), **dict(self._opt("engine", {})))
        # the executor hands `self` to the episodes: they call this class's `agenerate`
        concurrency = int(self._opt("max_concurrent", 64))
        self._executor = WorkflowExecutor(cast(Any, self), max_concurrent=concurrency)

    @property
    def engine(self) -> Any:
        if self._engine is None:
            raise RuntimeError("InferenceEngine: call initialize() first")
        return self._engine

    @property
    def tokenizer(self) -> Any:
        return self.engine.tokenizer

    @property
    def version(self) -> int:
        return self.engine.version

    def check_health(self) -> bool:
        return bool(self.engine.health())

    def destroy(self) -> None:
        """Stop the episodes' loop and the engine, freeing its memory."""
        if self._executor is not None:
            self._executor.shutdown()
            self._executor = None
        if self._engine is not None:
            self._engine.shutdown()
            self._engine = None
        self._updates.shutdown(wait=False)

    # -- generation --------------------------------------------------------------------
    async def agenerate(
        self, req: LLMRequest | proto.GenerationRequest
    ) -> LLMResponse | proto.GenerationResponse:
        """`LLMRequest` -> `LLMResponse` (text is tokenized here); a nexrl
        `GenerationRequest` passes through to the engine unchanged."""
        if isinstance(req, proto.GenerationRequest):
            return await self.engine.agenerate(req)
        ids = list(req.input_ids)
        if any(not isinstance(t, int) for t in ids):
            bad = next(t for t in ids if not isinstance(t, int))
            raise ValueError(
                f"LLMRequest.input_ids must be token ids (int), got {type(bad).__name__} "
                f"{bad!r}; transformers 5's apply_chat_template returns a dict unless "
                "return_dict=False"
            )
        if not ids:
            if req.text is None:
                raise ValueError("LLMRequest needs `text` or `input_ids`, both are empty")
            ids = self.tokenizer.encode(req.text, add_special_tokens=False)
            req.input_ids = list(ids)
        start = time.perf_counter()
        gen = proto.GenerationRequest(ids, req.gconfig.to_sampling(), rid=req.rid)
        resp = await self.engine.agenerate(gen)
        latency = time.perf_counter() - start
        samples = [self._response(resp.input_ids, o, latency) for o in resp.outputs]
        first = samples[0]
        first.samples = samples[1:]
        return first

    def _response(self, ids: list[int], out: proto.GenerationOutput, latency: float) -> LLMResponse:
        text = out.text or self.tokenizer.decode(out.output_ids, skip_special_tokens=True)
        return LLMResponse(
            input_tokens=list(ids),
            output_tokens=list(out.output_ids),
            output_logprobs=list(out.output_logprobs),
            output_versions=list(out.output_versions),
            stop_reason=out.finish_reason,
            completion=text,
            latency=latency,
        )

    # -- weights -----------------------------------------------------------------------
    def update_weights(self, meta: WeightUpdateMeta) -> WeightUpdateFuture:
        """Load the weights `meta` describes; returns at once with a future (await it, or
        call `.result()`). A `disk` update waits for the trainer's upload to finish."""
        future = WeightUpdateFuture()
        timeout = float(self._opt("upload_timeout_s", 600))

        def run() -> None:
            try:
                self.engine.update_weights(self._nexrl_meta(meta, timeout))
                future.set_result(None)
            except BaseException as exc:
                future.set_exception(exc)

        self._updates.submit(run)
        return future

    def _nexrl_meta(self, meta: WeightUpdateMeta, timeout: float) -> proto.WeightUpdateMeta:
        version = meta.version
        if meta.type == "disk":
            stamp, text = self._wait_upload(Path(str(meta.path)), timeout)
            self._consumed[str(meta.path)] = stamp
            if version is None and text.strip():
                version = int(text)
        if version is None:
            version = self.version + 1
        return proto.WeightUpdateMeta(version, path=meta.path, state_dict=meta.state_dict)

    def _wait_upload(self, path: Path, timeout: float) -> tuple[tuple[int, int], str]:
        """The upload marker at `path` that this engine has not loaded yet (a directory
        reused every step holds the previous step's marker until the new upload lands)."""
        marker = path / UPLOAD_DONE
        deadline = time.monotonic() + timeout
        while True:
            try:
                st = marker.stat()
                stamp = (st.st_ino, st.st_mtime_ns)
                if stamp != self._consumed.get(str(path)):
                    return stamp, marker.read_text()
            except FileNotFoundError:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"no new weight upload at {path} within {timeout}s")
            time.sleep(0.01)

    # -- episodes ----------------------------------------------------------------------
    @property
    def executor(self) -> WorkflowExecutor:
        if self._executor is None:
            raise RuntimeError("InferenceEngine: call initialize() first")
        return self._executor

    def _pad(self) -> int:
        tok = self.tokenizer
        return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id or 0)

    def submit(self, data: Row, workflow: Any) -> None:
        """Start one episode of `workflow` on `data`; `wait` collects it."""
        self.executor.submit(data, as_nexrl_workflow(workflow, self))

    def wait(
        self,
        count: int,
        timeout: float | None = None,
        should_accept: Callable[[DistributedBatch], object] | None = None,
    ) -> DistributedBatch:
        """The next `count` accepted episodes; TimeoutError after `timeout` seconds."""
        trajs = self.executor.wait(count, timeout, accept_fn(should_accept, self._pad()))
        return DistributedBatch(trajs, self._pad())

    def rollout_batch(self, data: Iterable[Row], workflow: Any) -> DistributedBatch:
        """One episode per row of `data`, all finished (rejected episodes left out)."""
        trajs = self.executor.rollout(data, as_nexrl_workflow(workflow, self))
        return DistributedBatch(trajs, self._pad())

    rollout = rollout_batch  # the name in the seed's abstract class

    def prepare_batch(
        self,
        dataloader: Iterable[Row] | Iterable[list[Row]],
        workflow: Any,
        should_accept: Callable[[DistributedBatch], object] | None = None,
        batch_size: int | None = None,
    ) -> DistributedBatch:
        """Keep episodes running from `dataloader` until `batch_size` (default: the
        dataloader's) are accepted; episodes still running count toward the next call."""
        trajs = self.executor.prepare_batch(
            dataloader,
            as_nexrl_workflow(workflow, self),
            accept_fn(should_accept, self._pad()),
            batch_size,
        )
        return DistributedBatch(trajs, self._pad())
