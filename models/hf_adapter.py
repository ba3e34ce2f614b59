"""Hugging Face adapter: load a local causal-LM checkpoint behind the `Llama` forward contract.

Owns `model.hf_path` handling: `load_hf_causal_lm` opens a local folder (never the Hub; the
`local_files_only=True` of HF_HUB_OFFLINE) and wraps it so `forward(input_ids)` returns the
logits tensor, like `Llama(embed=True, head=True)`, and `forward_cached` / `new_cache` give the
left-padded, KV-cached forward that `models/generate.py` samples and re-scores with.
`load_hf_tokenizer` opens the folder's tokenizer the same way. `build_from_config` is the one place that
chooses between the built-in model and a checkpoint. transformers is imported lazily, so
importing `models` stays cheap for nodes that never use it. Pipeline splitting of HF models is
not supported: a checkpoint is always whole.
"""

from __future__ import annotations

import inspect
from pathlib import Path

import torch
from torch import Tensor, nn

from models.config import ModelConfig
from models.llama import build_model

_DTYPE_NAMES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class HFCausalLM(nn.Module):
    """A transformers causal LM whose forward(input_ids [B, T]) returns logits [B, T, vocab].

    Parameter names carry a ``model.`` prefix (``model.<HF name>``); the wrapped model is
    `self.model` (save it with `self.model.save_pretrained`).
    """

    def __init__(self, model: nn.Module, path: str):
        super().__init__()
        self.model = model
        self.path = path

    def forward(self, input_ids: Tensor) -> Tensor:
        return self.model(input_ids=input_ids, use_cache=False).logits

    @property
    def vocab_size(self) -> int:
        """Rows of the output layer (may exceed the tokenizer's length: padded vocabularies)."""
        return int(self.model.get_output_embeddings().weight.shape[0])

    @property
    def max_seq_len(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 1 << 30))

    def new_cache(self, batch: int, max_len: int, device=None) -> "HFCache":
        device = device if device is not None else next(self.parameters()).device
        return HFCache(batch, max_len, device)

    def forward_cached(self, x: Tensor, valid: Tensor | None = None,
                       cache: "HFCache | None" = None) -> Tensor:
        """Logits [B, T, vocab] for new tokens x [B, T] after what `cache` holds; rows may be
        left-padded (valid False): padding gets no position and is never attended to, as in
        `models.llama.Llama.forward_cached`. cache=None: one padded full forward (re-scoring)."""
        B, T = x.shape
        valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if valid is None else valid.bool()
        past = cache.key_mask[:, :cache.length] if cache is not None else valid[:, :0]
        keys = torch.cat([past, valid], dim=1)
        if keys.shape[1] > self.max_seq_len or (cache is not None and keys.shape[1] > cache.max_len):
            raise ValueError(f"sequence length {keys.shape[1]} > the checkpoint's max_position_embeddings="
                             f"{self.max_seq_len} or the KV cache length; shorten the prompt or the "
                             "completion cap")
        positions = (keys.long().cumsum(1) - 1).clamp(min=0)[:, -T:]
        kwargs = {"input_ids": x, "attention_mask": keys.long(), "position_ids": positions,
                  "use_cache": cache is not None}
        if cache is not None and cache.past is not None:
            kwargs[_cache_arg(self.model)] = cache.past
        out = self.model(**kwargs)
        if cache is not None:
            cache.past = out["cache"] if "cache" in out else out["past_key_values"]
            cache.key_mask[:, cache.length:cache.length + T] = valid
            cache.length += T
        return out["logits"]


class HFCache:
    """The transformers cache object of one sampling loop plus the key-validity mask so far."""

    def __init__(self, batch: int, max_len: int, device):
        self.past = None
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.max_len, self.length = max_len, 0


def _cache_arg(model: nn.Module) -> str:
    """The forward keyword for a KV cache: ``cache`` (transformers >= 5.x) or ``past_key_values``."""
    return "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"


def load_hf_causal_lm(path: str, dtype: torch.dtype | str | None = None) -> HFCausalLM:
    """Load `AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`, wrapped.

    dtype: a torch dtype or "float32"/"bfloat16"/"float16"; None keeps the checkpoint's dtype.
    The model is returned in the mode transformers leaves it (eval); call .train() to train.
    """
    folder = _folder(path)
    if not (folder / "config.json").is_file():
        raise FileNotFoundError(
            f"model.hf_path={path!r} has no config.json; it must be a save_pretrained folder "
            "(config.json + weights). Copy the checkpoint there first; nothing is downloaded")
    if isinstance(dtype, str):
        if dtype not in _DTYPE_NAMES:
            raise ValueError(f"dtype={dtype!r}; use one of {sorted(_DTYPE_NAMES)}")
        dtype = _DTYPE_NAMES[dtype]
    from transformers import AutoModelForCausalLM   # lazy: heavy import, only for hf_path users

    model = AutoModelForCausalLM.from_pretrained(
        str(folder), local_files_only=True, dtype=dtype if dtype is not None else "auto")
    return HFCausalLM(model, str(folder))


def _folder(path: str) -> Path:
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model.hf_path={path!r} is not a folder. Point model.hf_path at a local Hugging Face "
            "checkpoint folder (the output of save_pretrained: config.json + *.safetensors), or "
            "unset it to use the built-in model; swarmnode never downloads checkpoints")
    return folder


def load_hf_tokenizer(path: str):
    """`AutoTokenizer.from_pretrained(path, local_files_only=True)` for the checkpoint's folder
    (no remote code)."""
    folder = _folder(path)
    from transformers import AutoTokenizer   # lazy, as above

    return AutoTokenizer.from_pretrained(str(folder), local_files_only=True, trust_remote_code=False)


def build_from_config(cfg: ModelConfig, seed: int) -> nn.Module:
    """The built-in Llama initialised from `seed`, or (cfg.hf_path set) the local checkpoint.

    With hf_path the weights come from the checkpoint, so `seed` is unused and cfg.dtype is
    applied to the loaded weights.
    """
    if cfg.hf_path is None:
        return build_model(cfg, seed)
    return load_hf_causal_lm(cfg.hf_path, dtype=cfg.dtype)
