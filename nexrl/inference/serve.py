"""`nexrl serve`: run the built-in engine behind the OpenAI-compatible server.

Binds 127.0.0.1 unless `--host` says otherwise; with `--api-key` (or
`NEXRL_API_KEY`) every endpoint requires `Authorization: Bearer KEY`.
"""

from __future__ import annotations

import argparse
import os
import sys

SWITCH_INTERVAL_S = 2e-4


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="nexrl serve", description=__doc__)
    p.add_argument("--model", default=None, help="HF model dir (default: embedded tiny model)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=os.environ.get("NEXRL_API_KEY"))
    p.add_argument("--served-model-name", default="default")
    p.add_argument("--backend", choices=("builtin", "hf"), default="builtin")
    p.add_argument("--max-batch", type=int, default=128, help="max running sequences")
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    p.add_argument("--device", default="cpu")
    p.add_argument("--threads", type=int, default=None, help="torch intra-op threads")
    p.add_argument(
        "--emulated-step-latency",
        type=float,
        default=0.0,
        help="seconds of sleep per engine step, to behave like an accelerator (docs/async.md)",
    )
    p.add_argument(
        "--in-process",
        action="store_true",
        help="run the builtin engine in the HTTP process (default: its own process)",
    )
    p.add_argument("--log-level", default="warning")
    return p


def main(argv: list[str] | None = None) -> int:
    """Parse `argv`, build the engine and serve until interrupted. Returns the exit code."""
    args = build_parser().parse_args(argv)
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
    if args.backend == "builtin" and not args.in_process:
        from nexrl.inference.process_engine import ProcessEngine

        engine = ProcessEngine(args.model, threads=args.threads, **options)
    else:
        engine = create_engine({"backend": args.backend, "model": args.model, **options})
    app = create_app(engine, model_name=args.served_model_name, api_key=args.api_key)
    try:
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
    finally:
        engine.shutdown()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
