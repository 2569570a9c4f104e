"""`nexrl` command line: train, serve, train-service, sft.

    nexrl train [--config-dir DIR] [--config-name NAME] [key=value ...]
    nexrl serve [--model PATH] [--host H] [--port P] [--api-key K]
    nexrl train-service [...]
    nexrl sft [...]

`train` takes Hydra overrides, e.g. `nexrl train train_worker.total_train_steps=20`.
"""

from __future__ import annotations

import argparse
import logging
import sys

from nexrl.log import set_logging_basic_config


def _train(argv: list[str]) -> int:
    from nexrl.config import ConfigError, load_config
    from nexrl.controller import NexRLController, TrainingAborted

    parser = argparse.ArgumentParser(prog="nexrl train", description="Run RL training.")
    parser.add_argument("--config-dir", default=None, help="folder of your config yaml")
    parser.add_argument("--config-name", default="rl_train", help="config file name (no .yaml)")
    parser.add_argument("--log-level", default="INFO")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides key=value")
    args = parser.parse_args(argv)
    set_logging_basic_config(getattr(logging, args.log_level.upper()))
    try:
        cfg = load_config(args.overrides, args.config_name, args.config_dir)
    except ConfigError as exc:
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 2
    try:
        controller = NexRLController(cfg)
    except (ValueError, KeyError, FileNotFoundError) as exc:  # bad data / paths / names
        logging.getLogger("nexrl").debug("set-up failed", exc_info=True)
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 2
    print(f"nexrl: run dir {controller.run_dir}", flush=True)
    try:
        metrics = controller.run()
    except TrainingAborted as exc:
        print(f"nexrl train: {exc}", file=sys.stderr)
        return 1
    finally:
        controller.shutdown()
    print(f"nexrl: done; final {metrics}", flush=True)
    return 0


def _delegate(module: str) -> int:
    import importlib

    def run(argv: list[str]) -> int:
        set_logging_basic_config()
        return int(importlib.import_module(module).main(argv) or 0)

    return run  # type: ignore[return-value]


COMMANDS = {
    "train": _train,
    "serve": _delegate("nexrl.inference.serve"),
    "train-service": _delegate("nexrl.training.service"),
    "sft": _delegate("nexrl.training.sft"),
}


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in COMMANDS:
        names = ", ".join(COMMANDS)
        print(f"usage: nexrl {{{names}}} [args]\n\n{__doc__}", file=sys.stderr)
        return 0 if argv and argv[0] in ("-h", "--help") else 2
    return COMMANDS[argv[0]](argv[1:])


if __name__ == "__main__":
    sys.exit(main())
