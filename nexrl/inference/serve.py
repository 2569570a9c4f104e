"""`nexrl serve`: run the built-in engine behind the OpenAI-compatible server.

Binds 127.0.0.1 unless `--host` says otherwise; with `--api-key` (or
`NEXRL_API_KEY`) every endpoint requires `Authorization: Bearer KEY`, and with
`--admin-key` (or `NEXRL_ADMIN_KEY`) the control endpoints (weight update,
pause, abort) require that key instead. A server bound to a non-loopback
address refuses to start without an API key (`--allow-insecure` overrides),
and there loads weights only from `--weights-dir` directories.
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import signal
import sys
from typing import TYPE_CHECKING

from nexrl.config.options import ENGINE_DEFAULTS as _D

if TYPE_CHECKING:
    from nexrl.inference.protocol import InferenceEngine

SWITCH_INTERVAL_S = 2e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexrl serve", description=__doc__)
    p.add_argument(
        "--model",
        default=None,
        help="as model_path: an HF dir, a .gguf file, a Hub id or `smollm2` "
        "(default: the embedded tiny model)",
    )
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NEXRL_API_KEY"))
    p.add_argument(
        "--admin-key",
        default=os.environ.get("NEXRL_ADMIN_KEY"),
        help="key for the control endpoints (weight update, pause, abort); default: --api-key",
    )
    p.add_argument(
        "--allow-insecure",
        action="store_true",
        help="serve on a non-loopback address without an API key",
    )
    p.add_argument(
        "--weights-dir",
        action="append",
        default=None,
        help="directory /update_weights_from_disk may read (repeatable); default: any path on "
        "a loopback address, none on any other",
    )
    p.add_argument(
        "--tool-call-parser",
        default=None,
        help="parse tool calls in chat replies: hermes, qwen, llama3_json, mistral",
    )
    p.add_argument("--max-logprobs", type=int, default=20, help="cap on logprobs/top_logprobs")
    p.add_argument("--served-model-name", default="default")
    p.add_argument("--backend", choices=("builtin", "hf"), default="builtin")
    p.add_argument("--max-batch", type=int, default=_D.max_batch_size, help="max running sequences")
    p.add_argument("--max-model-len", type=int, default=_D.max_model_len)
    p.add_argument("--dtype", default=_D.dtype, choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default=_D.device)
    p.add_argument("--threads", type=int, default=_D.threads, help="torch intra-op threads")
    p.add_argument(
        "--prefix-cache-gib",
        type=float,
        default=_D.prefix_cache_gib,
        help="memory for cached prompt KV reused across requests (builtin backend; 0: off)",
    )
    p.add_argument(
        "--emulated-step-latency",
        type=float,
        default=_D.emulated_step_latency_s,
        help="seconds of sleep per engine step, to behave like an accelerator (docs/async.md)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the builtin engine in the HTTP process (default: its own process)",
    )
    p.add_argument("--log-level", default="warning")
    return p


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:  # a host name: only "localhost" is known to be local
        return False


def check_args(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Refuse unsafe or unknown settings before the model loads (argparse errors, exit 2)."""
    from nexrl.inference.tool_parsers import PARSERS
    from nexrl.registry import RegistryError

    if not is_loopback(args.host) and not args.api_key and not args.allow_insecure:
        parser.error(
            f"--host {args.host} is not a loopback address: give --api-key (or NEXRL_API_KEY), "
            "or --allow-insecure to serve without one"
        )
    if args.tool_call_parser is not None:
        try:
            PARSERS.get(args.tool_call_parser)  # a registered name or "pkg.module:Class"
        except RegistryError as exc:
            parser.error(f"--tool-call-parser: {str(exc).removeprefix(f'{PARSERS.config_key}: ')}")
    for d in args.weights_dir or []:
        if not os.path.isdir(d):
            parser.error(f"--weights-dir: {d!r} is not a directory")
    if args.weights_dir is None and not is_loopback(args.host):
        args.weights_dir = []  # a network-facing server loads weights from nowhere by default
    if args.model is not None:
        args.model = model_dir(parser, args.model)
    if args.device.startswith("cuda"):
        import torch

        if not torch.cuda.is_available():
            parser.error(
                f"--device {args.device}: this machine has no CUDA GPU "
                "(torch.cuda.is_available() is False); use --device cpu"
            )


def model_dir(parser: argparse.ArgumentParser, model: str) -> str:
    """`--model` resolved exactly as `model_path` is (nexrl.models.sources.resolve_model:
    an HF dir as it is, a GGUF converted once, `smollm2` from its PyPI package, a Hub id
    from the cache); a bad one is a one-line usage error."""
    from nexrl.models.sources import resolve_model

    try:
        return str(resolve_model(model))
    except (ValueError, FileNotFoundError, ImportError, OSError) as exc:
        parser.error(f"--model: {exc}")
        raise  # parser.error exits


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, build the engine and serve until interrupted. Returns the exit code."""
    parser = build_parser()
    args = parser.parse_args(argv)
    check_args(parser, args)
    import torch
    import uvicorn

    from nexrl.inference.client import create_engine
    from nexrl.inference.server import create_app

    if args.threads:
        torch.set_num_threads(args.threads)
    # The engine thread drops the GIL inside every torch op; a short switch interval gives it
    # back quickly when the HTTP loop is busy (the default 5 ms stalls decode steps).
    sys.setswitchinterval(SWITCH_INTERVAL_S)
    options = {
        "max_batch_size": args.max_batch,
        "max_model_len": args.max_model_len,
        "dtype": args.dtype,
        "device": args.device,
    }
    if args.emulated_step_latency:
        options["emulated_step_latency_s"] = args.emulated_step_latency
    if args.backend == "builtin":
        options["prefix_cache_gib"] = args.prefix_cache_gib
    engine: InferenceEngine
    if args.backend == "builtin" and not args.in_process:
        from nexrl.inference.process_engine import ProcessEngine

        engine = ProcessEngine(args.model, threads=args.threads, **options)
    else:
        engine = create_engine({"backend": args.backend, "model": args.model, **options})
    app = create_app(
        engine,
        model_name=args.served_model_name,
        api_key=args.api_key,
        admin_key=args.admin_key,
        tool_parser=args.tool_call_parser,
        weights_dirs=args.weights_dir,
        max_logprobs=args.max_logprobs,
    )
    # uvicorn shuts down on SIGTERM, then raises the signal again: with the default action
    # the process would die there, before the engine's shutdown removes its temp folders
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    except SystemExit as exc:
        return int(exc.code or 0)
    finally:
        engine.shutdown()
    return 0


def _exit_on_sigterm(signum: int, frame: object) -> None:
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    raise SystemExit(main())
