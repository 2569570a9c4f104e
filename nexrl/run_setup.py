"""Turn a validated config into a resolved run: paths, model, data on disk.

After `resolve_run_config` every path in the config is concrete, so any
builder (here or in a Ray actor) can construct its module from the config
alone. The resolved config is saved in the run directory.

Resume (`resume.mode=auto`) continues the run folder that holds the newest
*complete* checkpoint of the experiment, so metrics and tracker runs are not
split; checkpoint folders that are not complete (see
`nexrl.training.checkpoint.verify_checkpoint`) are skipped with a warning that
says why, and staging folders left by a save that was cut short are removed.
When checkpoints exist but none is usable, resume fails with one line instead of
starting over at step 0 (`resume.mode=disable` starts a fresh run folder).

A resumed run keeps the config it was started with (its `config.yaml`), unless
`resume.use_saved_config=false`; the keys where this command's config differs are
listed in one warning. `config.yaml` is written only by the run that created the
folder; a resume with another config writes `config.resumed-<time>.yaml` beside it.
"""

from __future__ import annotations

import json
import logging
import re
import shutil
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import TypeVar

from omegaconf import DictConfig, OmegaConf, open_dict

from nexrl.config.derived import train_backend

logger = logging.getLogger(__name__)
T = TypeVar("T")

STEP_DIR = re.compile(r"^global_step_(\d+)$")
WORKER_STATE_FILE = "nexrl_state.json"
"""Written by the TrainWorker into each checkpoint (step, data loader position)."""


def resolve_run_config(cfg: DictConfig) -> DictConfig:
    """Concrete paths; `resume.resumed` / `resume.resumed_from` say whether a run continues."""
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, True)
    resumed = _auto_resume_run(cfg) if cfg.run_dir is None else None
    if resumed:
        cfg = config_for_resume(cfg, resumed[0])
        cfg.run_dir = str(resumed[0])
    if cfg.run_dir is None:
        parent = Path(cfg.output_dir) / cfg.experiment_name
        cfg.run_dir = str(_writable(parent, lambda: new_run_dir(parent)))
    run_dir = Path(cfg.run_dir).resolve()
    _writable(run_dir, lambda: run_dir.mkdir(parents=True, exist_ok=True))
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
    saved: Path | None = run_dir / "config.yaml"
    # the run that created the folder owns config.yaml
    if resumed and (run_dir / "config.yaml").exists():
        if cfg.resume.use_saved_config:
            saved = None
        else:
            saved = run_dir / f"config.resumed-{time.strftime('%Y%m%d-%H%M%S')}.yaml"
    if saved is not None:
        _writable(saved, partial(OmegaConf.save, cfg, saved))
    # not in the saved config.yaml: they describe this start, not the run
    with open_dict(cfg.resume):
        cfg.resume.resumed = resumed is not None
        cfg.resume.resumed_from = resumed[1] if resumed else None
    return cfg


def _auto_resume_run(cfg: DictConfig) -> tuple[Path, str] | None:
    """`resume.mode=auto` without a set checkpoint folder: the run folder to continue."""
    if cfg.resume.mode != "auto" or cfg.train_worker.checkpoint_path is not None:
        return None
    experiment = Path(cfg.output_dir) / cfg.experiment_name
    found = find_resume_run(experiment)
    if found is not None:
        remove_staging_leftovers(found[0] / "checkpoints")
        logger.info("resuming run folder %s from %s", *found)
    else:
        runs = sorted(experiment.glob("*/"))
        check_some_usable([c for run in runs for c in _step_folders(run / "checkpoints")])
    return found


def _step_folders(folder: Path) -> list[Path]:
    return [p for p in folder.iterdir() if STEP_DIR.match(p.name)] if folder.is_dir() else []


def check_some_usable(checkpoints: list[Path]) -> None:
    """`resume.mode=auto` found no usable checkpoint: fine when there is none at all (a
    first run), else one line saying why the newest is unusable (no silent step 0)."""
    if not checkpoints:
        return
    newest = max(checkpoints, key=lambda p: int(p.name.rsplit("_", 1)[1]))
    raise ValueError(
        f"resume.mode=auto: none of the {len(checkpoints)} checkpoints found is usable "
        f"(newest {newest}: {checkpoint_problem(newest)}); set resume.mode=disable to start "
        "a fresh run, or resume.mode=from_path resume.resume_path=DIR"
    )


def config_for_resume(cfg: DictConfig, run_dir: Path) -> DictConfig:
    """The config a resumed run continues with: the one it was started with (its
    config.yaml) unless `resume.use_saved_config=false`; differences in one warning."""
    path = run_dir / "config.yaml"
    if not path.exists():
        return cfg
    saved = OmegaConf.load(path)
    assert isinstance(saved, DictConfig), f"{path} holds a list, not a config"
    differ = config_differences(cfg, saved)
    if not cfg.resume.use_saved_config:
        if differ:
            logger.warning(
                "resuming %s with this command's config (resume.use_saved_config=false); it "
                "differs from the run's config.yaml at %s",
                run_dir,
                _listed(differ),
            )
        return cfg
    # a key this command sets away from the packaged default was asked for (a longer
    # run: train_worker.total_train_steps=200); one left at the default was not
    told = set(config_differences(cfg, _packaged_defaults())) & set(differ)
    if differ:
        logger.warning(
            "resuming %s with the config it was started with (its config.yaml)%s%s "
            "(resume.use_saved_config=false: this command's config only)",
            run_dir,
            f"; this command's value kept for {_listed(sorted(told))}" if told else "",
            f"; the run's value kept for {_listed([k for k in differ if k not in told])}"
            if set(differ) - told
            else "",
        )
    mine = _flat(OmegaConf.to_container(cfg, resolve=False))
    resume = OmegaConf.to_container(cfg.resume)
    assert isinstance(resume, dict)
    try:
        merged = OmegaConf.merge(cfg, saved)
    except Exception as exc:  # omegaconf raises several types for one cause
        raise ValueError(
            f"{path} does not load with this nexrl ({type(exc).__name__}: "
            f"{str(exc).splitlines()[0]}); set resume.use_saved_config=false"
        ) from None
    for key in told:
        OmegaConf.update(merged, key, mine[key], merge=False)
    for name, value in resume.items():  # how to resume is this command's choice
        merged.resume[str(name)] = value
    assert isinstance(merged, DictConfig)
    return merged


def _packaged_defaults() -> DictConfig:
    from nexrl.config import load_config

    return load_config([])


SET_AT_START = ("resume.", "run_dir", "logger.run_dir")
"""Keys that describe a start, not a run: never a difference."""
FILLED_AT_START = frozenset(
    {
        "model_path",
        "train_worker.checkpoint_path",
        "train_worker.sync_weight_path",
        "data.path",
        "validate.data.path",
        "service.train_service.backend",
    }
)
"""Keys `resolve_run_config` fills when left unset (null, or `auto`)."""


def config_differences(cfg: DictConfig, saved: DictConfig) -> list[str]:
    """Dotted keys whose value in `cfg` (the command's) differs from `saved`'s; keys left
    for the start to fill (`FILLED_AT_START`) are not differences."""
    try:
        mine = _flat(OmegaConf.to_container(cfg, resolve=True))
    except Exception:  # an interpolation that needs the resolved paths
        mine = _flat(OmegaConf.to_container(cfg, resolve=False))
    theirs = _flat(OmegaConf.to_container(saved, resolve=False))
    return [
        key
        for key, value in mine.items()
        if not (key in FILLED_AT_START and value in (None, "auto"))
        and not key.startswith(SET_AT_START)
        and theirs.get(key, value) != value
    ]


def _flat(tree: object, prefix: str = "") -> dict[str, object]:
    if not isinstance(tree, dict):
        return {prefix[:-1]: tree}
    out: dict[str, object] = {}
    for key, value in tree.items():
        out.update(_flat(value, f"{prefix}{key}."))
    return out


def _listed(keys: list[str], most: int = 8) -> str:
    more = f" and {len(keys) - most} more" if len(keys) > most else ""
    return ", ".join(keys[:most]) + more


def _writable(path: Path, write: Callable[[], T]) -> T:
    """`write()`; a folder that cannot be written is one line naming it (OSError)."""
    from nexrl.training.checkpoint import write_error

    try:
        return write()
    except OSError as exc:
        raise (write_error(path, exc) or exc) from None


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
    from nexrl.training.checkpoint import COMPLETE_FILE, manifest_files, verify_checkpoint

    problem = verify_checkpoint(path)
    if problem:
        return problem
    listed = manifest_files(Path(path) / COMPLETE_FILE)
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
        found = find_latest_checkpoint(cfg.train_worker.checkpoint_path)
        if found is None:
            check_some_usable(_step_folders(Path(cfg.train_worker.checkpoint_path)))
        return found
    chosen = OmegaConf.select(cfg, "resume.resumed_from")
    if chosen and checkpoint_problem(chosen) is None:  # what resolve_run_config picked
        return str(chosen)
    run = find_resume_run(Path(cfg.output_dir) / cfg.experiment_name)
    return run[1] if run else None


def older_checkpoint(path: str | Path, failed: set[str]) -> str | None:
    """The newest complete checkpoint beside `path`, older than it and not in `failed`:
    where resume falls back to when `path` does not load."""
    match = STEP_DIR.match(Path(path).name)
    if match is None:
        return None
    step = int(match.group(1))
    for other_step, other, problem in list_checkpoints(Path(path).parent):
        if other_step < step and problem is None and str(other) not in failed:
            return str(other)
    return None


def remove_staging_leftovers(checkpoint_folder: str | Path) -> None:
    """Delete the staging folders of saves cut short (their process is gone)."""
    from nexrl.training.checkpoint import staging_leftovers

    for leftover in staging_leftovers(checkpoint_folder):
        logger.warning("removing %s, left by a checkpoint save that was cut short", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
