"""The decode step's CUDA graphs: bucketing and padding (on any device, recorded or
not), weights kept at their addresses across updates, and the graphs themselves on a GPU."""

from __future__ import annotations

import copy

import pytest
import torch

from nexrl.inference.cuda_graphs import MIN_SPAN, DecodeGraphs, bucket, buckets
from nexrl.inference.engine import Engine
from nexrl.inference.model_runner import ModelRunner
from nexrl.inference.protocol import GenerationRequest, SamplingParams
from nexrl.models.tiny import VOCAB_SIZE

PROMPTS = torch.tensor([[5, 6, 7, 8, 9], [10, 11, 12, 0, 0], [13, 14, 15, 16, 0]])
LENGTHS = torch.tensor([5, 3, 4])
VOCAB = VOCAB_SIZE


def test_bucket_is_the_next_power_of_two_within_bounds():
    assert [bucket(n, 64) for n in (1, 2, 3, 5, 33, 64)] == [1, 2, 4, 8, 64, 64]
    assert bucket(100, 96) == 96  # the cap (the engine's slots) is a bucket too
    assert bucket(3, 4096, MIN_SPAN) == MIN_SPAN and bucket(129, 4096, MIN_SPAN) == 256
    assert buckets(1, 96) == [1, 2, 4, 8, 16, 32, 64, 96]
    assert buckets(MIN_SPAN, 300) == [128, 256, 300] and buckets(MIN_SPAN, 40) == [40]
    for cap, least in (
        (96, 1),
        (300, MIN_SPAN),
        (40, MIN_SPAN),
    ):  # every bucket a call can pick is listed
        assert {bucket(n, cap, least) for n in range(1, cap + 1)} == set(buckets(least, cap))


def test_every_bucket_is_recorded_up_front(hf_model):
    runner = _prefilled(hf_model)
    graphs = DecodeGraphs(runner._decode, 8, 160, VOCAB, "cpu", capture=False)
    assert graphs.keys()[0] == (8, 160)  # the largest first: the others reuse its memory
    assert set(graphs.graphs) == {(r, s) for r in (1, 2, 4, 8) for s in (128, 160)}


def _prefilled(model, dtype=torch.float32) -> ModelRunner:
    runner = ModelRunner(copy.deepcopy(model).to(dtype), 8, 160, native_attention=False)
    rows = torch.arange(3)
    runner.prefill(PROMPTS, LENGTHS, rows, rows)
    return runner


@torch.inference_mode()
def _decode_restoring_cache(runner: ModelRunner, fn) -> torch.Tensor:
    saved = [t.clone() for t in (*runner.k_cache, *runner.v_cache)]
    out = fn()
    for t, s in zip((*runner.k_cache, *runner.v_cache), saved, strict=True):
        t.copy_(s)
    return out


@pytest.mark.parametrize(("dtype", "tol"), [(torch.float32, 1e-5), (torch.bfloat16, 0.05)])
def test_padded_fixed_span_step_gives_the_plain_steps_logits(hf_model, dtype, tol):
    runner = _prefilled(hf_model, dtype)
    tokens, pos = torch.tensor([17, 18, 19]), LENGTHS.clone()
    caches = {}

    def step(name, fn):
        out = fn()
        caches[name] = torch.stack([*runner.k_cache, *runner.v_cache])
        return out

    plain = _decode_restoring_cache(
        runner, lambda: step("plain", lambda: runner.decode(tokens, pos))
    )
    padded = DecodeGraphs(runner._decode, 8, 160, VOCAB, "cpu", capture=False)
    got = _decode_restoring_cache(
        runner, lambda: step("padded", lambda: padded(tokens, pos, int(pos.max()) + 1))
    )
    assert got.shape == plain.shape == (3, hf_model.config.vocab_size)
    assert padded.tokens[3:4].tolist() == [0]  # row 3 pads the batch to 4
    torch.testing.assert_close(got, plain, atol=tol, rtol=tol)
    # the padding row wrote position 0 of its own (free) cache row, and nothing else
    same = torch.isclose(caches["padded"], caches["plain"], atol=tol, rtol=tol)
    changed = (~same).any(dim=(0, 2, 4))  # (rows, positions)
    assert changed.nonzero().tolist() in ([], [[3, 0]])


def test_a_weight_update_reaches_the_tensors_the_graphs_read(hf_model, other_weights_path):
    from transformers import AutoModelForCausalLM

    other = AutoModelForCausalLM.from_pretrained(str(other_weights_path), dtype=torch.float32)
    runner = _prefilled(hf_model)
    runner.graphs = DecodeGraphs(runner._decode, 8, 160, VOCAB, "cpu", capture=False)
    before = runner._weights()
    runner.model.load_state_dict(other.state_dict())
    runner.refresh()
    after = runner._weights()
    assert all(a is b for a, b in zip(before, after, strict=True))  # same tensors...
    fresh = _prefilled(other)
    tokens, pos = torch.tensor([17, 18, 19]), LENGTHS.clone()
    runner.prefill(PROMPTS, LENGTHS, torch.arange(3), torch.arange(3))
    want = fresh.decode(tokens, pos)
    torch.testing.assert_close(runner.decode(tokens, pos), want)  # ...holding the new values


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_on_a_gpu_the_graphs_sample_what_the_eager_step_samples(tiny_path, dtype):
    def greedy(cuda_graphs: bool) -> list[int]:
        engine = Engine(tiny_path, device="cuda", dtype=dtype, cuda_graphs=cuda_graphs)
        try:
            params = SamplingParams(max_new_tokens=12, temperature=0.0, n=3)
            prompts = [[5, 6, 7], [8, 9, 10, 11, 12], [13]]
            futures = [engine.submit(GenerationRequest(p, params)) for p in prompts]
            tokens = [t for f in futures for o in f.result().outputs for t in o.output_ids]
            assert (engine.runner.graphs is not None) is cuda_graphs
            assert not cuda_graphs or engine.runner.graphs.graphs  # recorded and replayed
            return tokens
        finally:
            engine.shutdown()

    graphed, eager = greedy(True), greedy(False)
    assert len(graphed) == len(eager) == 9 * 12
    same = sum(a == b for a, b in zip(graphed, eager, strict=True)) / len(eager)
    # bf16: a different attention span may round a near-tie the other way
    assert same == 1.0 if dtype == "float32" else same >= 0.8


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_recorded_graphs_decode_with_updated_weights(tiny_path, other_weights_path):
    from nexrl.inference.protocol import WeightUpdateMeta

    params = SamplingParams(max_new_tokens=8, temperature=0.0)

    def run(path, update_to=None) -> list[int]:
        engine = Engine(path, device="cuda")
        try:
            engine.generate(GenerationRequest([5, 6, 7], params))  # records the graphs
            if update_to is not None:
                engine.update_weights(WeightUpdateMeta(path=str(update_to), version=1))
            return engine.generate(GenerationRequest([5, 6, 7], params)).outputs[0].output_ids
        finally:
            engine.shutdown()

    assert run(tiny_path, update_to=other_weights_path) == run(other_weights_path)


def test_a_run_config_may_set_the_option_and_a_cpu_engine_records_no_graphs(tiny_path, monkeypatch):
    import nexrl.inference.engine as engine_module
    from nexrl.inference.factory import build_local_engine, check_engine_options

    received = []

    class Spy(ModelRunner):
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **kwargs)
            received.append(args[5])  # cuda_graphs, as the engine passes it

    monkeypatch.setattr(engine_module, "ModelRunner", Spy)
    for on in (True, False):
        config = {"model": str(tiny_path), "cuda_graphs": on}
        check_engine_options({"cuda_graphs": on})  # a known key of the engine section
        engine = build_local_engine(config)
        try:
            params = SamplingParams(max_new_tokens=3, temperature=0.0)
            out = engine.generate(GenerationRequest([5, 6], params))
            assert len(out.outputs[0].output_ids) == 3
            assert engine.runner.graphs is None  # graphs are for a GPU only
        finally:
            engine.shutdown()
    assert received == [True, False]  # the option reached the runner


@pytest.mark.skipif(not torch.cuda.is_available(), reason="CUDA graphs need a GPU")
def test_on_a_gpu_a_thread_training_beside_the_engine_runs_undisturbed(tiny_path):
    """Fully-async runs train beside the engine: its graphs are all recorded when it starts
    (a recording while another thread draws CUDA random numbers fails there), so the
    trainer's kernels, allocations, random numbers and reads never meet a recording."""
    import threading

    stop, errors = threading.Event(), []
    engine = Engine(tiny_path, device="cuda")
    graphs = engine.runner.graphs
    assert graphs is not None and not graphs.failed and set(graphs.graphs) == set(graphs.keys())

    def train() -> None:
        layer = torch.nn.Linear(256, 256, device="cuda")
        opt = torch.optim.AdamW(layer.parameters())
        try:
            while not stop.is_set():
                x = torch.nn.functional.dropout(torch.randn(64, 256, device="cuda"), 0.1)
                loss = layer(x).square().mean()
                loss.backward()
                opt.step()
                opt.zero_grad()
                float(loss)  # reads back, as a trainer's metrics do
        except Exception as exc:
            errors.append(exc)

    trainer = threading.Thread(target=train)
    trainer.start()
    try:
        for n in (1, 3, 5, 9, 17):  # another batch bucket each time
            params = SamplingParams(max_new_tokens=4, n=n)
            assert len(engine.generate(GenerationRequest([5, 6, 7], params)).outputs) == n
    finally:
        stop.set()
        trainer.join()
        engine.shutdown()
    assert not errors


def test_positions_kept_on_the_host_follow_the_device_ones():
    """On a GPU the batch keeps a host copy of its positions (the step's span and the
    rows to move come from it); `meta` stands in for the GPU here."""
    from concurrent.futures import Future

    from nexrl.inference.sampler import StopChecker
    from nexrl.inference.scheduler import Pending, Row, RunningBatch

    batch = RunningBatch(8, 64, device="meta")
    assert batch.host_pos is not batch.pos and batch.host_pos.device.type == "cpu"
    params = SamplingParams(max_new_tokens=8, n=4)
    pending = Pending(GenerationRequest([1, 2], params), Future(), [0], StopChecker(None, []))
    rows = [Row(pending, k, None) for k in range(4)]
    batch.add_rows(rows[:2], [5, 9])
    batch.add_rows(rows[2:], [3, 7])
    assert batch.host_pos[:4].tolist() == [4, 8, 2, 6] and batch.max_pos() == 8
    tokens = torch.zeros(2, dtype=torch.long, device="meta")
    batch.record(slice(2, 4), tokens, torch.zeros(2, device="meta"), 0)
    assert batch.host_pos[:4].tolist() == [4, 8, 3, 7]
    src, dst, span = batch.compact([0, 1])  # rows 2 and 3 move into 0 and 1
    assert dst.device.type == "meta" and span == 8
    assert batch.host_pos[:2].tolist() == [3, 7] and batch.max_pos() == 7
    batch.compact([0, 1])
    assert batch.max_pos() == -1
