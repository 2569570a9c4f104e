"""Generation throughput: nexrl's engine vs `transformers` `model.generate`, and HTTP overhead.

For each model and concurrency c, both sides generate up to `max_tokens` tokens for the
same c prompts, `waves` times (the engine ignores EOS; HF is credited with every position
`generate` produced, padding after an early EOS included, which favours HF):

- HF: one `model.generate` call on the c prompts as a left-padded batch (static batching,
  the strongest way to use `generate`);
- engine: the c requests submitted at once; continuous batching does the rest.

Each side is measured alone, on a thread of its own with `--threads` torch threads while
the main thread stays at one, so that the process holds one OpenMP team at a time (two
multi-threaded teams slow both sides; docs/inference.md, "Threads").

Then the tiny model through HTTP (`nexrl serve` in a subprocess, 64 concurrent clients)
vs the same 64 requests in-process. Ratios compare numbers measured in the same run.

    python benchmarks/bench_generation.py [--quick] [--threads 1] [--out DIR | --update-results]
    python benchmarks/bench_generation.py --smoke   # seconds: tiny model, c=1 and 4, no files
    python benchmarks/bench_generation.py --smollm2 --threads 2   # the real 135M chat model
    python benchmarks/bench_generation.py --smollm2 --threads 2 --dtype bfloat16   # both in bf16
    python benchmarks/bench_generation.py --smollm2 --dtype bfloat16 --chat --device cuda  # GPU
    python benchmarks/bench_generation.py --vllm [--smoke]   # + vLLM: tokens/s, TTFT (_serving.py)
    python benchmarks/bench_generation.py --recipe-steps 6 [--smoke]   # s/step per backend

With `--dtype bfloat16` both sides run in bf16 (fast only where the CPU multiplies bf16
natively: avx512_bf16 / AMX, named on the results' machine line), and HF generate in
fp32 is measured beside them, the baseline a user of an fp32 trainer starts from.

The last line is `speedup_vs_hf_at_64: X` (default tiny model, concurrency 64).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch
from _machine import add_out_arguments, command, describe, record, results_dir

from nexrl.inference.engine import Engine
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.models.sources import resolve_model
from nexrl.models.tiny import CHARS, build_tiny_qwen2, default_model_path


def prompts(tokenizer, count: int, seed: int = 0, chat: bool = False) -> list[list[int]]:
    """`count` random strings of 16-32 characters as token ids; `chat`: each one the user
    message of a chat, through the tokenizer's chat template (SmolLM2's adds its default
    system prompt, so the chats share their first 25 tokens)."""
    rng = random.Random(seed)
    texts = ["".join(rng.choices(CHARS, k=rng.randint(16, 32))) for _ in range(count)]
    if chat:
        return [
            tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], add_generation_prompt=True, return_dict=False
            )
            for t in texts
        ]
    return [tokenizer(t, add_special_tokens=False)["input_ids"] for t in texts]


@torch.inference_mode()
def hf_tokens_per_s(model, tokenizer, batch: list[list[int]], max_tokens: int, waves: int) -> float:
    import copy

    cfg = copy.deepcopy(model.generation_config)
    cfg.eos_token_id = None  # generate may restore the model EOS: rows ending early get padded
    width = max(map(len, batch))
    pad = tokenizer.pad_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in batch], device=model.device)
    mask = (
        (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in batch])[:, None])
        .long()
        .to(model.device)
    )
    start, total = time.perf_counter(), 0
    for _ in range(waves):
        out = model.generate(
            ids,
            attention_mask=mask,
            generation_config=cfg,
            max_new_tokens=max_tokens,
            min_new_tokens=0,
            do_sample=True,
            top_k=0,
            top_p=1.0,
            pad_token_id=pad,
        )
        total += (out.shape[1] - width) * len(batch)
    synchronize(model.device)
    return total / (time.perf_counter() - start)


def synchronize(device: torch.device) -> None:
    """Wait for the device's queued work (a GPU's kernels run after their launch returns)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def engine_tokens_per_s(
    engine: Engine, batch: list[list[int]], max_tokens: int, waves: int
) -> float:
    params = SamplingParams(max_new_tokens=max_tokens, ignore_eos=True)
    start, total = time.perf_counter(), 0
    for _ in range(waves):
        futs = [engine.submit(GenerationRequest(list(p), params)) for p in batch]
        total += sum(len(f.result().outputs[0].output_ids) for f in futs)
    return total / (time.perf_counter() - start)


def on_thread(threads: int, fn, *args):
    """`fn(*args)` on a new thread computing with `threads` torch threads. The process
    holds one OpenMP team at a time this way (this thread stays at one torch thread, and
    the measuring thread, with its team, is gone on return): libgomp stops spinning once
    a process holds more OpenMP threads than cores (docs/inference.md, "Threads")."""
    box: dict = {}

    def run() -> None:
        torch.set_num_threads(threads)
        box["out"] = fn(*args)

    thread = threading.Thread(target=run)
    thread.start()
    thread.join()
    return box["out"]


def engine_alone(
    model, tok, threads: int, size: int, max_len: int, batch, max_tokens, n, prefix_gib=0.25
):
    """Tokens/s of an engine over `model` that lives for this measurement only (its thread,
    with `threads` torch threads, is the only OpenMP team while it runs). The prefix
    cache starts empty (`prefix_gib`: its budget, 0 turns it off)."""
    engine = Engine(
        model_and_tokenizer=(model, tok), max_batch_size=size, max_model_len=max_len,
        threads=threads, prefix_cache_gib=prefix_gib,
    )  # fmt: skip
    try:
        engine_tokens_per_s(engine, prompts(tok, 4, 99), 4, 1)  # warm-up
        engine.reset_prefix_cache()
        return engine_tokens_per_s(engine, batch, max_tokens, n)
    finally:
        engine.shutdown()


def compare(
    path: Path,
    label: str,
    concurrencies,
    max_tokens: int,
    rows: list[dict],
    repeats: int,
    waves: int | None = None,
    dtype: str = "float32",
    threads: int = 1,
    chat: bool = False,
    device: str = "cpu",
) -> None:
    """Rows of HF generate vs the engine, both in `dtype` on `device` (the engine runs on
    the device of the model it is given), each measured alone with `threads` torch
    threads; for a dtype other than fp32 the row also holds `hf_fp32` (HF generate in
    fp32) and `speedup_vs_hf_fp32`. `chat`: chat-template prompts, and
    the row also holds the engine without its prefix cache (`engine_no_prefix`)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(path))
    model = AutoModelForCausalLM.from_pretrained(str(path), dtype=getattr(torch, dtype))
    model = model.to(device).eval()
    fp32 = None
    if dtype != "float32":
        fp32 = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32)
        fp32 = fp32.to(device).eval()
    size, max_len = max(concurrencies), 64 + max_tokens
    for c in concurrencies:
        batch = prompts(tok, c, seed=c, chat=chat)
        n = waves or (3 if c <= 64 else 1)  # >= ~0.25 s per engine measurement
        hf = ours = hf32 = plain = 0.0
        engine_args = (model, tok, threads, size, max_len, batch, max_tokens, n)
        for _ in range(repeats):  # interleaved, best of `repeats`: the CPU is shared
            hf = max(hf, on_thread(threads, hf_tokens_per_s, model, tok, batch, max_tokens, n))
            ours = max(ours, engine_alone(*engine_args))
            if fp32 is not None:
                args = (fp32, tok, batch, max_tokens, n)
                hf32 = max(hf32, on_thread(threads, hf_tokens_per_s, *args))
            if chat:
                plain = max(plain, engine_alone(*engine_args, prefix_gib=0))
        row = dict(model=label, concurrency=c, hf=hf, engine=ours, speedup=ours / hf)
        if fp32 is not None:
            row.update(hf_fp32=hf32, speedup_vs_hf_fp32=ours / hf32)
        if chat:
            row.update(engine_no_prefix=plain, speedup_no_prefix=plain / hf)
        rows.append(row)
        extra = f"   hf fp32 {hf32:7.0f} tok/s   x{ours / hf32:5.2f}" if fp32 else ""
        if chat:
            extra += f"   engine without prefix cache {plain:7.0f} tok/s   x{plain / hf:5.2f}"
        print(
            f"{label:>10} c={c:<4} hf {hf:9.0f} tok/s   engine {ours:9.0f} tok/s   "
            f"x{ours / hf:5.2f}{extra}",
            flush=True,
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


async def _http_run(url: str, batch: list[list[int]], max_tokens: int, waves: int) -> float:
    """Tokens/s of `waves` rounds of len(batch) concurrent requests (after a warm-up round).

    aiohttp (installed with ray[default]) as the client: httpx's async client costs several
    ms per request on this CPU and would measure the client, not the server.
    """
    import aiohttp

    connector = aiohttp.TCPConnector(limit=len(batch))
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def one(p: list[int], n_tokens: int) -> int:
            body = {"model": "default", "prompt": p, "max_tokens": n_tokens, "ignore_eos": True}
            async with session.post("/v1/completions", json=body) as r:
                r.raise_for_status()
                return len((await r.json())["choices"][0]["token_ids"])

        await asyncio.gather(*(one(p, 2) for p in batch))  # open the connections
        start, total = time.perf_counter(), 0
        for _ in range(waves):
            total += sum(await asyncio.gather(*(one(p, max_tokens) for p in batch)))
        return total / (time.perf_counter() - start)


def http_vs_inprocess(
    path: Path, threads: int, max_tokens: int, waves: int, repeats: int
) -> tuple[float, float]:
    """Tokens/s of 64 concurrent HTTP clients vs the same requests in-process."""
    from transformers import AutoTokenizer

    batch = prompts(AutoTokenizer.from_pretrained(str(path)), 64, seed=64)
    engine = Engine(path, max_batch_size=64, max_model_len=64 + max_tokens, threads=threads)
    engine_tokens_per_s(engine, batch[:4], 4, 1)
    local = max(engine_tokens_per_s(engine, batch, max_tokens, waves) for _ in range(repeats))
    engine.shutdown()
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "nexrl.inference.serve",
        "--model",
        str(path),
        "--port",
        str(port),
        "--max-batch",
        "64",
        "--max-model-len",
        str(64 + max_tokens),
        "--threads",
        str(threads),
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        url = f"http://127.0.0.1:{port}"
        _wait_for(url)
        remote = max(asyncio.run(_http_run(url, batch, max_tokens, waves)) for _ in range(repeats))
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    return local, remote


def _wait_for(url: str, timeout: float = 120.0) -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.2)
    raise TimeoutError(f"server at {url} did not come up in {timeout}s")


def write_results(out: Path, rows: list[dict], http: tuple[float, float], meta: dict) -> None:
    out.mkdir(parents=True, exist_ok=True)
    lines = [
        "# Generation benchmark",
        "",
        f"{meta['machine']}  ",
        f"Command: `{meta['command']}`  ",
        f"Date: {meta['date']}  ",
        f"Load average before / after: {meta['load_before']} / {meta['load_after']}  ",
        f"torch threads: {meta['threads']}, max_tokens: {meta['max_tokens']}, "
        f"best of {meta['repeats']} interleaved repeats per cell, 3 waves per measurement at "
        "concurrency <= 64",
        "",
        "| model | concurrency | HF generate tok/s | engine tok/s | speedup |",
        "|---|---|---|---|---|",
    ]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['concurrency']} | {r['hf']:.0f} | {r['engine']:.0f} | "
            f"{r['speedup']:.2f} |"
        )
    local, remote = http
    lines += [
        "",
        f"HTTP, 64 concurrent clients: {remote:.0f} tok/s vs in-process {local:.0f} tok/s "
        f"(ratio {remote / local:.2f})",
        "",
    ]
    name = "generation_quick" if meta["quick"] else "generation"
    (out / f"{name}.md").write_text("\n".join(lines))
    payload = {"rows": rows, "http_tok_s": remote, "inprocess_tok_s": local, **meta}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))


def parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="2 repeats, shorter 30M run (<2 min)")
    ap.add_argument("--threads", type=int, default=1, help="torch threads (both sides)")
    add_out_arguments(ap)
    ap.add_argument("--repeats", type=int, default=None, help="best of N (default 3, quick 2)")
    ap.add_argument("--smoke", action="store_true", help="tiny sizes, no results files (seconds)")
    ap.add_argument("--smollm2", action="store_true", help="SmolLM2-135M-Instruct, c=16 and 64")
    ap.add_argument("--model-path", default="smollm2", help="with --smollm2: model dir or id")
    ap.add_argument(
        "--dtype", default="float32", choices=("float32", "bfloat16"), help="with --smollm2"
    )
    ap.add_argument(
        "--chat", action="store_true", help="with --smollm2: chat-template prompts, the "
        "engine with and without its prefix cache",
    )  # fmt: skip
    ap.add_argument(
        "--device", default="cpu", help="with --smollm2: where both sides run (cpu, cuda)"
    )
    ap.add_argument("--vllm", action="store_true", help="SmolLM2 chats: nexrl, vLLM, HF")
    ap.add_argument("--recipe-steps", type=int, default=0, help="N steps of --recipe per backend")
    ap.add_argument("--recipe", default="smollm2_arithmetic", help="with --recipe-steps")
    ap.add_argument("--backends", default="builtin,vllm", help="with --recipe-steps")
    return ap


def main(argv: list[str] | None = None) -> int:
    ap = parser()
    args = ap.parse_args(argv)
    if args.device != "cpu" and not args.smollm2:
        ap.error("--device is for --smollm2 (the default runs compare CPU paths and HTTP)")
    if args.recipe_steps:  # seconds per step of a recipe on each backend (_recipe.py)
        from _recipe import recipe_run

        backends = args.backends.split(",")
        return recipe_run(args.recipe, args.recipe_steps, backends, results_dir(args), args.smoke)
    if args.vllm:
        from _serving import vllm_run

        return vllm_run(resolve_model(args.model_path), args.dtype, args.threads, args.smoke)
    if args.smollm2:
        model = resolve_model(args.model_path)
        repeats = args.repeats or 1
        out = results_dir(args)
        opts = dict(dtype=args.dtype, chat=args.chat, device=args.device)
        return smollm2(model, args.threads, out, repeats, args.smoke, **opts)
    if args.smoke:
        return smoke(args.threads)
    torch.set_num_threads(1)  # each side computes on its own thread (`on_thread`)
    max_tokens = 64  # --quick trims repeats and the 30M model, not the measured sequence
    repeats = args.repeats or (2 if args.quick else 3)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows: list[dict] = []
    with tempfile.TemporaryDirectory() as tmp:
        mid = build_tiny_qwen2(
            Path(tmp) / "qwen2-30m",
            hidden_size=512,
            num_layers=8,
            num_heads=8,
            num_kv_heads=4,
            intermediate_size=2048,
        )
        compare(
            default_model_path(), "tiny-1M", (1, 16, 64, 256), max_tokens, rows, repeats,
            threads=args.threads,
        )  # fmt: skip
        mid_conc = (1, 16, 64) if args.quick else (1, 16, 64, 256)
        mid_tokens = 16 if args.quick else max_tokens
        compare(mid, "qwen2-30M", mid_conc, mid_tokens, rows, repeats, threads=args.threads)
        http = http_vs_inprocess(
            default_model_path(), args.threads, 128, 2 if args.quick else 3, repeats
        )
    meta = dict(
        command=command(),
        machine=describe().splitlines()[0],
        date=time.strftime("%Y-%m-%d %H:%M:%S"),
        load_before=load_before,
        load_after=" ".join(f"{x:.2f}" for x in os.getloadavg()),
        threads=args.threads,
        max_tokens=max_tokens,
        quick=args.quick,
        repeats=repeats,
    )
    write_results(results_dir(args), rows, http, meta)
    print(f"http_vs_inprocess_at_64: {http[1] / http[0]:.2f}")
    at64 = next(r for r in rows if r["model"] == "tiny-1M" and r["concurrency"] == 64)
    print(f"speedup_vs_hf_at_64: {at64['speedup']:.2f}")
    return 0


def smollm2(
    model: Path,
    threads: int,
    out: Path,
    repeats: int,
    smoke: bool = False,
    dtype="float32",
    chat: bool = False,
    device: str = "cpu",
) -> int:
    """Engine vs HF generate on the real 135M chat model (one wave of 32 tokens per cell:
    HF needs about half a minute per wave at c=64 on 2 cores; a GPU adds c=256); smoke:
    c=2, 4 tokens."""
    torch.set_num_threads(1)  # each side computes on its own thread (`on_thread`)
    load_before = " ".join(f"{x:.2f}" for x in os.getloadavg())
    rows: list[dict] = []
    opts = dict(dtype=dtype, threads=threads, chat=chat, device=device)
    if smoke:
        compare(model, "smollm2-135M", (2,), 4, rows, 1, waves=1, **opts)
        print(f"smoke: smollm2_speedup_vs_hf_at_2: {rows[-1]['speedup']:.2f}")
        return 0
    concurrencies = (16, 64) if device == "cpu" else (16, 64, 256)
    compare(model, "smollm2-135M", concurrencies, 32, rows, repeats, 1, **opts)
    short = {"float32": "fp32", "bfloat16": "bf16"}[dtype]
    fp32_cols = dtype != "float32"
    head = "| concurrency | HF generate tok/s | engine tok/s | speedup |"
    rule = "|---|---|---|---|"
    if fp32_cols:
        head += " HF generate fp32 tok/s | engine vs HF fp32 |"
        rule += "---|---|"
    if chat:
        head += " engine, no prefix cache, tok/s | its speedup |"
        rule += "---|---|"

    def cells(r: dict) -> str:
        line = f"| {r['concurrency']} | {r['hf']:.0f} | {r['engine']:.0f} | {r['speedup']:.2f} |"
        if fp32_cols:
            line += f" {r['hf_fp32']:.0f} | {r['speedup_vs_hf_fp32']:.2f} |"
        if chat:
            line += f" {r['engine_no_prefix']:.0f} | {r['speedup_no_prefix']:.2f} |"
        return line

    prompt_kind = "chat-template prompts (one system prompt), " if chat else ""
    lines = [
        f"# Generation: SmolLM2-135M-Instruct ({short}), engine vs HF generate",
        "",
        f"{describe().splitlines()[0]}  ",
        f"Command: `{command()}`  ",
        f"Date: {time.strftime('%Y-%m-%d %H:%M:%S')}  ",
        f"Load average before / after: {load_before} / "
        + " ".join(f"{x:.2f}" for x in os.getloadavg())
        + "  ",
        f"device: {device}, torch threads: {threads}, each side measured alone on its own "
        f"thread (one OpenMP team in the process), {prompt_kind}32 new tokens, one wave, "
        f"best of {repeats}",
        "",
        head,
        rule,
        *(cells(r) for r in rows),
        "",
    ]
    out.mkdir(parents=True, exist_ok=True)
    name = "generation_smollm2" + ("" if dtype == "float32" else f"_{short}")
    name += "_chat" if chat else ""
    name += "" if device == "cpu" else f"_{torch.device(device).type}"
    payload = {**record(), "rows": rows, "device": device}
    (out / f"{name}.json").write_text(json.dumps(payload, indent=1))
    name += ".md"
    (out / name).write_text("\n".join(lines))
    at64 = next(r for r in rows if r["concurrency"] == 64)
    print(f"smollm2_speedup_vs_hf_at_64: {at64['speedup']:.2f}")
    return 0


def smoke(threads: int) -> int:
    """The same code paths at toy sizes: engine vs HF at c=1 and 4, then HTTP vs in-process."""
    rows: list[dict] = []
    torch.set_num_threads(1)
    compare(default_model_path(), "tiny-1M", (1, 4), 8, rows, 1, threads=threads)
    local, remote = http_vs_inprocess(default_model_path(), threads, 8, 1, 1)
    print(f"smoke: speedup_vs_hf_at_4: {rows[-1]['speedup']:.2f}")
    print(f"smoke: http_vs_inprocess: {remote / local:.2f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
