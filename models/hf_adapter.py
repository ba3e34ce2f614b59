"""Hugging Face adapter: load a local causal-LM checkpoint behind the `Llama` forward contract.

Owns `model.hf_path` handling: `load_hf_causal_lm` opens a local folder (never the Hub; the
`local_files_only=True` of HF_HUB_OFFLINE) and wraps it so `forward(input_ids)` returns the
logits tensor, like `Llama(embed=True, head=True)`. `build_from_config` is the one place that
chooses between the built-in model and a checkpoint. transformers is imported lazily, so
importing `models` stays cheap for nodes that never use it. Pipeline splitting of HF models is
not supported: a checkpoint is always whole.
"""

from __future__ import annotations

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


def load_hf_causal_lm(path: str, dtype: torch.dtype | str | None = None) -> HFCausalLM:
    """Load `AutoModelForCausalLM.from_pretrained(path, local_files_only=True)`, wrapped.

    dtype: a torch dtype or "float32"/"bfloat16"/"float16"; None keeps the checkpoint's dtype.
    The model is returned in the mode transformers leaves it (eval); call .train() to train.
    """
    folder = Path(path).expanduser()
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model.hf_path={path!r} is not a folder. Point model.hf_path at a local Hugging Face "
            "checkpoint folder (the output of save_pretrained: config.json + *.safetensors), or "
            "unset it to use the built-in model; swarmnode never downloads checkpoints")
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


def build_from_config(cfg: ModelConfig, seed: int) -> nn.Module:
    """The built-in Llama initialised from `seed`, or (cfg.hf_path set) the local checkpoint.

    With hf_path the weights come from the checkpoint, so `seed` is unused and cfg.dtype is
    applied to the loaded weights.
    """
    if cfg.hf_path is None:
        return build_model(cfg, seed)
    return load_hf_causal_lm(cfg.hf_path, dtype=cfg.dtype)
