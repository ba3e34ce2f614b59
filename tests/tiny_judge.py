"""A tiny random Llama judge checkpoint for tests: character-level word tokenizer, a chat
template, saved to a local folder (no download). Its verdicts are noise; tests use it for the
judge's plumbing (prompt, generation, parsing), never for quality."""

from __future__ import annotations

import re
from pathlib import Path

import torch

CHARS = "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789+=>,:.?()[]<>!\n "
TEMPLATE = ("{% for m in messages %}<|{{ m['role'][:6] }}|>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<|asst|>{% endif %}")


def save_tiny_judge(folder: Path, *, extra_words: tuple[str, ...] = (), extra_chars: str = "",
                    max_positions: int = 2048) -> Path:
    """Write the tokenizer and model to `folder`; `extra_words` are single tokens (e.g. " SAFE")."""
    import tokenizers
    import transformers

    words = ["<pad>", "<s>", "</s>", "<unk>", *extra_words, *CHARS, *extra_chars, "<|user|>", "<|system|>",
             "<|asst|>"]
    vocab = {w: i for i, w in enumerate(dict.fromkeys(words))}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    specials = "".join(f"{re.escape(w)}|" for w in extra_words)
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(pattern=tokenizers.Regex(specials + r"<\|[a-z]+\|>|."),
                                                       behavior="isolated")
    tk.decoder = tokenizers.decoders.Fuse()
    tok = transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                                               eos_token="</s>", unk_token="<unk>")
    tok.chat_template = TEMPLATE
    tok.save_pretrained(folder)
    cfg = transformers.LlamaConfig(vocab_size=len(vocab), hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                   num_attention_heads=2, num_key_value_heads=1,
                                   max_position_embeddings=max_positions, bos_token_id=1, eos_token_id=2,
                                   pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder
