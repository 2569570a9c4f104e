"""Test assets: ChatML tokenizers built locally, and a scripted model.

`build_chatml_tokenizer` trains a small byte-level BPE (real merges, so token
boundaries are not trivial) and gives it SmolLM2's ChatML template, or a
ChatML template that renders tools the Hermes / Qwen2.5 way. `build_scripted_model`
saves a Qwen2 checkpoint whose greedy output is a fixed script: the residual
stream carries only the current token (attention and MLP outputs are zero) and
the LM head maps each script token to the next, so a real engine and server
produce exactly the text a test needs (a tool call, a truncated one).
"""

from __future__ import annotations

from pathlib import Path

IM_START, IM_END = "<|im_start|>", "<|im_end|>"

# SmolLM2-135M-Instruct's format (ChatML with a default system prompt).
SMOLLM2_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\\nYou are a helpful AI assistant named SmolLM, trained by Hugging "
    "Face<|im_end|>\\n' }}{% endif %}{{'<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n'}}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}"
)

# ChatML with tools rendered as Qwen2.5 does: schemas in the system turn, calls in
# <tool_call> tags, tool results as user turns in <tool_response> tags.
TOOLS_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n"
    "{% if messages[0].role == 'system' %}{{ messages[0].content }}\n\n{% endif %}"
    "# Tools\n<tools>\n{% for t in tools %}{{ t | tojson }}\n{% endfor %}</tools>\n"
    'Call a tool with <tool_call>{"name": ..., "arguments": ...}</tool_call><|im_end|>\n'
    "{% elif messages[0].role == 'system' %}"
    "<|im_start|>system\n{{ messages[0].content }}<|im_end|>\n{% endif %}"
    "{% for m in messages %}{% if not (loop.first and m.role == 'system') %}"
    "{% if m.role == 'tool' %}"
    "<|im_start|>user\n<tool_response>\n{{ m.content }}\n</tool_response><|im_end|>\n"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content or '' }}"
    "{% for c in m.tool_calls or [] %}<tool_call>{{ c.function | tojson }}</tool_call>"
    "{% endfor %}<|im_end|>\n{% endif %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

# Drops <think>...</think> from every earlier assistant turn, as reasoning templates do.
THINKING_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m.role }}\n"
    "{% if m.role == 'assistant' and not loop.last %}"
    "{{ m.content.split('</think>')[-1] }}{% else %}{{ m.content }}{% endif %}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)

_CORPUS = [
    "You are a helpful assistant. What is two plus three? The answer is five.",
    "<tool_call> arguments name add the tool result is 42. Let me think about it.",
    "system user assistant tool response calculator numbers 0123456789 {} [] : , \" ' .",
] * 20


def build_chatml_tokenizer(template: str = SMOLLM2_TEMPLATE, extra_tokens: list[str] = ()):
    """A byte-level BPE tokenizer with ChatML specials (EOS = <|im_end|>)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE())
    core.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    core.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=400,
        special_tokens=["<|endoftext|>", IM_START, IM_END],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    core.train_from_iterator(_CORPUS, trainer)
    tok = PreTrainedTokenizerFast(
        tokenizer_object=core, eos_token=IM_END, pad_token="<|endoftext|>", bos_token=None
    )
    tok.add_special_tokens({"additional_special_tokens": [IM_START, IM_END]})
    if extra_tokens:
        tok.add_tokens(list(extra_tokens))  # normal (not special) tokens: decoded as text
    tok.chat_template = template
    return tok


def build_scripted_model(path: str | Path, script: list[str], seed: int = 0) -> Path:
    """Save tokenizer + Qwen2 at `path` whose greedy reply to any chat is `script` + EOS.

    Each script entry becomes one added token; the chain starts at the last token of the
    generation prompt (`<|im_start|>assistant\\n`).
    """
    import torch
    from transformers import GenerationConfig, Qwen2Config, Qwen2ForCausalLM

    path = Path(path)
    tok = build_chatml_tokenizer(TOOLS_TEMPLATE, extra_tokens=script)
    hello = [{"role": "user", "content": "hi"}]
    prompt = tok.apply_chat_template(hello, add_generation_prompt=True, return_dict=False)
    chain = [prompt[-1], *(tok.convert_tokens_to_ids(s) for s in script), tok.eos_token_id]
    vocab = len(tok)
    hidden = -(-vocab // 64) * 64
    config = Qwen2Config(
        vocab_size=vocab,
        hidden_size=hidden,
        num_hidden_layers=1,
        num_attention_heads=4,
        num_key_value_heads=2,
        intermediate_size=64,
        max_position_embeddings=512,
        tie_word_embeddings=False,
        eos_token_id=tok.eos_token_id,
        bos_token_id=None,
        pad_token_id=tok.pad_token_id,
    )
    torch.manual_seed(seed)
    model = Qwen2ForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))  # one-hot residual
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        head = torch.zeros(vocab, hidden)
        for cur, nxt in zip(chain, chain[1:], strict=False):
            head[nxt, cur] = 1.0
        model.lm_head.weight.copy_(head)
    model.generation_config = GenerationConfig(eos_token_id=tok.eos_token_id)
    model.save_pretrained(str(path))
    tok.save_pretrained(str(path))
    return path
