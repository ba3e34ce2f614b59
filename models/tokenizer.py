"""Byte-level tokenizer: token ids are the UTF-8 bytes of the text (vocabulary 256).

Owns text <-> ids for the embedded default model. Needs no files and no network, so every
node tokenizes identically. A Hugging Face checkpoint (model.hf_path) brings its own tokenizer;
that is the HF adapter's caller's business, not this module's.
"""

from __future__ import annotations


class ByteTokenizer:
    vocab_size = 256

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def decode(self, ids) -> str:
        """Ids outside 0..255 raise ValueError; invalid UTF-8 sequences become U+FFFD."""
        return bytes(int(i) for i in ids).decode("utf-8", errors="replace")
