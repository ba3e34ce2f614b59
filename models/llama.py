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

    def forward_cached(self, x: Tensor, valid: Tensor | None = None,
                       cache: "KVCache | None" = None) -> Tensor:
        """KV-cached / padded forward for sampling and re-scoring; see `_forward_cached`."""
        return _forward_cached(self, x, valid, cache)

    def new_cache(self, batch: int, max_len: int, device=None) -> "KVCache":
        """An empty KV cache for `forward_cached` (sampling)."""
        return KVCache(self, batch, max_len, device=device)


def build_model(cfg: ModelConfig, seed: int, layers: tuple[int, int] | None = None,
                embed: bool = True, head: bool = True) -> Llama:
    """Deterministically initialised model or stage (same seed -> bitwise identical tensors)."""
    return Llama(cfg, layers=layers, embed=embed, head=head, seed=seed)


def lm_loss(logits: Tensor, targets: Tensor) -> Tensor:
    """Mean next-token cross-entropy in fp32. `targets` are already shifted (y = x[1:])."""
    return F.cross_entropy(logits.float().reshape(-1, logits.shape[-1]), targets.reshape(-1))


# --- KV-cached incremental decoding (additive: the training forward above is unchanged) --------
#
# `Llama.forward_cached` runs the same blocks on a chunk of new tokens with explicit per-row
# positions and a key-validity mask, appending keys/values to a `KVCache`. Rows may be
# left-padded (padding keys are masked out, positions count only real tokens), so a batch of
# prompts of different lengths decodes together. With cache=None it is a padded full forward
# (used for re-scoring). Full models only (embed and head on one module).


class KVCache:
    """Per-layer key/value buffers [B, H, max_len, head_dim] plus the key-validity mask so far."""

    def __init__(self, model: "Llama", batch: int, max_len: int, device=None, dtype=None):
        cfg = model.cfg
        device = device if device is not None else next(model.parameters()).device
        dtype = dtype if dtype is not None else model.param_dtype
        shape = (batch, cfg.n_heads, max_len, cfg.head_dim)
        self.k = {name: torch.zeros(shape, device=device, dtype=dtype) for name in model.layers}
        self.v = {name: torch.zeros(shape, device=device, dtype=dtype) for name in model.layers}
        self.key_mask = torch.zeros(batch, max_len, dtype=torch.bool, device=device)
        self.max_len, self.length = max_len, 0


def _rope_at(positions: Tensor, head_dim: int, theta: float) -> tuple[Tensor, Tensor]:
    """cos/sin [B, 1, T, head_dim] for integer positions [B, T] (same formula as rope_tables)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device,
                                            dtype=torch.float32) / head_dim)
    freqs = positions.to(torch.float32)[..., None] * inv_freq
    emb = torch.cat([freqs, freqs], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def _attn_cached(attn: Attention, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor,
                 cache: KVCache | None, name: str) -> Tensor:
    B, T, d = x.shape
    q, k, v = (w(x).view(B, T, attn.n_heads, attn.head_dim).transpose(1, 2)
               for w in (attn.wq, attn.wk, attn.wv))
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    if cache is not None:
        s = cache.length
        cache.k[name][:, :, s:s + T] = k
        cache.v[name][:, :, s:s + T] = v
        k, v = cache.k[name][:, :, :s + T], cache.v[name][:, :, :s + T]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    return attn.wo(out.transpose(1, 2).reshape(B, T, d))


def _forward_cached(self: "Llama", x: Tensor, valid: Tensor | None = None,
                    cache: KVCache | None = None) -> Tensor:
    """Logits [B, T, vocab] for new tokens x [B, T] given everything already in `cache`.

    valid [B, T] (bool, default all True) marks real tokens; padding tokens get no position and
    are never attended to. Positions continue from the tokens already cached. Equal (fp32) to
    `forward` on each row's unpadded sequence.
    """
    if self.embed is None or self.head is None:
        raise ValueError("forward_cached needs a full model (embed and head); a pipeline stage "
                         "is driven by pipeline/, not by the sampler")
    B, T = x.shape
    valid = torch.ones(B, T, dtype=torch.bool, device=x.device) if valid is None else valid
    past = cache.key_mask[:, :cache.length] if cache is not None else valid[:, :0]
    total = past.shape[1] + T
    if total > self.cfg.max_seq_len or (cache is not None and total > cache.max_len):
        raise ValueError(f"sequence length {total} > model.max_seq_len={self.cfg.max_seq_len} "
                         "or the KV cache length; shorten the prompt or max_new_tokens")
    keys = torch.cat([past, valid], dim=1)                               # [B, total]
    positions = (keys.long().cumsum(1) - 1).clamp(min=0)[:, -T:]          # [B, T]
    causal = torch.ones(T, total, dtype=torch.bool, device=x.device).tril(total - T)
    mask = causal[None] & keys[:, None, :]                               # [B, T, total]
    # a query with no valid key (a padding row position) would give NaN: let it see itself
    eye = torch.zeros(T, total, dtype=torch.bool, device=x.device)
    eye[:, total - T:] = torch.eye(T, dtype=torch.bool, device=x.device)
    mask = (mask | (eye[None] & ~mask.any(-1, keepdim=True)))[:, None]   # [B, 1, T, total]
    cos, sin = _rope_at(positions, self.cfg.head_dim, self.cfg.rope_theta)
    h = self.embed(x)
    for name, block in self.layers.items():
        h = h + _attn_cached(block.attn, block.attn_norm(h), cos, sin, mask, cache, name)
        h = h + block.ffn(block.ffn_norm(h))
    if cache is not None:
        cache.key_mask[:, cache.length:cache.length + T] = valid
        cache.length += T
    return self.head(self.norm(h))

