"""The GGUF-converted SmolLM2 tokenizer decodes, templates and stops the same in
transformers 4 and 5 (5 rebuilt a `LlamaTokenizer` and decoded byte-level BPE as `Ġ`/`Ċ`)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from nexrl.models.sources import FORMAT_FILE, GGUF_FORMAT, _repair

pytestmark = pytest.mark.slow

TEXT = "Hello\n  world, 2+2=4.\n\nÉté — ok!"


def check_tokenizer(path: str) -> None:
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path)
    ids = tok(TEXT, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == TEXT  # no byte-level symbols, no space clean-up
    assert tok.eos_token == "<|im_end|>" and tok.pad_token_id == tok.eos_token_id == 2
    chat = tok.apply_chat_template(
        [{"role": "user", "content": "What is 2+2?"}], add_generation_prompt=True, return_dict=False
    )
    assert isinstance(chat, list) and all(isinstance(i, int) for i in chat)
    rendered = tok.decode(chat)
    assert rendered.startswith("<|im_start|>system\n")
    assert rendered.endswith("<|im_start|>user\nWhat is 2+2?<|im_end|>\n<|im_start|>assistant\n")


def test_converted_tokenizer_round_trips(smollm2_dir):
    config = json.loads((Path(smollm2_dir) / "tokenizer_config.json").read_text())
    assert config["tokenizer_class"] == "PreTrainedTokenizerFast"
    assert json.loads((Path(smollm2_dir) / FORMAT_FILE).read_text())["format"] == GGUF_FORMAT
    check_tokenizer(smollm2_dir)


def test_a_directory_converted_before_the_fix_is_repaired(smollm2_dir, tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "config.json"):
        if (Path(smollm2_dir) / name).exists():
            shutil.copy(Path(smollm2_dir) / name, old / name)
    config = json.loads((old / "tokenizer_config.json").read_text())
    config["tokenizer_class"] = "LlamaTokenizer"  # what transformers' GGUF conversion writes
    (old / "tokenizer_config.json").write_text(json.dumps(config))
    _repair(old)
    assert json.loads((old / FORMAT_FILE).read_text())["format"] == GGUF_FORMAT
    check_tokenizer(str(old))
