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

import json
import logging
import re
import shutil
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf, open_dict

from nexrl.config.derived import train_backend

logger = logging.getLogger(__name__)

STEP_DIR = re.compile(r"^global_step_(\d+)$")
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
        return str(chosen)
    found = find_resume_run(Path(cfg.output_dir) / cfg.experiment_name)
    return found[1] if found else None


def remove_staging_leftovers(checkpoint_folder: str | Path) -> None:
    """Delete the staging folders of saves cut short (their process is gone)."""
    from nexrl.training.checkpoint import staging_leftovers

    for leftover in staging_leftovers(checkpoint_folder):
        logger.warning("removing %s, left by a checkpoint save that was cut short", leftover)
        shutil.rmtree(leftover, ignore_errors=True)
