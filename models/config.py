"""Model and data configuration: the `model.*` and `data.*` sections of a node config.

Owns the two pydantic schemas and their validation (with messages that say what to change).
Deliberately imports no torch, so `swarmnode --help` and config checks stay fast; the model
code (models/llama.py) and the corpus loader (models/corpus.py) interpret these fields.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class ModelConfig(BaseModel):
    """A tiny LLaMA-style decoder (byte vocabulary by default), or a local HF checkpoint."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    vocab_size: int = Field(256, gt=0)
    """Vocabulary size. 256 matches the byte-level tokenizer (models/tokenizer.py); change it
    only together with the tokenizer."""

    d_model: int = Field(64, gt=0)
    """Width of the residual stream. Must be divisible by n_heads."""

    n_layers: int = Field(2, gt=0)
    """Number of decoder blocks. Pipeline stages split these by index (layers=(start, end))."""

    n_heads: int = Field(4, gt=0)
    """Attention heads; head_dim = d_model // n_heads must be even (RoPE rotates pairs)."""

    ffn_mult: float = Field(4.0, gt=0)
    """SwiGLU width multiplier. Hidden size = round(ffn_mult * d_model * 2/3 / 8) * 8 (at least 8):
    the 2/3 keeps the 3-matrix SwiGLU at the parameter count of a 2-matrix MLP of width
    ffn_mult * d_model; the multiple of 8 keeps matmuls aligned. d_model 64 -> 168."""

    max_seq_len: int = Field(128, gt=0)
    """Longest sequence the model accepts; longer inputs raise a ValueError."""

    rope_theta: float = Field(10000.0, gt=0)
    """RoPE base frequency."""

    norm_eps: float = Field(1e-5, gt=0)
    """RMSNorm epsilon."""

    tie_embeddings: bool = True
    """Share the LM head weight with the token embedding. Only possible when one module holds
    both; a pipeline stage holding the head but not the embedding gets its own head weight,
    initialised identically to the embedding (the two then train apart)."""

    dtype: Literal["float32", "bfloat16"] = "float32"
    """Parameter dtype. Initialisation always happens in float32 and is then cast, so the
    bfloat16 model is the rounded float32 model. Losses are computed in float32."""

    hf_path: str | None = None
    """Local Hugging Face causal-LM folder (config.json + weights, e.g. save_pretrained output).
    When set, the HF adapter loads it and every architecture field above except dtype is
    ignored. Nothing is ever downloaded."""

    @property
    def head_dim(self) -> int:
        return self.d_model // self.n_heads

    @property
    def ffn_hidden(self) -> int:
        """SwiGLU hidden width (see ffn_mult)."""
        return max(8, int(round(self.ffn_mult * self.d_model * 2 / 3 / 8)) * 8)

    @model_validator(mode="after")
    def _heads_fit(self) -> "ModelConfig":
        if self.d_model % self.n_heads:
            ok = [h for h in range(1, self.d_model + 1)
                  if self.d_model % h == 0 and (self.d_model // h) % 2 == 0]
            raise ValueError(
                f"model.d_model={self.d_model} is not divisible by model.n_heads={self.n_heads}; "
                f"pick n_heads from {ok[:8]} or change d_model")
        if self.head_dim % 2:
            raise ValueError(
                f"head_dim = model.d_model // model.n_heads = {self.head_dim} is odd, but RoPE "
                "rotates pairs of channels; use fewer heads or a d_model that gives an even head_dim")
        return self


class DataConfig(BaseModel):
    """Where training text comes from and how it is cut into batches."""

    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: str | None = None
    """A file or folder of .txt/.md/.py/.jsonl files (folders are searched recursively).
    None = the embedded corpus: this Python's standard-library source files."""

    jsonl_field: str = "text"
    """For .jsonl files: the field of each line's JSON object that holds the text."""

    seq_len: int = Field(128, gt=0)
    """Tokens per training window (keep <= model.max_seq_len)."""

    batch_size: int = Field(8, gt=0)
    """Windows per batch, per worker."""

    val_fraction: float = Field(0.1, ge=0, lt=1)
    """Share of FILES (chosen by a SHA-256 hash of each file's relative path) held out for
    validation. With a single file, or when the hash puts every file on one side, the last
    val_fraction of the byte stream is held out instead."""

    max_train_bytes: int | None = Field(8_000_000, gt=0)
    """Cap on training bytes (files are taken in sorted order, the stream is cut at the cap).
    Keeps CPU demos fast; None = use everything."""

    max_val_bytes: int | None = Field(400_000, gt=0)
    """Cap on validation bytes; None = use everything."""
