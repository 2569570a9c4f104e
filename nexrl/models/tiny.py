"""The embedded default model: a tiny Qwen2 with a character-level tokenizer.

Nothing is downloaded. The model is built from `Qwen2Config` with a fixed seed,
saved in Hugging Face format under the nexrl cache, and from then on loaded
with `from_pretrained` like any other checkpoint. One character is one token,
so a rollout's token ids map one-to-one onto its text.
"""

from __future__ import annotations

import json
import os
import string
from pathlib import Path

from filelock import FileLock

PAD, BOS, EOS, UNK = "<pad>", "<s>", "</s>", "<unk>"
# A small lowercase alphabet: every extra token is a wrong answer the policy must
# learn to avoid, so a small vocabulary makes the embedded task learn faster.
CHARS = string.ascii_lowercase + string.digits + " .,:;!?'=+-*/<>()"
SPECIALS = (PAD, BOS, EOS, UNK)
VOCAB_SIZE = len(SPECIALS) + len(CHARS) + 1  # + newline
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}assistant: {% endif %}"
)


def cache_dir() -> Path:
    return Path(os.environ.get("NEXRL_HOME", Path.home() / ".cache" / "nexrl"))


def build_char_tokenizer(path: str | os.PathLike):
    """Write a character-level `PreTrainedTokenizerFast` to `path` and return it."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers.processors import TemplateProcessing
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([*SPECIALS, *CHARS, "\n"])}
    assert len(vocab) == VOCAB_SIZE
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    core.normalizer = normalizers.Lowercase()
    core.pre_tokenizer = pre_tokenizers.Split(Regex(r"[\s\S]"), behavior="isolated")
    core.decoder = decoders.Fuse()
    # A leading BOS keeps the first prompt character out of the attention-sink
    # position; without it the policy learns "repeat the first letter".
    core.post_processor = TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A $B", special_tokens=[(BOS, vocab[BOS])]
    )
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, pad_token=PAD, bos_token=BOS, eos_token=EOS, unk_token=UNK
    )
    tok.chat_template = CHAT_TEMPLATE
    tok.save_pretrained(str(path))
    # transformers 5 loads every qwen2 tokenizer as `Qwen2Tokenizer` (rebuilt from the
    # vocabulary: this one then drops spaces and newlines) unless the config has an
    # `auto_map`; naming the class there makes 4.x and 5.x load this file as it is.
    # transformers 5 writes its own class name (`TokenizersBackend`), which 4.x does
    # not know (it then asks for remote code): the cache is shared by both, so the
    # file names the class both have.
    config_file = Path(path) / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config.pop("backend", None)
    config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config["auto_map"] = {"AutoTokenizer": [None, "PreTrainedTokenizerFast"]}
    config_file.write_text(json.dumps(config, indent=2) + "\n")
    return tok


def build_tiny_qwen2(
    path: str | os.PathLike,
    hidden_size: int = 128,
    num_layers: int = 3,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 256,
    max_positions: int = 256,
    seed: int = 0,
) -> Path:
    """Build (once) a randomly initialised Qwen2 with the char tokenizer at `path`."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with FileLock(str(path) + ".lock"):
        if (path / "config.json").exists():
            return path
        tok = build_char_tokenizer(path)
        config = Qwen2Config(
            vocab_size=len(tok),
            hidden_size=hidden_size,
            intermediate_size=intermediate_size,
            num_hidden_layers=num_layers,
            num_attention_heads=num_heads,
            num_key_value_heads=num_kv_heads,
            max_position_embeddings=max_positions,
            tie_word_embeddings=True,
            bos_token_id=tok.bos_token_id,
            eos_token_id=tok.eos_token_id,
            pad_token_id=tok.pad_token_id,
            dtype="float32",  # `torch_dtype` before transformers 4.56
        )
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config)
        if model.generation_config is not None:  # a causal LM always has one
            model.generation_config.pad_token_id = tok.pad_token_id
        model.save_pretrained(str(path), safe_serialization=True)
    return path


# Bump when the tokenizer or the architecture changes, so that a stale cache is not reused.
DEFAULT_MODEL_VERSION = 4  # 4: a class name transformers 4 and 5 both know


def default_model_path() -> Path:
    """Path of the embedded default model, built on first use."""
    return build_tiny_qwen2(cache_dir() / "models" / f"tiny-qwen2-char-v{DEFAULT_MODEL_VERSION}")
