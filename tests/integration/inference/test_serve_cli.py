"""`nexrl.inference.serve.main` as a separate process, the way `nexrl serve` runs it."""

from __future__ import annotations

import socket
import subprocess
import sys
import time

import httpx
import openai
import pytest

from nexrl.inference.client import LLMServiceClient
from nexrl.inference.serve import build_parser


def test_parser_defaults():
    args = build_parser().parse_args([])
    assert (args.host, args.port, args.model, args.served_model_name) == (
        "127.0.0.1",
        8000,
        None,
        "default",
    )
    assert build_parser().parse_args(["--max-batch", "4"]).max_batch == 4


@pytest.mark.slow
def test_serve_subprocess(tiny_path):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "nexrl.inference.serve",
        "--model",
        str(tiny_path),
        "--port",
        str(port),
        "--api-key",
        "k",
        "--max-batch",
        "8",
        "--threads",
        "1",
        "--prefix-cache-gib",
        "0.05",
    ]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                if httpx.get(url + "/health", headers={"Authorization": "Bearer k"}).is_success:
                    break
            except httpx.TransportError:
                pass
            assert proc.poll() is None, proc.stdout.read().decode()
            assert time.monotonic() < deadline, "server did not start"
            time.sleep(0.2)
        assert httpx.get(url + "/health").status_code == 401
        sdk = openai.OpenAI(base_url=url + "/v1", api_key="k", max_retries=0)
        out = sdk.completions.create(model="default", prompt="hi", max_tokens=4, n=2)
        assert len(out.choices) == 2
        client = LLMServiceClient({"backend": "remote", "url": url, "api_key": "k"})
        res = client.completion(prompt_ids=[5, 6, 7], max_tokens=3)
        assert res["prompt_ids"] == [5, 6, 7] and res["model_version"] == 0
        turn = [{"role": "user", "content": "a question for a second time"}]
        for _ in range(2):  # the second one reads the first one's prompt from the cache
            sdk.chat.completions.create(model="default", messages=turn, max_tokens=2)
        health = httpx.get(url + "/health", headers={"Authorization": "Bearer k"}).json()
        assert health["prefix_hit_tokens"] >= 10 and health["prompt_tokens"] > 20
        metrics = httpx.get(url + "/metrics", headers={"Authorization": "Bearer k"}).text
        assert f"nexrl_prefix_cache_hit_tokens {float(health['prefix_hit_tokens'])}" in metrics
    finally:
        proc.terminate()
        proc.wait(timeout=30)
