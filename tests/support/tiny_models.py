"""Tiny random-weight models with an in-process trained tokenizer, written as real model folders
(config.json, model.safetensors, tokenizer.json, ...) exactly as a user would have them."""

from __future__ import annotations

import json
from pathlib import Path

WORDS = (
    "the a cat dog bird sat ran jumped over under on in house tree garden little big red blue "
    "happy sad said hello world once upon time there was girl boy named lily tom played with "
    "ball sun moon sky water fish friend mom dad day night went to and but so they she he it"
).split()


def corpus(num_lines: int = 400) -> list[str]:
    """Deterministic pseudo-sentences to train the tokenizer on."""
    lines = []
    for i in range(num_lines):
        n = 5 + (i * 7) % 11
        lines.append(" ".join(WORDS[(i * 13 + j * 17) % len(WORDS)] for j in range(n)) + ".")
    return lines


def train_tokenizer(folder: Path, vocab_size: int = 320) -> int:
    """Train a byte-level BPE tokenizer with <s> prepended, save it with its config (and a
    chat template); return the vocab size."""
    from services.bench.random_model import train_tokenizer as train_bpe

    vocab_size = train_bpe(folder, corpus(), vocab_size)
    (folder / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": "<s>",
                "eos_token": "</s>",
                "unk_token": "<unk>",
                "add_bos_token": True,
                "model_max_length": 512,
                "chat_template": (
                    "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                    "{% if add_generation_prompt %}<s>assistant:{% endif %}"
                ),
            }
        )
    )
    return vocab_size


def make_tiny_llama(
    folder: Path, seed: int = 0, num_layers: int = 2, hidden_size: int = 64
) -> Path:
    """A random Llama (GQA, 4 heads / 2 kv heads: head_dim hidden_size / 4) with a trained
    tokenizer."""
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    vocab_size = train_tokenizer(folder)
    config = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=2 * hidden_size,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        bos_token_id=1,
        eos_token_id=2,
        # a wide init spreads the logits, so greedy argmax has no near-ties between runs
        initializer_range=0.2,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    return folder


# A Qwen-style (Hermes) tool-calling chat template: tools in a system turn, calls in
# <tool_call> blocks, tool results in <tool_response> blocks.
HERMES_TEMPLATE = (
    "{%- if tools %}<|im_start|>system\n<tools>\n{% for tool in tools %}{{ tool | tojson }}\n"
    "{% endfor %}</tools>\nCall a function inside <tool_call></tool_call> tags.<|im_end|>\n"
    "{% endif %}"
    "{%- for m in messages %}"
    "{%- if m.role == 'tool' %}<|im_start|>user\n<tool_response>\n{{ m.content }}\n"
    "</tool_response><|im_end|>\n"
    "{%- elif m.tool_calls %}<|im_start|>assistant\n{% for c in m.tool_calls %}<tool_call>\n"
    '{{ {"name": c.function.name, "arguments": c.function.arguments} | tojson }}\n'
    "</tool_call>{% endfor %}<|im_end|>\n"
    "{%- else %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)
TOOL_CALL_TEXT = '\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
TEXT_ANSWER = " it is sunny in Paris."


def make_tool_caller(folder: Path) -> Path:
    """A Llama whose greedy answer is fixed by the prompt's last token, with the Hermes template:
    after the assistant turn it writes `<tool_call>{get_weather(city=Paris)}</tool_call>`; an
    assistant message continued after "Sure" goes on with plain text. Every other token is
    followed by EOS; where a grammar rules EOS out, closing quotes and brackets are preferred,
    so constrained greedy output stays short.

    Its one layer computes nothing (zero attention and MLP), so the final hidden state is the
    last token's embedding: one-hot embeddings and an lm_head row per successor make the
    greedy next token a function of the last token alone."""
    import torch
    from tokenizers import Tokenizer
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    folder.mkdir(parents=True, exist_ok=True)
    train_tokenizer(folder)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    turn, call_open, call_close = "<|im_start|>assistant\n", "<tool_call>", "</tool_call>"
    tokenizer.add_tokens(
        [
            turn,
            "<|im_start|>",
            "<|im_end|>",
            call_open,
            call_close,
            TOOL_CALL_TEXT,
            "Sure",
            TEXT_ANSWER,
        ]
    )
    tokenizer.save(str(folder / "tokenizer.json"))
    config_file = folder / "tokenizer_config.json"
    config = json.loads(config_file.read_text())
    config["chat_template"] = HERMES_TEMPLATE
    config_file.write_text(json.dumps(config))
    ids = {
        text: tokenizer.token_to_id(text)
        for text in (turn, call_open, TOOL_CALL_TEXT, call_close, "Sure", TEXT_ANSWER)
    }
    vocab_size = tokenizer.get_vocab_size()
    hidden = 64 * ((vocab_size + 63) // 64)
    successors = {
        ids[turn]: ids[call_open],
        ids[call_open]: ids[TOOL_CALL_TEXT],
        ids[TOOL_CALL_TEXT]: ids[call_close],
        ids["Sure"]: ids[TEXT_ANSWER],
    }
    llama = LlamaConfig(
        vocab_size=vocab_size,
        hidden_size=hidden,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=hidden // 64,
        num_key_value_heads=hidden // 64,
        max_position_embeddings=2048,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(llama).to(torch.float32).eval()
    with torch.no_grad():
        for parameter in model.model.layers.parameters():
            if parameter.dim() == 2:
                parameter.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab_size, hidden))
        head = torch.zeros(vocab_size, hidden)
        # a slight preference for closing quotes, objects and arrays: where a grammar leaves
        # the choice to the model, its greedy output ends rather than grows
        for closing in ('"', "}", "]"):
            head[tokenizer.token_to_id(closing)] = 0.02
        for token in range(vocab_size):
            head[successors.get(token, 2), token] = 1.0  # EOS (2) unless a successor is set
        model.lm_head.weight.copy_(head)
    model.save_pretrained(folder, safe_serialization=True)
    GenerationConfig(bos_token_id=1, eos_token_id=2).save_pretrained(folder)
    return folder
