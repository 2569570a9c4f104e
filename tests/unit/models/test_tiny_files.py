"""The embedded model's files load the same in transformers 4 and 5 (one shared cache)."""

from __future__ import annotations

import json
from pathlib import Path

import transformers
from transformers import AutoTokenizer

from nexrl.models.tiny import build_char_tokenizer


def test_tokenizer_config_names_a_class_every_transformers_has(tmp_path: Path) -> None:
    build_char_tokenizer(tmp_path)
    config = json.loads((tmp_path / "tokenizer_config.json").read_text())
    # transformers 5 writes `TokenizersBackend`, a class transformers 4 lacks: 4.x then
    # refuses the folder as remote code
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert hasattr(transformers, config["tokenizer_class"])
    assert "backend" not in config


def test_the_written_tokenizer_keeps_spaces_and_newlines(tmp_path: Path) -> None:
    build_char_tokenizer(tmp_path)
    tok = AutoTokenizer.from_pretrained(tmp_path)
    ids = tok("hello world\n").input_ids
    assert tok.decode(ids, skip_special_tokens=True) == "hello world\n"
