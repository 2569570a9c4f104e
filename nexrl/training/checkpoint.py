"""Checkpoints of the torch engine: HF weights plus an exact trainer state.

Layout of a checkpoint directory:

    config.json, model*.safetensors   `save_pretrained`: loadable by `from_pretrained`
    tokenizer files                   copied from the engine's model path, if it has them
    trainer_state.pt                  optimizer, scheduler, RNG states, step
    COMPLETE                          manifest: every file with its size and sha256 (written last)

Saves are atomic: everything is written into a hidden staging folder beside the
target (`.global_step_N.staging-<pid>-<hex>`), each file is fsync'd, the
`COMPLETE` manifest is written last, and only then is the folder renamed to its
final name. A process killed at any point leaves either the previous state or a
complete checkpoint, plus at most a staging folder that resume ignores and
removes. `verify_checkpoint` says why a folder is not a complete checkpoint
(no marker, a malformed manifest, a file missing, of the wrong size or whose
content does not match its sha256), so resume can skip it and say so. A write that
fails for want of space or permission raises `CheckpointWriteError`, one line naming
the folder; the checkpoints already saved stay as they were.

`trainer_state.pt` holds only tensors, numbers, strings and containers, and is
read with `torch.load(weights_only=True)`, so a checkpoint cannot run code.
Full (unsharded) state dicts go through `torch.distributed.checkpoint.state_dict`,
which works the same for a plain module, DDP and FSDP2; rank 0 writes.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import json
import logging
import os
import random
import shutil
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TypedDict, TypeVar, runtime_checkable

import torch
import torch.distributed as dist
from safetensors.torch import load_file
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)
from torch.distributed.tensor import DTensor

if TYPE_CHECKING:
    from torch.distributed.checkpoint.state_dict import ValueType

    from nexrl.training.torch_engine import TorchTrainEngine

logger = logging.getLogger(__name__)

STATE_FILE = "trainer_state.pt"
COMPLETE_FILE = "COMPLETE"
STAGING_TAG = ".staging-"
MANIFEST_FORMAT = 1
TOKENIZER_FILES = (
    "tokenizer_config.json",
    "tokenizer.json",
    "special_tokens_map.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
)


def _options(cpu_offload: bool = True) -> StateDictOptions:
    distributed = dist.is_available() and dist.is_initialized()
    return StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload and distributed)


def full_model_state(model: torch.nn.Module, copy: bool = True) -> dict[str, torch.Tensor]:
    """Unsharded state dict as independent CPU tensors (no shared storage); with `copy`
    False, an unsharded module's own tensors, detached (for a caller that copies them
    elsewhere at once: the child-process trainer's shared buffer)."""
    sharded = any(isinstance(p, DTensor) for p in model.parameters())
    # the distributed gather costs ~3 ms of Python per call on a plain module: the weight
    # export runs it every step, so a module with no sharded parameter reads its own
    state = (
        _only_tensors(get_model_state_dict(model, options=_options()))
        if sharded
        else model.state_dict()
    )
    if not copy:
        return {k: v.detach() for k, v in state.items()}
    return {k: v.detach().to("cpu", copy=True) for k, v in state.items()}


def _only_tensors(state: Mapping[str, object]) -> dict[str, torch.Tensor]:
    """A full model state dict as tensors (what `get_model_state_dict` gives for a model)."""
    for name, value in state.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"model state {name!r} is {type(value).__name__}, not a tensor")
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@runtime_checkable
class SavesPretrained(Protocol):
    """An HF `PreTrainedModel` or a peft model (which writes its adapter)."""

    def save_pretrained(self, save_directory: str, **kwargs: Any) -> None: ...


class HFExportTarget(Protocol):
    """What `write_hf` reads: a `TorchTrainEngine`, or its peft model's base model."""

    @property
    def rank(self) -> int: ...
    @property
    def model(self) -> torch.nn.Module: ...
    @property
    def model_path(self) -> str: ...


@dataclass(frozen=True)
class HFFolderSource:
    """An `HFExportTarget` other than the engine: a peft model's base model."""

    rank: int
    model: torch.nn.Module
    model_path: str


def write_hf(engine: HFExportTarget, path: str, state: dict[str, torch.Tensor]) -> None:
    """Replace `path` with `state` as an HF model folder plus the tokenizer (rank 0 only).

    Atomic (staging folder, then rename) but not fsync'd: this is the weight-sync
    export, rewritten every step; a reader sees the old or the new weights, never
    a mix, and an engine that hard-linked the old files keeps them intact.
    """
    if engine.rank != 0:
        return
    with atomic_directory(path, durable=False) as staging:
        _write_hf_files(engine, staging, state)


def _write_hf_files(engine: HFExportTarget, out: Path, state: dict[str, torch.Tensor]) -> None:
    model = engine.model
    if not isinstance(model, SavesPretrained):
        raise TypeError(f"{type(model).__name__} has no save_pretrained: no HF folder to write")
    model.save_pretrained(str(out), state_dict=state, safe_serialization=True)
    for name in TOKENIZER_FILES:
        src = Path(engine.model_path) / name
        if src.exists():
            (out / name).write_bytes(src.read_bytes())


def save(engine: TorchTrainEngine, path: str) -> None:
    """Weights (HF format) and trainer state, atomically; every rank must call it (collectives)."""
    state = full_model_state(engine.model, copy=False)  # written now, before any update
    optim = get_optimizer_state_dict(engine.model, engine.optimizer, options=_options())
    if engine.rank == 0:
        trainer_state = {
            "step": engine.step,
            "optimizer": optim,
            "scheduler": engine.scheduler.state_dict(),
            "rng": _rng_state(),
        }
        with atomic_directory(path) as staging:
            _write_hf_files(engine, staging, state)
            torch.save(trainer_state, staging / STATE_FILE)
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def load(engine: TorchTrainEngine, path: str) -> None:
    """Restore what `save` wrote; a directory without trainer_state.pt loads weights only.

    A folder with a `COMPLETE` manifest must match it (else a clear error, not a
    safetensors parse failure); one without (an older nexrl, a bare HF folder) loads
    with a warning.
    """
    root = Path(path)
    if (root / COMPLETE_FILE).exists():
        problem = verify_checkpoint(root)
        if problem:
            raise ValueError(f"checkpoint {path} is incomplete: {problem}")
    else:
        logger.warning("checkpoint %s has no %s marker; loading it unverified", path, COMPLETE_FILE)
    state = _read(root, "*.safetensors", lambda: read_hf_weights(root))
    tied = set(getattr(engine.model, "_tied_weights_keys", None) or [])
    expected = set(get_model_state_dict(engine.model, options=_options(False)))
    missing = sorted(expected - set(state) - tied)
    if missing:
        raise KeyError(f"checkpoint {path} lacks weights {missing[:5]} (of {len(missing)})")
    loaded: dict[str, ValueType] = dict(state)  # the signature's value type is wider
    set_model_state_dict(
        engine.model, loaded, options=StateDictOptions(full_state_dict=True, strict=False)
    )
    state_file = root / STATE_FILE
    if not state_file.exists():
        return
    trainer_state: dict[str, Any] = _read(
        root, STATE_FILE, lambda: torch.load(state_file, weights_only=True, map_location="cpu")
    )
    set_optimizer_state_dict(
        engine.model,
        engine.optimizer,
        trainer_state["optimizer"],
        options=StateDictOptions(full_state_dict=True),
    )
    engine.scheduler.load_state_dict(trainer_state["scheduler"])
    engine._step = int(trainer_state["step"])
    _set_rng_state(trainer_state["rng"])


def _read(root: Path, name: str, read: Callable[[], _T]) -> _T:
    """`read()`, with a file that does not parse reported as one line naming it."""
    try:
        return read()
    except FileNotFoundError:
        raise
    except Exception as exc:  # safetensors, torch.load: many types for one cause
        first = str(exc).strip().splitlines()[0][:200] if str(exc).strip() else ""
        raise ValueError(
            f"checkpoint {root}: cannot read {name} ({type(exc).__name__}: {first})"
        ) from exc


# -- atomic folders ------------------------------------------------------------------
class CheckpointWriteError(OSError):
    """A folder could not be written (disk full, no permission): one line naming it."""


DISK_FULL_SIGNS = ("no space left", "unexpected pos", "disk quota")
"""How a full disk shows up in messages that carry no errno (torch.save's zip writer
says `enforce fail at inline_container.cc ... unexpected pos`)."""


def write_error(folder: Path, exc: BaseException) -> CheckpointWriteError | None:
    """A `CheckpointWriteError` for an exception caused by a full disk or a folder that
    cannot be written, else None (a bug: let it propagate as it is)."""
    code = getattr(exc, "errno", None)
    text = str(exc).lower()
    if code in (errno.ENOSPC, errno.EDQUOT) or any(s in text for s in DISK_FULL_SIGNS):
        try:
            free = f"{shutil.disk_usage(folder if folder.exists() else folder.parent).free:,}"
        except OSError:
            free = "unknown"
        return CheckpointWriteError(
            errno.ENOSPC,
            f"cannot write {folder}: disk full ({free} bytes free); free space or point "
            "output_dir elsewhere (the checkpoints saved before are intact)",
        )
    if code in (errno.EACCES, errno.EPERM, errno.EROFS):
        reason = "read-only file system" if code == errno.EROFS else "permission denied"
        return CheckpointWriteError(code, f"cannot write {folder}: {reason}")
    return None


@contextlib.contextmanager
def atomic_directory(
    final: str | Path, hash_files: bool | None = None, durable: bool = True
) -> Iterator[Path]:
    """Yield an empty staging folder beside `final`; on a clean exit seal and publish it.

    Usage: write every file of the checkpoint into the yielded folder inside the
    `with`; nothing appears at `final` until the block ends without an error, and
    then all of it appears at once. On an error the staging folder is removed; a full
    disk or an unwritable folder raises `CheckpointWriteError`.
    `durable=False` skips the fsyncs (atomic against other readers, not power loss).
    `hash_files` (default: `durable`) puts each file's sha256 in the manifest, so resume
    checks the content, not only the sizes.
    """
    final = Path(final)
    hash_files = durable if hash_files is None else hash_files
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        staging = final.parent / f".{final.name}{STAGING_TAG}{os.getpid()}-{uuid.uuid4().hex[:8]}"
        staging.mkdir()
    except OSError as exc:
        raise (write_error(final.parent, exc) or exc) from exc
    try:
        yield staging
        seal(staging, hash_files=hash_files, durable=durable)
        publish(staging, final)
    except BaseException as exc:
        problem = write_error(final, exc)
        shutil.rmtree(staging, ignore_errors=True)
        if problem is not None:
            raise problem from exc
        raise


class ManifestEntry(TypedDict, total=False):
    """One file of a `COMPLETE` manifest: its size, and its sha256 when hashed."""

    size: int
    sha256: str


class Manifest(TypedDict):
    """The `COMPLETE` marker's JSON: written last, so a checkpoint with it is whole."""

    format: int
    saved_at: float
    files: dict[str, ManifestEntry]


class RngState(TypedDict, total=False):
    """The random generators' states saved with a checkpoint (`cuda` when there is one)."""

    torch: torch.Tensor
    python: tuple[int, Sequence[int], float | None]
    cuda: list[torch.Tensor]


_T = TypeVar("_T")


def seal(folder: Path, hash_files: bool = False, durable: bool = True) -> Manifest:
    """fsync every file of `folder`, then write the `COMPLETE` manifest (sizes, opt. sha256)."""
    files: dict[str, ManifestEntry] = {}
    for f in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != COMPLETE_FILE):
        if durable:
            _fsync_file(f)
        entry: ManifestEntry = {"size": f.stat().st_size}
        if hash_files:
            entry["sha256"] = _sha256(f)
        files[f.relative_to(folder).as_posix()] = entry
    manifest: Manifest = {"format": MANIFEST_FORMAT, "saved_at": time.time(), "files": files}
    marker = folder / COMPLETE_FILE
    marker.write_text(json.dumps(manifest, indent=1))
    if durable:
        _fsync_file(marker)
        _fsync_dir(folder)
    return manifest


def publish(staging: Path, final: Path) -> None:
    """Rename `staging` to `final`; an existing `final` is moved aside first, then deleted."""
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        final.rename(old)
    staging.rename(final)
    _fsync_dir(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def verify_checkpoint(path: str | Path, check_hashes: bool = True) -> str | None:
    """None for a complete checkpoint, else why not (for the resume log)."""
    root = Path(path)
    marker = root / COMPLETE_FILE
    if not root.is_dir():
        return "not a folder"
    if not marker.exists():
        return f"no {COMPLETE_FILE} marker: the save did not finish (or an older nexrl wrote it)"
    try:
        files = manifest_files(marker)
    except ValueError as exc:
        return str(exc)
    for name, entry in files.items():
        f = root / name
        if not f.is_file():
            return f"{name} is missing"
        size = f.stat().st_size
        if size != entry["size"]:
            return f"{name} has {size} bytes, the manifest says {entry['size']}"
        if check_hashes and "sha256" in entry and _sha256(f) != entry["sha256"]:
            return f"{name} does not match its sha256 in the manifest (its content changed)"
    return None


def manifest_files(marker: Path) -> dict[str, ManifestEntry]:
    """The `files` map of a `COMPLETE` manifest; ValueError saying what is wrong with it."""
    try:
        manifest = json.loads(marker.read_text())
    except (OSError, ValueError) as exc:
        raise ValueError(f"unreadable {COMPLETE_FILE} manifest ({exc})") from None
    files = manifest.get("files") if isinstance(manifest, dict) else None
    if not isinstance(files, dict):
        kind = type(files).__name__ if files is not None else "no 'files' key"
        raise ValueError(f"malformed {COMPLETE_FILE} manifest: 'files' must map names ({kind})")
    for name, entry in files.items():
        if not isinstance(entry, dict) or not isinstance(entry.get("size"), int):
            raise ValueError(f"malformed {COMPLETE_FILE} manifest: {name!r} has no integer 'size'")
        if "sha256" in entry and not isinstance(entry["sha256"], str):
            raise ValueError(f"malformed {COMPLETE_FILE} manifest: {name!r} has a bad 'sha256'")
    return files


def saved_at(path: str | Path) -> float:
    """When the checkpoint at `path` was sealed (from its manifest; 0 if unknown)."""
    try:
        return float(json.loads((Path(path) / COMPLETE_FILE).read_text())["saved_at"])
    except (OSError, ValueError, KeyError, TypeError):
        return 0.0


def staging_leftovers(folder: str | Path) -> list[Path]:
    """Staging / moved-aside folders under `folder` left by a process that died mid-save."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    return sorted(
        p
        for p in folder.iterdir()
        if p.is_dir() and p.name.startswith(".") and (STAGING_TAG in p.name or ".old-" in p.name)
    )


def _fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _fsync_dir(path: Path) -> None:
    with contextlib.suppress(OSError):  # some filesystems cannot fsync a directory
        _fsync_file(path)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def read_hf_weights(root: Path) -> dict[str, torch.Tensor]:
    files = sorted(root.glob("*.safetensors"))
    if not files:
        raise FileNotFoundError(f"no *.safetensors weights under {root}")
    state: dict[str, torch.Tensor] = {}
    for f in files:
        state.update(load_file(str(f)))
    return state


def _rng_state() -> RngState:
    state: RngState = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: RngState) -> None:
    torch.set_rng_state(state["torch"])
    version, internal, gauss = state["python"]
    random.setstate((version, tuple(internal), gauss))
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
