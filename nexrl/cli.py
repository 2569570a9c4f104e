"""`nexrl` command line: train, serve, train-service, sft, plot.

    nexrl train [--config-dir DIR] [--config-name NAME] [--cfg] [--log-level L] [key=value ...]
    nexrl serve [--model-path PATH] [--host H] [--port P] [--api-key K] [--log-level L]
    nexrl train-service [--model-path PATH] [--port P] [--log-level L] [key=value ...]
    nexrl sft [--model-path PATH] [--steps N] [--log-level L] [key=value ...]
    nexrl plot RUN_DIR [--out DIR]

Every command takes `--help`, `--log-level` and `--model-path` the same way, and
`key=value` overrides where it has a config (`train`: the run config, with Hydra
syntax; `train-service` and `sft`: the train-engine config). An unknown key fails
with the closest known keys ("did you mean"). `nexrl train --cfg` prints the
composed config and exits. The current folder is put on the import path first,
so `rollout_worker.reward_fn=my_rewards:score` finds `./my_rewards.py` in every
launch mode (local threads, subprocesses and a local Ray cluster via PYTHONPATH).
"""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from omegaconf import DictConfig

    from nexrl.controller import NexRLController

COMMANDS_HELP = {
    "train": "RL training (docs/quickstart.md, docs/configuration.md)",
    "serve": "OpenAI-compatible server on the built-in engine (docs/inference.md)",
    "train-service": "the train engine behind HTTP (docs/training.md)",
    "sft": "supervised fine-tuning on the same engine (docs/training.md)",
    "plot": "PNG plots of a run's metrics.jsonl (docs/monitoring.md)",
}


COMMON_OPTIONS_HELP = """
options every nexrl command takes:
  --log-level LEVEL  DEBUG, INFO, WARNING or ERROR
  --model-path PATH  a Hugging Face model folder (serve: the same as --model)
  key=value          config overrides (train: run config; train-service, sft: engine config)"""


def put_cwd_on_path() -> None:
    """Make modules in the current folder importable here and in child processes.

    A console script's `sys.path[0]` is the script's folder, not the current one,
    so `my_rewards:score` would not import. Child processes (and the workers of a
    Ray cluster that `ray.init` starts locally) inherit PYTHONPATH.
    """
    cwd = os.getcwd()
    if cwd not in sys.path:
        sys.path.insert(0, cwd)
    paths = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if cwd not in paths:
        os.environ["PYTHONPATH"] = os.pathsep.join([cwd, *paths])


def setup_logging(level: str) -> None:
    """The shared format; on a terminal, records print above the progress bar."""
    from nexrl.log import set_logging_basic_config
    from nexrl.monitoring.progress import CONSOLE, rich_log_handler

    value = logging.getLevelName(level.upper())
    if not isinstance(value, int):
        raise SystemExit(f"--log-level: unknown level {level!r} (DEBUG, INFO, WARNING, ERROR)")
    set_logging_basic_config(value)
    if CONSOLE.is_terminal:
        logging.getLogger().handlers = [rich_log_handler(value)]


EXTRAS = {
    "ray": "ray",
    "fastapi": "serve",
    "uvicorn": "serve",
    "prometheus_client": "serve",
    "wandb": "wandb",
    "mlflow": "mlflow",
    "tensorboard": "tensorboard",
    "matplotlib": "plot",
}
"""Top-level package -> the nexrl extra that installs it."""


def import_hint(exc: ImportError) -> str:
    """The message of a failed import with what to do: the extra to install for an
    optional package, else where user modules are looked up."""
    package = (exc.name or "").split(".")[0]
    if package in EXTRAS:
        return f"{exc}: pip install 'nexrl[{EXTRAS[package]}]'"
    return (
        f"{exc} (user modules are looked up from the current folder {os.getcwd()} and PYTHONPATH)"
    )


def common_parser(prog: str, description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog=prog, description=description)
    parser.add_argument("--log-level", default="INFO", help="DEBUG, INFO, WARNING or ERROR")
    return parser


# -- train ------------------------------------------------------------------------------
def train_parser() -> argparse.ArgumentParser:
    parser = common_parser("nexrl train", "Run RL training; key=value overrides any config key.")
    parser.add_argument(
        "--config-dir", default=None, help="folder of your recipe yaml (default: packaged)"
    )
    parser.add_argument(
        "--config-name",
        default="rl_train",
        help="recipe name in --config-dir (no .yaml), or a path to a .yaml file",
    )
    parser.add_argument(
        "--model-path", default=None, help="a Hugging Face model folder (= model_path=PATH)"
    )
    parser.add_argument(
        "--cfg",
        "--print-config",
        dest="print_config",
        action="store_true",
        help="print the composed config and exit without training",
    )
    parser.add_argument("overrides", nargs="*", help="key=value (Hydra override syntax)")
    return parser


def compose(overrides: list[str], config_name: str, config_dir: str | None):  # -> DictConfig
    """`load_config` plus the checks the CLI guarantees: no unknown key passes, and an
    unknown key's message names the closest known ones."""
    from nexrl.config import ConfigError, load_config
    from nexrl.config.suggest import check_known_keys, explain_unknown_key

    if config_dir is None and config_name.endswith((".yaml", ".yml")):
        path = Path(config_name)
        config_dir, config_name = str(path.parent.resolve()), path.stem
    try:
        cfg = load_config(overrides, config_name, config_dir)
    except ConfigError as exc:
        better = explain_unknown_key(str(exc))
        raise ConfigError(better or str(exc)) from exc
    check_known_keys(cfg)
    return cfg


def _train(argv: list[str]) -> int:
    from nexrl.config import ConfigError

    args = train_parser().parse_args(argv)
    setup_logging(args.log_level)
    overrides = list(args.overrides)
    if args.print_config and overrides[:1] in (["job"], ["all"]):
        overrides = overrides[1:]  # Hydra's `--cfg job` spelling
    if args.model_path:
        overrides.append(f"model_path={args.model_path}")
    try:
        cfg = compose(overrides, args.config_name, args.config_dir)
    except ConfigError as exc:
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 2
    if args.print_config:
        from omegaconf import OmegaConf

        print(OmegaConf.to_yaml(cfg), end="")
        return 0
    return run_training(cfg)


def run_training(cfg) -> int:  # cfg: DictConfig
    if problem := missing_gpu(cfg):  # before anything loads
        print(f"nexrl train: {problem}", file=sys.stderr)
        return 2

    try:
        from nexrl.controller import NexRLController, TrainingAborted

        controller = NexRLController(cfg)
    except ImportError as exc:  # an optional package, or a user module given by import path
        print(f"nexrl train: {import_hint(exc)}", file=sys.stderr)
        return 2
    except (ValueError, KeyError, OSError) as exc:  # bad data / paths / names, unwritable
        logging.getLogger("nexrl").debug("set-up failed", exc_info=True)
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 2
    print(f"nexrl: run dir {controller.run_dir}", flush=True)
    try:
        metrics = controller.run()
    except TrainingAborted as exc:
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print(
            f"\nnexrl train: interrupted (Ctrl-C); run dir {controller.run_dir} "
            "(continue it with resume.mode=auto)",
            file=sys.stderr,
        )
        return 130
    finally:
        _print_task_summary(controller)
        controller.shutdown()
    print(f"nexrl: done; final {metrics}", flush=True)
    return 0


def _print_task_summary(controller: NexRLController) -> None:
    """Where every training task went (trained, failed, dropped, re-queued)."""
    from nexrl.execute import execute
    from nexrl.monitoring.progress import task_summary

    try:
        counters = execute(controller.activity_tracker.get_counters)
    except Exception:  # the tracker went down with the run: nothing to summarise
        return
    print(f"nexrl: {task_summary(counters)}", flush=True)


# -- the other commands: their own parsers, the shared options handled here -------------
def _pop_option(argv: list[str], name: str) -> tuple[list[str], str | None]:
    """Remove `--name VALUE` / `--name=VALUE` from argv; return (rest, value)."""
    rest, value, i = [], None, 0
    while i < len(argv):
        arg = argv[i]
        if arg == name and i + 1 < len(argv):
            value, i = argv[i + 1], i + 2
            continue
        if arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
        else:
            rest.append(arg)
        i += 1
    return rest, value


def check_engine_overrides(prog: str, argv: list[str]) -> str | None:
    """An error for the first unknown train-engine key among `key=value` args, or None."""
    import dataclasses

    from nexrl.config.suggest import suggest
    from nexrl.training.config import EngineConfig

    names = tuple(f.name for f in dataclasses.fields(EngineConfig))
    for arg in argv:
        if arg.startswith("-") or "=" not in arg:
            continue
        key = arg.split("=", 1)[0].lstrip("+")
        if key not in names:
            hint = suggest(key, names)
            close = " or ".join(f"'{h}'" for h in hint) if hint else ", ".join(names)
            return f"{prog}: unknown engine config key '{key}'; did you mean {close}?"
    return None


def _delegate(
    module: str, prog: str, engine_overrides: bool, model_flag: str = "--model-path"
) -> Callable[[list[str]], int]:
    def run(argv: list[str]) -> int:
        import importlib

        rest, level = _pop_option(argv, "--log-level")
        setup_logging(level or "INFO")
        if module == "nexrl.inference.serve" and level:
            rest += ["--log-level", level]  # serve passes it on to uvicorn
        if model_flag != "--model-path":
            rest, model = _pop_option(rest, "--model-path")
            rest += [model_flag, model] if model else []
        if engine_overrides and (error := check_engine_overrides(prog, rest)):
            print(error, file=sys.stderr)
            return 2
        try:
            return int(importlib.import_module(module).main(rest) or 0)
        except ImportError as exc:
            if (exc.name or "").split(".")[0] not in EXTRAS:
                raise
            print(f"{prog}: {import_hint(exc)}", file=sys.stderr)
            return 2
        except SystemExit as exc:
            if {"-h", "--help"} & set(rest):  # their help, then the options shared here
                print(COMMON_OPTIONS_HELP)
            raise SystemExit(exc.code) from None

    return run


def _plot(argv: list[str]) -> int:
    from nexrl.plot import main as plot_main

    rest, level = _pop_option(argv, "--log-level")
    setup_logging(level or "WARNING")
    return plot_main(rest)


COMMANDS: dict[str, Callable[[list[str]], int]] = {
    "train": _train,
    "serve": _delegate("nexrl.inference.serve", "nexrl serve", False, model_flag="--model"),
    "train-service": _delegate("nexrl.training.service", "nexrl train-service", True),
    "sft": _delegate("nexrl.training.sft", "nexrl sft", True),
    "plot": _plot,
}


def usage() -> str:
    rows = "\n".join(f"  {name:<14} {text}" for name, text in COMMANDS_HELP.items())
    return (
        f"usage: nexrl {{{','.join(COMMANDS)}}} [--help] [--log-level L] [args ...]\n"
        "       (options come after the command: nexrl train --log-level DEBUG)\n\n"
        f"commands:\n{rows}\n\n{__doc__}"
    )


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    put_cwd_on_path()
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        if argv and argv[0] not in ("-h", "--help"):
            print(f"nexrl: unknown command {argv[0]!r}", file=sys.stderr)
        print(usage(), file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    try:
        return COMMANDS[argv[0]](argv[1:])
    except KeyboardInterrupt:  # Ctrl-C: a user's decision, not a bug: one line
        print(f"\nnexrl {argv[0]}: interrupted (Ctrl-C)", file=sys.stderr)
        return 130


def missing_gpu(cfg: DictConfig) -> str | None:
    """The first config key that asks for a CUDA device on a machine without one."""
    from omegaconf import OmegaConf

    def walk(node: object, prefix: str) -> str | None:
        if isinstance(node, dict):
            for key, value in node.items():
                found = walk(value, f"{prefix}{key}.")
                if found:
                    return found
        elif isinstance(node, str) and node.startswith("cuda") and prefix.endswith("device."):
            return f"{prefix[:-1]}={node}"
        return None

    found = walk(OmegaConf.to_container(cfg, resolve=False), "")
    if found is None:
        return None
    import torch

    if torch.cuda.is_available():
        return None
    return (
        f"{found} but this machine has no CUDA GPU (torch.cuda.is_available() is False); "
        "set it to cpu or run on a GPU machine"
    )


if __name__ == "__main__":
    sys.exit(main())
