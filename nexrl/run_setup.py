"""Turn a validated config into a resolved run: paths, model, data on disk.

After `resolve_run_config` every path in the config is concrete, so any
builder (here or in a Ray actor) can construct its module from the config
alone. The resolved config is saved in the run directory.

Resume (`resume.mode=auto`) continues the run folder that holds the newest
*complete* checkpoint of the experiment, so metrics and tracker runs are not
split; checkpoint folders that are not complete (see
`nexrl.training.checkpoint.verify_checkpoint`) are skipped with a warning that
says why, and staging folders left by a save that was cut short are removed.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import gc
import json
import logging
import re
import shutil
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from nexrl.config.derived import train_backend

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
RUN_GC_THRESHOLD0 = 10_000
"""Allocations between two collections of the youngest generation while a run trains
(Python's default: 700); see `freeze_setup_heap`."""
WORKER_STATE_FILE = "nexrl_state.json"
"""Written by the TrainWorker into each checkpoint (step, data loader position)."""


def resolve_run_config(cfg: DictConfig) -> DictConfig:
    """Concrete paths; `resume.resumed` / `resume.resumed_from` say whether a run continues."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, True)
    resumed = _auto_resume_run(cfg) if cfg.run_dir is None else None
    if cfg.run_dir is None:
        parent = Path(cfg.output_dir) / cfg.experiment_name
        cfg.run_dir = str(resumed[0] if resumed else new_run_dir(parent))
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    if cfg.model_path is None:
        from nexrl.models.tiny import default_model_path

        cfg.model_path = str(default_model_path())
    else:  # one local HF directory for every module (a GGUF is converted once, here)
        from nexrl.models.sources import resolve_model

        cfg.model_path = str(resolve_model(cfg.model_path))
    from nexrl.algorithms.kl import reference_model_path

    cfg.train_worker.engine.ref_model_path = reference_model_path(cfg)  # KL: the initial policy
    cfg.logger.run_dir = str(run_dir)
    cfg.service.train_service.backend = train_backend(cfg)  # `auto` (a config not loaded)
    cfg.train_worker.checkpoint_path = cfg.train_worker.checkpoint_path or str(
        run_dir / "checkpoints"
    )
    cfg.train_worker.sync_weight_path = cfg.train_worker.sync_weight_path or str(
        run_dir / "sync_weights"
    )
    _resolve_data(cfg)
    OmegaConf.resolve(cfg)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    # not in the saved config.yaml: they describe this start, not the run
    with open_dict(cfg.resume):
        cfg.resume.resumed = resumed is not None
        cfg.resume.resumed_from = resumed[1] if resumed else None
    return cfg


def _auto_resume_run(cfg: DictConfig) -> tuple[Path, str] | None:
    """`resume.mode=auto` without a set checkpoint folder: the run folder to continue."""
    if cfg.resume.mode != "auto" or cfg.train_worker.checkpoint_path is not None:
        return None
    found = find_resume_run(Path(cfg.output_dir) / cfg.experiment_name)
    if found is not None:
        remove_staging_leftovers(found[0] / "checkpoints")
        logger.info("resuming run folder %s from %s", *found)
    return found


def new_run_dir(parent: Path) -> Path:
    """A fresh `<parent>/<timestamp>[-n]` folder: two runs in one second never share one."""
    parent.mkdir(parents=True, exist_ok=True)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    for n in range(1000):
        candidate = parent / (stamp if n == 0 else f"{stamp}-{n}")
        try:
            candidate.mkdir()
            return candidate
        except FileExistsError:
            continue
    raise RuntimeError(f"could not create a new run folder under {parent}")


def _resolve_data(cfg: DictConfig) -> None:
    from nexrl.data.tasks import write_task
    from nexrl.models.tiny import cache_dir

    for section in (cfg.data, cfg.validate.data):
        if section.path is None:
            train, val = write_task(section.task, cache_dir() / "data")
            if section.split not in ("train", "validation"):
                raise ValueError(
                    f"built-in task {section.task!r} has splits 'train' and 'validation', "
                    f"not {section.split!r}"
                )
            section.path = str(train if section.split == "train" else val)


def checkpoint_problem(path: str | Path) -> str | None:
    """None for a checkpoint resume can use, else why not."""
    from nexrl.training.checkpoint import COMPLETE_FILE, verify_checkpoint

    problem = verify_checkpoint(path)
    if problem:
        return problem
    listed = json.loads((Path(path) / COMPLETE_FILE).read_text())["files"]
    if WORKER_STATE_FILE in listed:
        return None
    # Written by the TrainWorker after the engine's save: check it on its own.
    try:
        state = json.loads((Path(path) / WORKER_STATE_FILE).read_text())
        int(state["step"])
    except FileNotFoundError:
        return f"no {WORKER_STATE_FILE}: the run died after the weights were saved"
    except (ValueError, KeyError, TypeError) as exc:
        return f"unreadable {WORKER_STATE_FILE} ({exc!r})"
    return None


def list_checkpoints(folder: str | Path) -> list[tuple[int, Path, str | None]]:
    """Every `global_step_N` under `folder` as (step, path, problem or None), newest first."""
    folder = Path(folder)
    if not folder.is_dir():
        return []
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return [(step, p, checkpoint_problem(p)) for step, p in sorted(steps, reverse=True)]


def find_latest_checkpoint(checkpoint_folder: str | Path) -> str | None:
    """Newest complete `global_step_N` folder under `checkpoint_folder`; logs what it skipped."""
    from nexrl.training.checkpoint import staging_leftovers

    for leftover in staging_leftovers(checkpoint_folder):
        logger.warning("skipping checkpoint %s: a staging folder of a save cut short", leftover)
    for _, path, problem in list_checkpoints(checkpoint_folder):
        if problem is None:
            return str(path)
        logger.warning("skipping checkpoint %s: %s", path, problem)
    return None


def find_resume_run(experiment_folder: str | Path) -> tuple[Path, str] | None:
    """(run folder, checkpoint): the run of this experiment with the newest complete checkpoint."""
    from nexrl.training.checkpoint import saved_at

    found = [
        (saved_at(c), run, c)
        for run in sorted(Path(experiment_folder).glob("*/"))
        if (c := find_latest_checkpoint(run / "checkpoints"))
    ]
    if not found:
        return None
    _, run, ckpt = max(found)
    return run.resolve(), ckpt


def find_resume_checkpoint(cfg: DictConfig, explicit_checkpoint_path: bool) -> str | None:
    """`resume.mode=auto`: the set checkpoint folder, else the newest run of this experiment."""
    if explicit_checkpoint_path:
        return find_latest_checkpoint(cfg.train_worker.checkpoint_path)
    chosen = OmegaConf.select(cfg, "resume.resumed_from")
    if chosen and checkpoint_problem(chosen) is None:  # what resolve_run_config picked
        return chosen
    found = find_resume_run(Path(cfg.output_dir) / cfg.experiment_name)
    return found[1] if found else None


def remove_staging_leftovers(checkpoint_folder: str | Path) -> None:
    """Delete the staging folders of saves cut short (their process is gone)."""
    from nexrl.training.checkpoint import staging_leftovers

    for leftover in staging_leftovers(checkpoint_folder):
        logger.warning("removing %s, left by a checkpoint save that was cut short", leftover)
        shutil.rmtree(leftover, ignore_errors=True)


def release_freed_memory() -> bool:
    """Hand back to the OS the memory that glibc's allocator keeps after it was freed.

    Tensors freed by an earlier run in the same process (a notebook, a sweep, a test
    session) stay in the allocator's arenas: after four SmolLM2 runs one after the other
    the process held 4.0-5.6 GiB with no model alive, 0.6 GiB after this. The controller
    calls it before it builds a run. True when memory was released; False where the C
    library is not glibc."""
    trim = _glibc("malloc_trim")
    return bool(trim(0)) if trim is not None else False


M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # mallopt parameters (malloc.h)
RUN_TRIM_THRESHOLD = 256 << 20
"""Free memory that glibc keeps at the top of a heap during a run before it trims."""
RUN_MMAP_THRESHOLD = 32 << 20
"""Allocations from this size up get their own mapping (glibc's largest setting)."""


def retain_freed_heap() -> bool:
    """Keep what a step frees in glibc's heaps for the next step (called by
    `freeze_setup_heap`, so every process of a run does it once set up).

    By default glibc hands a heap's free top back to the OS once it passes a threshold
    that adapts to the sizes freed, and each train step's tensors were then mapped and
    zeroed again: 670 minor page faults per update of the tiny model (Zen 4, sync run),
    under 1 with these settings. A process keeps at most `RUN_TRIM_THRESHOLD` free at a
    heap's top; `release_freed_memory` still trims it between runs. True where set
    (glibc)."""
    mallopt = _glibc("mallopt")
    if mallopt is None:
        return False
    mmap_set = mallopt(M_MMAP_THRESHOLD, RUN_MMAP_THRESHOLD)
    return bool(mmap_set and mallopt(M_TRIM_THRESHOLD, RUN_TRIM_THRESHOLD))


def _glibc(function: str):
    """A function of the C library, or None where it lacks it (not glibc)."""
    name = ctypes.util.find_library("c")
    try:
        return getattr(ctypes.CDLL(name), function) if name else None
    except (OSError, AttributeError):
        return None


@contextmanager
def collector_paused() -> Iterator[None]:
    """No cyclic garbage collection while a run is built. Nearly all that a build makes
    (modules, the model, datasets, tokenizers) lives as long as the run, so the full
    collections that its allocations set off walk a growing heap for nothing: 4 of them,
    0.6-0.7 s of the default run's 3.9-4.9 s build (Zen 4). `freeze_setup_heap`
    collects once at the start of the run."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def freeze_setup_heap() -> int:
    """Collect, then move every object alive now (imported modules, the model, datasets,
    tokenizers) out of the cyclic garbage collector's sight; returns how many moved.

    A full collection walks every tracked object. After the default task's setup that is
    ~430,000 objects, and each full collection of its run paused all threads for ~320 ms
    (Zen 4); with the setup frozen it walks only what the run made since: at most 13 ms.
    Frozen objects are still freed when their last reference goes; only cycles among
    them wait for `gc.unfreeze()`. Processes that serve until they exit (the engine and
    trainer children, the servers, Ray module actors) call it once set up.

    It also raises the youngest generation's threshold to `RUN_GC_THRESHOLD0`: a train
    step makes and drops a few thousand small containers (requests, samples, trajectory
    dicts), and at Python's default of 700 the collections of the two young generations
    that they set off took ~1.4 ms of each 30-40 ms step of the micro model (Zen 4).
    And it keeps freed memory in the allocator for the next step (`retain_freed_heap`)."""
    gc.collect()
    gc.freeze()
    retain_freed_heap()
    young, *older = gc.get_threshold()
    if young:  # 0: collection by threshold is off, and stays so
        gc.set_threshold(max(young, RUN_GC_THRESHOLD0), *older)
    return gc.get_freeze_count()


@contextmanager
def frozen_setup_heap() -> Iterator[int]:
    """`freeze_setup_heap()` for the span of a run, then hand the objects back to the
    collector, so that a process that runs again (a notebook, a sweep, a test session)
    can reclaim the cycles of the runs it finished."""
    thresholds = gc.get_threshold()
    try:
        yield freeze_setup_heap()
    finally:
        gc.unfreeze()
        gc.set_threshold(*thresholds)
