"""The engine's fast paths: oneDNN linears, the native decode attention, the packed prefill.

Each fast path must give the trainer's logprobs (1e-4, fp32) exactly like the plain
torch path it replaces.
"""

from __future__ import annotations

import shutil

import pytest
import torch
import torch.nn.functional as F

from nexrl.inference import native
from nexrl.inference.engine import Engine
from nexrl.inference.kernels import (
    ONEDNN_MIN_MACS,
    bf16_native,
    linear_for,
    onednn_available,
    weight_packer,
)
from nexrl.inference.protocol import GenerationRequest, SamplingParams

needs_cc = pytest.mark.skipif(
    shutil.which("cc") is None and shutil.which("gcc") is None, reason="no C compiler here"
)
needs_onednn = pytest.mark.skipif(not onednn_available(), reason="torch built without oneDNN")


@needs_onednn
def test_linear_dispatch_matches_f_linear():
    auto = linear_for(torch.device("cpu"), torch.float32, "auto")
    assert linear_for(torch.device("cpu"), torch.float32, "torch") is F.linear
    for rows in (1, 64, 256):  # below and above the oneDNN threshold
        x, w, b = torch.randn(rows, 128), torch.randn(512, 128), torch.randn(512)
        assert (rows * 128 * 512 >= ONEDNN_MIN_MACS) == (rows >= 16)
        torch.testing.assert_close(auto(x, w, b), F.linear(x, w, b), atol=1e-4, rtol=1e-5)
    forced = linear_for(torch.device("cpu"), torch.float32, "onednn")
    x3 = torch.randn(4, 7, 32)  # (batch, seq, in) as in the prefill
    torch.testing.assert_close(forced(x3, w[:, :32], None), F.linear(x3, w[:, :32]))


def test_linear_backend_is_validated():
    with pytest.raises(ValueError, match="matmul must be one of"):
        linear_for(torch.device("cpu"), torch.float32, "blas")


@needs_cc
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_rope", [False, True])
@pytest.mark.parametrize(("heads", "kv_heads", "head_dim"), [(4, 2, 32), (4, 4, 16), (8, 2, 24)])
def test_native_attention_matches_reference(heads, kv_heads, head_dim, with_rope, dtype):
    """fp32 and bf16 caches: the kernel computes in fp32 and rounds once, as the fp32
    reference does (bf16: the appended keys equal the reference's bit for bit)."""
    attend = native.decode_attention(head_dim, 40, dtype)
    assert attend is not None, "the kernel failed to build or failed its self-check"
    gen = torch.Generator().manual_seed(heads + head_dim)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(dtype)

    rows = 6
    kc, vc = randn(8, kv_heads, 40, head_dim), randn(8, kv_heads, 40, head_dim)
    pos = torch.tensor([0, 3, 39, 17, 1, 25])
    # q, k, v as the decode step hands them over: strided slices of the fused projection
    qkv = randn(rows, heads + 2 * kv_heads, head_dim)
    q, k, v = qkv[:, :heads], qkv[:, heads : heads + kv_heads], qkv[:, heads + kv_heads :]
    rope = (randn(40, head_dim), randn(40, head_dim)) if with_rope else None
    want_kc, want_vc = kc.clone(), vc.clone()
    want = native.reference_attention(q, k, v, want_kc, want_vc, pos, rope)
    for b, p in enumerate(pos.tolist()):  # keys and values past a row's position are never read
        kc[b, :, p + 1 :] = float("nan")
        vc[b, :, p + 1 :] = float("nan")
    got = attend(q, k, v, kc, vc, pos, rope)
    assert got.dtype == dtype
    tol = {torch.float32: (1e-5, 1e-4), torch.bfloat16: (1e-2, 1e-2)}[dtype]
    torch.testing.assert_close(got, want, atol=tol[0], rtol=tol[1])
    for b, p in enumerate(pos.tolist()):  # the step's k (rotated) and v were appended at pos
        torch.testing.assert_close(kc[b, :, : p + 1], want_kc[b, :, : p + 1], atol=1e-6, rtol=0)
        torch.testing.assert_close(vc[b, :, : p + 1], want_vc[b, :, : p + 1], atol=0, rtol=0)


@needs_cc
@pytest.mark.parametrize("threads", [1, 2, 3])
def test_native_attention_splits_its_blocks_over_torch_threads(threads):
    """Where torch runs on libgomp the kernel is built with OpenMP on the same runtime (no
    second one is mapped) and splits its (row, kv head) blocks over the caller's torch
    threads, each with its own scratch; any thread count gives the reference result."""
    before = native.openmp_runtimes()
    attend = native.decode_attention(16, 24, torch.float32)
    assert attend is not None
    assert native.openmp_runtimes() == before
    if "OpenMP" in torch.__config__.parallel_info() and len(before) == 1:
        assert native.openmp_flags() == ("-fopenmp",)
    gen = torch.Generator().manual_seed(threads)
    rows, heads, kv = 9, 6, 2
    q, k, v = (torch.randn(rows, n, 16, generator=gen) for n in (heads, kv, kv))
    kc, vc = (
        torch.randn(rows, kv, 24, 16, generator=gen),
        torch.randn(rows, kv, 24, 16, generator=gen),
    )
    pos = torch.randint(0, 24, (rows,), generator=gen)
    rope = (torch.randn(24, 16, generator=gen), torch.randn(24, 16, generator=gen))
    want = native.reference_attention(q, k, v, kc.clone(), vc.clone(), pos, rope)
    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        got = attend(q, k, v, kc, vc, pos, rope)
    finally:
        torch.set_num_threads(saved)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-4)


@needs_cc
def test_native_attention_refuses_a_cache_of_another_dtype():
    attend = native.decode_attention(16, 8, torch.bfloat16)
    assert attend is not None
    q, kv = torch.randn(1, 2, 16), torch.randn(1, 2, 16)
    cache = torch.zeros(1, 2, 8, 16)
    with pytest.raises(TypeError, match="bfloat16 kernel got a torch.float32 cache"):
        attend(q, kv, kv, cache, cache.clone(), torch.tensor([0]))


@needs_cc
def test_native_build_is_cached_and_can_be_switched_off(monkeypatch):
    first = native._build(32)
    assert first is not None and first.exists()
    stamp = first.stat().st_mtime_ns
    assert native._build(32) == first and first.stat().st_mtime_ns == stamp
    monkeypatch.setenv("NEXRL_NATIVE", "0")
    native.decode_attention.cache_clear()
    try:
        assert native.decode_attention(32, 16) is None
    finally:
        native.decode_attention.cache_clear()


@pytest.mark.parametrize(
    ("matmul", "native_attention"),
    [("torch", False), pytest.param("onednn", True, marks=[needs_onednn, needs_cc])],
)
def test_fast_paths_keep_trainer_parity(
    tiny_path, hf_model, trainer_logprobs, matmul, native_attention
):
    """Prompts of different lengths, n > 1, prefilled together: every logprob matches."""
    engine = Engine(tiny_path, max_batch_size=16, matmul=matmul, native_attention=native_attention)
    try:
        assert (engine.runner.native_attention is not None) == native_attention
        prompts = [[5, 6, 7], list(range(10, 31)), [9], list(range(3, 14))]
        prefills, prefill = [], engine.runner.prefill
        engine.runner.prefill = lambda t, *a: prefills.append(t.shape[0]) or prefill(t, *a)
        engine.pause()  # queue them all so that one prefill packs them together
        futures = [
            engine.submit(
                GenerationRequest(
                    p, SamplingParams(max_new_tokens=12, n=3, seed=i, ignore_eos=True)
                )
            )
            for i, p in enumerate(prompts)
        ]
        engine.resume()
        for prompt, fut in zip(prompts, futures, strict=True):
            outs = fut.result(timeout=60).outputs
            assert len(outs) == 3
            for out in outs:
                ref = trainer_logprobs(hf_model, prompt + out.output_ids)[len(prompt) - 1 :]
                assert len(out.output_ids) == 12
                assert max(abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)) < 1e-4
        assert prefills == [4]  # one packed prefill of the 4 prompts (12 rows)
    finally:
        engine.shutdown()


# bf16 weights are packed only where the CPU multiplies bf16 natively (avx512_bf16 / AMX)
PACKED_DTYPES = [
    ("float32", 1e-4),
    pytest.param(
        "bfloat16",
        3e-2,
        marks=pytest.mark.skipif(not bf16_native(), reason="no native bf16 matmul on this CPU"),
    ),
]


@needs_onednn
@pytest.mark.parametrize(("dtype", "tol"), PACKED_DTYPES)
def test_packed_weights_match_and_follow_weight_updates(tmp_path, dtype, tol):
    """Weights of PACK_MIN_WEIGHT elements or more go to oneDNN pre-packed; the engine's
    logits stay the HF model's, before and after a weight update (refresh repacks)."""
    from nexrl.models.tiny import build_tiny_qwen2

    dt = getattr(torch, dtype)
    pack = weight_packer(torch.device("cpu"), dt, "auto")
    small, large = torch.randn(64, 64, dtype=dt), torch.randn(1024, 512, dtype=dt)
    assert pack(small) is small and pack(large).is_mkldnn
    assert weight_packer(torch.device("cpu"), dt, "torch")(large) is large
    auto, x = linear_for(torch.device("cpu"), dt, "auto"), torch.randn(3, 512, dtype=dt)
    torch.testing.assert_close(
        auto(x, pack(large), None).float(), F.linear(x, large).float(), atol=tol, rtol=tol
    )

    path = build_tiny_qwen2(tmp_path / "wide", hidden_size=512, intermediate_size=1024)
    engine = Engine(path, max_batch_size=4, dtype=dtype)
    try:
        runner, model = engine.runner, engine.model
        assert runner.layers[0].gate_up_w.is_mkldnn and runner.lm_head is not None
        ids = torch.tensor([[5, 9, 11, 4, 7]])

        def check() -> None:
            logits = runner.prefill(ids, torch.tensor([5]), torch.tensor([0]), torch.tensor([0]))
            with torch.inference_mode():
                ref = model(ids).logits[0, -1].float()
            torch.testing.assert_close(logits[0], ref, atol=tol, rtol=tol)

        check()
        with torch.no_grad():
            for p in model.parameters():
                p.mul_(1.5)
        runner.refresh()
        check()
    finally:
        engine.shutdown()


@pytest.mark.parametrize("native_attention", [pytest.param(True, marks=needs_cc), False])
def test_bf16_engine_decodes_close_to_the_fp32_trainer(
    tiny_path, hf_model, trainer_logprobs, native_attention
):
    """A bf16 engine (the native bf16 kernel, or the torch path: SDPA over the cache in
    place) samples with logprobs within bf16 rounding of the fp32 trainer's, over prompts
    of different lengths decoded together; the mismatch left is what the IS correction
    is for."""
    engine = Engine(
        tiny_path, max_batch_size=16, dtype="bfloat16", native_attention=native_attention
    )
    try:
        assert engine.runner.dtype == torch.bfloat16
        assert (engine.runner.native_attention is not None) == native_attention
        prompts = [[5, 6, 7], list(range(10, 31)), [9], list(range(3, 14))]
        params = [SamplingParams(max_new_tokens=12, n=2, seed=i, ignore_eos=True) for i in range(4)]
        futures = [
            engine.submit(GenerationRequest(p, s)) for p, s in zip(prompts, params, strict=True)
        ]
        gaps = []
        for prompt, fut in zip(prompts, futures, strict=True):
            for out in fut.result(timeout=60).outputs:
                ref = trainer_logprobs(hf_model, prompt + out.output_ids)[len(prompt) - 1 :]
                assert len(out.output_ids) == 12
                gaps += [abs(a - b) for a, b in zip(out.output_logprobs, ref, strict=True)]
        assert max(gaps) < 0.03 and sum(gaps) / len(gaps) < 0.01  # measured: 0.003, 0.001
    finally:
        engine.shutdown()


@pytest.mark.parametrize(("threads", "expected"), [(2, 2), (None, 1)])
def test_engine_threads_size_the_engine_threads_team_only(tiny_path, threads, expected):
    """`threads` applies to the engine's own thread; unset, a model under 1M parameters on
    a CPU (the tiny one) gets one. The caller's count is left alone."""
    before = torch.get_num_threads()
    engine = Engine(tiny_path, max_batch_size=4, threads=threads)
    try:
        assert engine._command(torch.get_num_threads) == expected
        assert torch.get_num_threads() == before
        params = SamplingParams(max_new_tokens=3, ignore_eos=True)
        out = engine.generate(GenerationRequest([5, 6], params))
        assert len(out.outputs[0].output_ids) == 3
    finally:
        engine.shutdown()
    with pytest.raises(ValueError, match="threads must be >= 1"):
        Engine(tiny_path, max_batch_size=4, threads=0)
