"""An RL policy: a causal LM with its tokenizer, and the hashes that tell peers they share one.

Owns what a learner needs from "a model" besides its weights: text <-> token ids, the stop
token, the range of valid token ids (the output vocabulary), the longest sequence, the
``tokenizer_hash`` / ``chat_template_hash`` peers compare before trusting each other's token ids
(a mismatch is refused, never re-tokenised), and a ``model_id`` (architecture + initial weights).
Sampling and re-scoring are `models/generate.py`'s; rewards, the swarm and the loss are not here.

Two kinds, chosen by ``model.hf_path``:

- ``embedded``: the `models/llama.py` decoder at any size with the byte tokenizer. The tokenizer
  hash does not depend on the size, so peers of different sizes (heterogeneous) share it.
- ``hf``: a local Hugging Face checkpoint folder and its own tokenizer (never downloaded, no
  remote code). The hash covers the vocabulary, merges, normalisation, added and special tokens.

    policy = build_policy(ModelConfig(d_model=48, n_layers=1), seed=0)
    ids = policy.encode("3+4:"); text = policy.decode(ids)
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

from torch import nn

from models.config import ModelConfig
from models.hf_adapter import load_hf_causal_lm, load_hf_tokenizer
from models.llama import build_model
from models.tokenizer import ByteTokenizer

BYTE_TOKENIZER_HASH = hashlib.sha256(b"swarmnode/byte-tokenizer/v1:256").hexdigest()[:16]
"""Hash of the embedded byte tokenizer: the same for every size of the embedded decoder."""

_HASH_BYTES = 1 << 20   # bytes hashed at each end of a weight file for the model_id


@dataclass
class Policy:
    model: nn.Module
    encode: Callable[[str], list[int]]
    decode: Callable[[Sequence[int]], str]
    vocab_size: int            # valid token ids are [0, vocab_size): the output layer's rows
    stop_id: int               # sampling ends a completion after this token
    max_seq_len: int
    tokenizer_hash: str
    chat_template_hash: str
    model_id: str              # hash of the architecture and the initial weights
    kind: str                  # "embedded" or "hf"

    @property
    def n_params(self) -> int:
        return sum(p.numel() for p in self.model.parameters())


def _h(raw: bytes) -> str:
    return hashlib.sha256(raw).hexdigest()[:16]


def tokenizer_hash(tok) -> str:
    """Canonical hash of a Hugging Face tokenizer: vocabulary and merges, normaliser and
    pre-tokeniser, added tokens, special token ids (fast tokenizers: the backend's JSON; slow
    ones: the vocabulary)."""
    backend = getattr(tok, "backend_tokenizer", None)
    if backend is not None:
        spec = json.loads(backend.to_str())
        body = {k: spec.get(k) for k in ("model", "added_tokens", "normalizer", "pre_tokenizer")}
    else:
        body = {"vocab": sorted(tok.get_vocab().items())}
    body["special_ids"] = sorted(int(i) for i in tok.all_special_ids)
    return _h(json.dumps(body, sort_keys=True, default=str).encode())


def _checkpoint_id(folder: Path) -> str:
    """config.json plus, per weight file, its size and the hashes of its first and last MiB."""
    h = hashlib.sha256((folder / "config.json").read_bytes())
    for f in sorted(folder.glob("*.safetensors")) + sorted(folder.glob("*.bin")):
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_HASH_BYTES))
            fh.seek(max(0, size - _HASH_BYTES))
            h.update(fh.read(_HASH_BYTES))
    return h.hexdigest()[:16]


def _stop_id(encode: Callable[[str], list[int]], stop_text: str, eos: int | None) -> int:
    ids = encode(stop_text)
    if len(ids) == 1:
        return ids[0]
    if eos is not None:
        return int(eos)
    raise ValueError(f"the tokenizer splits the stop text {stop_text!r} into {len(ids)} tokens and has "
                     "no eos token; use a tokenizer with an eos token")


def build_policy(cfg: ModelConfig, seed: int, stop_text: str = "\n") -> Policy:
    """The embedded decoder initialised from ``seed`` (byte tokenizer), or the checkpoint at
    ``cfg.hf_path`` with its tokenizer (``seed`` unused). Completions stop after ``stop_text``
    when it is one token, else after the tokenizer's eos token."""
    if cfg.hf_path is None:
        if cfg.vocab_size != ByteTokenizer.vocab_size:
            raise ValueError(f"model.vocab_size={cfg.vocab_size}: the embedded decoder uses the byte "
                             f"tokenizer, set model.vocab_size={ByteTokenizer.vocab_size} (or model.hf_path "
                             "for a checkpoint with its own tokenizer)")
        tok = ByteTokenizer()
        model = build_model(cfg, seed)
        return Policy(model, tok.encode, tok.decode, tok.vocab_size, _stop_id(tok.encode, stop_text, None),
                      cfg.max_seq_len, BYTE_TOKENIZER_HASH, _h(b""),
                      _h(f"{cfg.model_dump_json()}|{seed}".encode()), "embedded")
    model = load_hf_causal_lm(cfg.hf_path, dtype=cfg.dtype)
    tok = load_hf_tokenizer(cfg.hf_path)

    def encode(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    def decode(ids: Sequence[int]) -> str:
        return tok.decode([int(i) for i in ids], skip_special_tokens=False)

    template = getattr(tok, "chat_template", None) or ""
    return Policy(model, encode, decode, model.vocab_size, _stop_id(encode, stop_text, tok.eos_token_id),
                  model.max_seq_len, tokenizer_hash(tok), _h(str(template).encode()),
                  _checkpoint_id(Path(cfg.hf_path).expanduser()), "hf")
