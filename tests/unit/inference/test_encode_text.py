"""`encode_text`: the backend fast path gives the ids the tokenizer call gives, and is
skipped wherever the call does more than the backend's encode."""

from __future__ import annotations

from pathlib import Path

import pytest
from transformers import AutoTokenizer, BertTokenizer

from nexrl.inference.sampler import encode_text

TEXTS = ["", "abc>", "hello world", "  two  spaces ", "émoji 🙂 and ü", "a" * 300]


@pytest.fixture(scope="module")
def tok(tiny_model_path):
    return AutoTokenizer.from_pretrained(tiny_model_path)


def call_ids(tokenizer, text: str) -> list[int]:
    return list(tokenizer(text, add_special_tokens=True)["input_ids"])


@pytest.mark.parametrize("text", TEXTS)
def test_fast_path_gives_the_call_s_ids(tok, text) -> None:
    assert encode_text(tok, text) == call_ids(tok, text)


def test_special_token_text_is_one_token_as_in_the_call(tok) -> None:
    special = tok.all_special_tokens[0]
    ids = encode_text(tok, f"ab{special}cd")
    assert tok.convert_tokens_to_ids(special) in ids
    assert ids == call_ids(tok, f"ab{special}cd")


def test_truncation_set_on_the_backend_is_not_applied(tok) -> None:
    # the tokenizer call turns the backend's truncation off unless asked for it; a fast
    # path that ignored the setting would cut the text to 3 tokens
    fresh = AutoTokenizer.from_pretrained(tok.name_or_path)
    fresh.backend_tokenizer.enable_truncation(3)
    got = encode_text(fresh, "abcdefgh")
    assert got == call_ids(fresh, "abcdefgh") and len(got) > 3


def test_a_subclass_with_its_own_encode_is_called(tok) -> None:
    # the encode method a subclass overrides: `_batch_encode_plus` (transformers 4),
    # `_encode_plus` (5)
    name = "_batch_encode_plus" if hasattr(type(tok), "_batch_encode_plus") else "_encode_plus"

    def own(self, *args, **kwargs):
        out = getattr(super(Marked, self), name)(*args, **kwargs)
        ids = out["input_ids"]
        out["input_ids"] = [x + [0] for x in ids] if isinstance(ids[0], list) else ids + [0]
        return out

    Marked = type("Marked", (type(tok),), {name: own})

    marked = Marked.from_pretrained(tok.name_or_path)
    assert encode_text(marked, "abc") == encode_text(tok, "abc") + [0]


def test_a_slow_tokenizer_is_called(tmp_path: Path) -> None:
    vocab = tmp_path / "vocab.txt"
    vocab.write_text("\n".join(["[PAD]", "[UNK]", "[CLS]", "[SEP]", "hello", "world"]) + "\n")
    slow = BertTokenizer(str(vocab))
    assert encode_text(slow, "hello world") == [2, 4, 5, 3]


def test_split_special_tokens_is_honoured(tok) -> None:
    split = AutoTokenizer.from_pretrained(tok.name_or_path, split_special_tokens=True)
    text = f"ab{tok.all_special_tokens[0]}cd"
    first = encode_text(split, text)  # the backend has not been told yet: the call path
    assert first == call_ids(split, text) == encode_text(split, text)
    assert first != encode_text(tok, text)  # split: the special token is not one id
