"""Stage-splittable LLaMA-style decoder, its deterministic initialisation, and the LM loss.

Owns the architecture (pre-norm blocks: RMSNorm -> causal self-attention with RoPE -> RMSNorm ->
SwiGLU FFN; final RMSNorm; LM head) and how a pipeline stage is cut from it. Knows nothing about
the network, optimizers or data: pipeline/ moves hidden states between stages, optimizers/ updates
the parameters, models/corpus.py feeds tokens.

A stage is `Llama(cfg, layers=(a, b), embed=..., head=...)`. Parameter names are the whole
model's names (``embed.weight``, ``layers.3.attn.wq.weight``, ``norm.weight``, ``head.weight``),
so a stage's state_dict is a subset of the whole model's, and `build_model` initialises every
tensor from (seed, parameter name) alone: stage (a, b) built from seed s holds exactly the whole
model's blocks a..b-1 from seed s, whatever the global RNG state.

Tied embeddings: when one module holds both embedding and head (and cfg.tie_embeddings), the
head *is* the embedding parameter; its state_dict lists it under both ``embed.weight`` and
``head.weight`` (same storage: clone before safetensors.save_file). A stage holding the head
but not the embedding gets its own ``head.weight`` initialised identically to the embedding.
"""

from __future__ import annotations

import hashlib
import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from models.config import ModelConfig

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
INIT_STD = 0.02


def torch_dtype(cfg: ModelConfig) -> torch.dtype:
    return _DTYPES[cfg.dtype]


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed.type_as(x) * self.weight


def rope_tables(seq_len: int, head_dim: int, theta: float, device) -> tuple[Tensor, Tensor]:
    """cos/sin tables [T, head_dim] in fp32 for the rotate-half RoPE convention."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32)
                               / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Rotate x [B, H, T, hd] by position; computed in fp32, returned in x's dtype."""
    x32 = x.float()
    half = x32.shape[-1] // 2
    rotated = torch.cat([-x32[..., half:], x32[..., :half]], dim=-1)
    return (x32 * cos + rotated * sin).type_as(x)


class Attention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        d = cfg.d_model
        self.wq = nn.Linear(d, d, bias=False)
        self.wk = nn.Linear(d, d, bias=False)
        self.wv = nn.Linear(d, d, bias=False)
        self.wo = nn.Linear(d, d, bias=False)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        B, T, d = x.shape
        q, k, v = (w(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
                   for w in (self.wq, self.wk, self.wv))
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(out.transpose(1, 2).reshape(B, T, d))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        h = cfg.ffn_hidden
        self.w1 = nn.Linear(cfg.d_model, h, bias=False)
        self.w3 = nn.Linear(cfg.d_model, h, bias=False)
        self.w2 = nn.Linear(h, cfg.d_model, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.attn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.attn = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.d_model, cfg.norm_eps)
        self.ffn = FeedForward(cfg)

    def forward(self, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        return x + self.ffn(self.ffn_norm(x))


def _param_seed(seed: int, key: str) -> int:
    digest = hashlib.sha256(f"swarmnode-init:{seed}:{key}".encode()).digest()
    return int.from_bytes(digest[:8], "little") & (2**63 - 1)


class Llama(nn.Module):
    """The whole model (defaults) or one pipeline stage of it.

    layers=(start, end) builds only blocks [start, end) (None = all); embed=False makes forward
    take hidden states [B, T, d_model] instead of token ids [B, T]; head=False makes forward
    return hidden states [B, T, d_model] (before the final norm) instead of logits [B, T, vocab].
    Weights are initialised from `seed` (see module docstring); prefer `build_model`.
    """

    def __init__(self, cfg: ModelConfig, layers: tuple[int, int] | None = None,
                 embed: bool = True, head: bool = True, *, seed: int = 0):
        super().__init__()
        start, end = (0, cfg.n_layers) if layers is None else (int(layers[0]), int(layers[1]))
        if not 0 <= start <= end <= cfg.n_layers:
            raise ValueError(f"layers={layers} is not a range within [0, {cfg.n_layers}] "
                             f"(model.n_layers={cfg.n_layers}); pass (start, end) with "
                             "0 <= start <= end <= n_layers")
        self.cfg, self.layer_range = cfg, (start, end)
        self.has_embed, self.has_head = embed, head
        # torch's default init draws from the global RNG: restore it, then re-init below.
        # (Not the meta device: its first use costs ~2 s of imports per process.)
        with torch.random.fork_rng(devices=[]):
            self.embed = nn.Embedding(cfg.vocab_size, cfg.d_model) if embed else None
            self.layers = nn.ModuleDict({str(i): Block(cfg) for i in range(start, end)})
            self.norm = RMSNorm(cfg.d_model, cfg.norm_eps) if head else None
            self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False) if head else None
        self.tied = bool(embed and head and cfg.tie_embeddings)
        if self.tied:
            self.head.weight = self.embed.weight
        self.reset_parameters(seed)
        self.to(torch_dtype(cfg))

    @torch.no_grad()
    def reset_parameters(self, seed: int) -> None:
        """Initialise every parameter from (seed, its name), independent of other parameters."""
        depth_std = INIT_STD / math.sqrt(2 * self.cfg.n_layers)
        for name, p in self.named_parameters():    # tied head is yielded once, as embed.weight
            if name.endswith("norm.weight"):
                p.fill_(1.0)
                continue
            key, std = name, INIT_STD
            if name == "head.weight" and self.cfg.tie_embeddings:
                key = "embed.weight"          # untied stage head starts equal to the embedding
            elif name.endswith(("attn.wo.weight", "ffn.w2.weight")):
                std = depth_std               # residual-branch outputs, GPT-2 style
            gen = torch.Generator(device="cpu").manual_seed(_param_seed(seed, key))
            p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float32) * std)

    def forward(self, x: Tensor) -> Tensor:
        T = x.shape[1]
        if T > self.cfg.max_seq_len:
            raise ValueError(f"sequence length {T} > model.max_seq_len={self.cfg.max_seq_len}; "
                             "shorten data.seq_len or raise model.max_seq_len")
        if self.embed is not None:
            h = self.embed(x)
        else:
            h = x.to(self.param_dtype)
        cos, sin = rope_tables(T, self.cfg.head_dim, self.cfg.rope_theta, h.device)
        for block in self.layers.values():
            h = block(h, cos, sin)
        if self.head is None:
            return h
        return self.head(self.norm(h))

    @property
    def param_dtype(self) -> torch.dtype:
        p = next(self.parameters(), None)
        return torch_dtype(self.cfg) if p is None else p.dtype

    def num_params(self) -> int:
        return sum(p.numel() for p in self.parameters())


def build_model(cfg: ModelConfig, seed: int, layers: tuple[int, int] | None = None,
                embed: bool = True, head: bool = True) -> Llama:
    """Deterministically initialised model or stage (same seed -> bitwise identical tensors)."""
    return Llama(cfg, layers=layers, embed=embed, head=head, seed=seed)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in fp32. `targets` are already shifted (y = x[1:])."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))
