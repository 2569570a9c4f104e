"""nexrl's engine (behind `nexrl serve`) vs vLLM (nexrl's managed server) over the same
HTTP client: tokens/s and time to first token at a few concurrencies.

Both servers get the same prompt token ids through `/v1/completions` (`ignore_eos`, so
every request makes `max_tokens` tokens). Time to first token: the mean latency of c
concurrent requests for one token each (their prefill and first sample, queueing
included), measured apart from the throughput waves.
"""

from __future__ import annotations

import asyncio
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any


async def _measure(url: str, model: str, batch: list[list[int]], max_tokens: int) -> dict:
    import aiohttp

    connector = aiohttp.TCPConnector(limit=len(batch))
    async with aiohttp.ClientSession(url, connector=connector) as session:

        async def one(p: list[int], n_tokens: int) -> tuple[int, float]:
            body = {"model": model, "prompt": p, "max_tokens": n_tokens, "temperature": 1.0}
            body.update(ignore_eos=True, return_token_ids=True)
            start = time.perf_counter()
            async with session.post("/v1/completions", json=body) as r:
                r.raise_for_status()
                got = len((await r.json())["choices"][0]["token_ids"])
            return got, time.perf_counter() - start

        await asyncio.gather(*(one(p, 2) for p in batch))  # warm-up, connections open
        first = await asyncio.gather(*(one(p, 1) for p in batch))
        start = time.perf_counter()
        done = await asyncio.gather(*(one(p, max_tokens) for p in batch))
        elapsed = time.perf_counter() - start
    return {
        "tokens_per_s": sum(n for n, _ in done) / elapsed,
        "ttft_s": statistics.mean(t for _, t in first),
    }


def measure(url: str, model: str, batch: list[list[int]], max_tokens: int) -> dict[str, float]:
    return asyncio.run(_measure(url, model, batch, max_tokens))


def start_nexrl_serve(model: Path, dtype: str, max_batch: int, max_len: int, threads: int):
    from nexrl.inference.vllm_server import free_port

    port = free_port()
    cmd = [sys.executable, "-m", "nexrl.inference.serve", "--model", str(model)]
    cmd += ["--port", str(port), "--max-batch", str(max_batch), "--max-model-len", str(max_len)]
    cmd += ["--threads", str(threads), "--dtype", dtype]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return proc, f"http://127.0.0.1:{port}"


def compare_servers(
    model: Path,
    batches: dict[int, list[list[int]]],
    max_tokens: int,
    dtype: str,
    threads: int,
    wait_for: Any,
    log_dir: Path,
) -> list[dict[str, Any]]:
    """One row per (server, concurrency): tokens/s and TTFT; the servers run one at a time."""
    from nexrl.inference.vllm_server import VLLMServer

    top = max(batches)
    max_len = max(len(p) for b in batches.values() for p in b) + max_tokens + 8
    rows = []
    proc, url = start_nexrl_serve(model, dtype, top, max_len, threads)
    try:
        wait_for(url, 600)
        for c, batch in batches.items():
            rows.append({"server": "nexrl", "c": c, **measure(url, "default", batch, max_tokens)})
    finally:
        proc.terminate()
        proc.wait(timeout=60)
    options = {"dtype": dtype, "max_model_len": max_len, "max_batch_size": top, "kv_cache_gib": 1}
    server = VLLMServer(str(model), {**options, "startup_timeout_s": 1800}, log_dir / "vllm.log")
    started = time.perf_counter()
    server.start()
    startup = time.perf_counter() - started
    try:
        for c, batch in batches.items():
            row = {"server": "vllm", "c": c, **measure(server.url, server.model, batch, max_tokens)}
            rows.append({**row, "startup_s": startup})
    finally:
        server.stop()
    return rows


def vllm_run(model: Path, dtype: str, threads: int, smoke: bool) -> int:
    """bench_generation.py --vllm: nexrl serve vs vLLM over HTTP (tokens/s, TTFT) and HF
    generate (tokens/s), SmolLM2 chats at 1/16/64 concurrent requests."""
    import tempfile

    from _machine import describe
    from bench_generation import _wait_for, hf_tokens_per_s, prompts
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from nexrl.inference.weights import resolve_dtype

    tok = AutoTokenizer.from_pretrained(str(model))
    levels, max_tokens = ((1, 4), 8) if smoke else ((1, 16, 64), 64)
    batches = {c: prompts(tok, c, seed=c, chat=True) for c in levels}
    with tempfile.TemporaryDirectory() as tmp:
        rows = compare_servers(model, batches, max_tokens, dtype, threads, _wait_for, Path(tmp))
    hf = AutoModelForCausalLM.from_pretrained(str(model), dtype=resolve_dtype(dtype)).eval()
    # one short call first: the first `generate` of a process pays one-time set-up (several
    # seconds), which the servers paid in their own warm-up waves
    hf_tokens_per_s(hf, tok, batches[levels[-1]], 4, 1)
    for c, batch in batches.items():
        speed = hf_tokens_per_s(hf, tok, batch, max_tokens, 1)
        rows.append({"server": "hf", "c": c, "tokens_per_s": speed, "ttft_s": float("nan")})
    print(describe().splitlines()[0])
    for r in rows:
        speed, ttft = r["tokens_per_s"], r["ttft_s"]
        print(f"{r['server']:6} c={r['c']:3} {speed:8.1f} tok/s  TTFT {ttft:.3f} s")
    at = {(r["server"], r["c"]): r["tokens_per_s"] for r in rows}
    top = levels[-1]
    print(f"smoke: vllm_vs_nexrl_at_{top}: {at['vllm', top] / at['nexrl', top]:.2f}")
    return 0
