"""Logging set-up shared by the CLI and user scripts."""

from __future__ import annotations

import logging


def set_logging_basic_config(level: int = logging.INFO) -> None:
    """One format for every nexrl process: time, level, logger, message."""
    logging.basicConfig(
        level=level,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for noisy in ("httpx", "urllib3", "filelock", "datasets", "uvicorn.access"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
