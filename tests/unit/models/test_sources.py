"""Model sources: HF directory, Hub cache (offline rules), GGUF conversion (once, atomic)."""

from __future__ import annotations

import threading

import pytest
from huggingface_hub import constants

from nexrl.models import sources
from nexrl.models.sources import convert_gguf, resolve_model


def test_hf_directory_is_used_as_it_is(tiny_model_path):
    assert str(resolve_model(tiny_model_path)) == tiny_model_path


def test_bad_local_paths_fail_clearly(tmp_path):
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model(tmp_path / "nope")
    with pytest.raises(FileNotFoundError, match="does not exist"):
        resolve_model("./missing.gguf")
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match="not an HF model directory"):
        resolve_model(tmp_path / "empty")
    (tmp_path / "weights.bin").write_bytes(b"x")
    with pytest.raises(ValueError, match="not a .gguf"):
        resolve_model(tmp_path / "weights.bin")


def _fake_hub_cache(root, repo_id: str, files: dict[str, str]):
    """The layout huggingface_hub writes: models--org--name/{refs/main, snapshots/<sha>}."""
    sha = "0" * 40
    repo = root / f"models--{repo_id.replace('/', '--')}"
    (repo / "refs").mkdir(parents=True)
    (repo / "refs" / "main").write_text(sha)
    snap = repo / "snapshots" / sha
    snap.mkdir(parents=True)
    for name, text in files.items():
        (snap / name).write_text(text)
    return snap


def test_hub_id_offline_uses_the_cache_or_says_how_to_get_it(tmp_path, monkeypatch):
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)
    snap = _fake_hub_cache(tmp_path, "org/cached-model", {"config.json": "{}"})
    assert resolve_model("org/cached-model") == snap
    with pytest.raises(FileNotFoundError, match="HF_HUB_OFFLINE.*hf download org/absent"):
        resolve_model("org/absent")


def _fake_gguf(tmp_path):
    gguf = tmp_path / "m.Q4.gguf"
    gguf.write_bytes(b"GGUF" + b"\0" * 64)
    return gguf


def _fake_converted(out):
    """What a conversion leaves, less the weights: configs a cached directory is repaired by."""
    for name in ("config.json", "tokenizer_config.json", "tokenizer.json"):
        (out / name).write_text("{}")


def test_gguf_is_converted_once_and_reused(tmp_path, monkeypatch):
    """The conversion itself is transformers' (covered on SmolLM2 in the integration
    tests); here: caching, the lock and the atomic rename around it."""
    calls = []

    def write(gguf_file, out):
        calls.append(gguf_file)
        _fake_converted(out)

    monkeypatch.setattr(sources, "_write_hf_from_gguf", write)
    gguf = _fake_gguf(tmp_path)
    home = tmp_path / "home"
    results = []
    threads = [
        threading.Thread(target=lambda: results.append(convert_gguf(gguf, home))) for _ in range(3)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(calls) == 1 and len(set(results)) == 1
    assert (results[0] / "config.json").exists()
    assert results[0].parent == home / "models" / "gguf"
    monkeypatch.setenv("NEXRL_HOME", str(home))
    assert resolve_model(gguf) == results[0] == resolve_model(tmp_path)  # file or its dir
    assert len(calls) == 1


def test_failed_conversion_leaves_nothing_behind(tmp_path, monkeypatch):
    def write(gguf_file, out):
        (out / "model.safetensors").write_text("half")
        raise RuntimeError("killed mid-write")

    monkeypatch.setattr(sources, "_write_hf_from_gguf", write)
    home = tmp_path / "home"
    with pytest.raises(RuntimeError, match="mid-write"):
        convert_gguf(_fake_gguf(tmp_path), home)
    left = [p.name for p in (home / "models" / "gguf").iterdir() if not p.name.endswith(".lock")]
    assert left == []


def test_serve_resolves_model_as_model_path_does(tmp_path, monkeypatch, tiny_model_path, capsys):
    """`nexrl serve --model` takes what `model_path` takes: an HF dir as it is, a GGUF file
    (converted once, the same directory as `resolve_model`), and a bad path is one line."""
    from nexrl.inference import serve

    monkeypatch.setattr(sources, "_write_hf_from_gguf", lambda g, out: _fake_converted(out))
    monkeypatch.setenv("NEXRL_HOME", str(tmp_path / "home"))
    gguf = _fake_gguf(tmp_path)
    parser = serve.build_parser()
    for given in (tiny_model_path, str(gguf)):
        args = parser.parse_args(["--model", given])
        serve.check_args(parser, args)
        assert args.model == str(resolve_model(given))
    with pytest.raises(SystemExit) as exit_info:
        serve.check_args(parser, parser.parse_args(["--model", "./missing.gguf"]))
    assert exit_info.value.code == 2
    assert "--model: model_path './missing.gguf' does not exist" in capsys.readouterr().err
