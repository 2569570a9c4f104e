"""Turn a validated config into a resolved run: paths, model, data on disk.

After `resolve_run_config` every path in the config is concrete, so any
builder (here or in a Ray actor) can construct its module from the config
alone. The resolved config is saved in the run directory.
"""

from __future__ import annotations

import re
import time
from pathlib import Path

from omegaconf import DictConfig, OmegaConf

STEP_DIR = re.compile(r"^global_step_(\d+)$")


def resolve_run_config(cfg: DictConfig) -> DictConfig:
    cfg = cfg.copy()
    OmegaConf.set_struct(cfg, True)
    if cfg.run_dir is None:
        cfg.run_dir = str(new_run_dir(Path(cfg.output_dir) / cfg.experiment_name))
    run_dir = Path(cfg.run_dir).resolve()
    run_dir.mkdir(parents=True, exist_ok=True)
    cfg.run_dir = str(run_dir)
    if cfg.model_path is None:
        from nexrl.models.tiny import default_model_path

        cfg.model_path = str(default_model_path())
    cfg.logger.run_dir = str(run_dir)
    cfg.train_worker.checkpoint_path = cfg.train_worker.checkpoint_path or str(
        run_dir / "checkpoints"
    )
    cfg.train_worker.sync_weight_path = cfg.train_worker.sync_weight_path or str(
        run_dir / "sync_weights"
    )
    _resolve_data(cfg)
    OmegaConf.resolve(cfg)
    OmegaConf.save(cfg, run_dir / "config.yaml")
    return cfg


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


def find_latest_checkpoint(checkpoint_folder: str | Path) -> str | None:
    """Newest `global_step_N` folder directly under `checkpoint_folder`."""
    folder = Path(checkpoint_folder)
    if not folder.is_dir():
        return None
    steps = [(int(m.group(1)), p) for p in folder.iterdir() if (m := STEP_DIR.match(p.name))]
    return str(max(steps)[1]) if steps else None


def find_resume_checkpoint(cfg: DictConfig, explicit_checkpoint_path: bool) -> str | None:
    """`resume.mode=auto`: the set checkpoint folder, else the newest run of this experiment."""
    if explicit_checkpoint_path:
        return find_latest_checkpoint(cfg.train_worker.checkpoint_path)
    runs = Path(cfg.output_dir) / cfg.experiment_name
    found = [c for r in runs.glob("*/checkpoints") if (c := find_latest_checkpoint(r))]
    return max(found, key=lambda p: Path(p).stat().st_mtime) if found else None  # newest
