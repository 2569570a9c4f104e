"""The managed vLLM server's command line from engine options (no vLLM needed)."""

from __future__ import annotations

import logging

import pytest

from nexrl.inference.vllm_server import check_vllm_options, server_command


def flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_dtype_is_float32_unless_set(tiny_model_path):
    """vLLM's `auto` serves an fp32 checkpoint in bf16 on a CPU; nexrl asks for fp32, as
    its own engine runs, so the trainer sees the logprobs it computes."""
    assert flag(server_command(tiny_model_path, 8000, {}), "--dtype") == "float32"
    cmd = server_command(tiny_model_path, 8000, {"dtype": "bfloat16", "max_batch_size": 4})
    assert flag(cmd, "--dtype") == "bfloat16" and flag(cmd, "--max-num-seqs") == "4"


def test_builtin_only_options_are_skipped_with_a_warning(caplog):
    with caplog.at_level(logging.WARNING, "nexrl.inference.vllm_server"):
        check_vllm_options({"matmul": "torch", "threads": 2, "max_model_len": 80})
    assert "engine.matmul, service.inference_service.engine.threads" in caplog.text
    with pytest.raises(ValueError, match="engine.kv_heads: not an option of backend vllm"):
        check_vllm_options({"kv_heads": 2, "matmul": "torch"})
