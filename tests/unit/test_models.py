"""Unit tests for models/llama.py, models/config.py and models/tokenizer.py (CPU, seconds)."""

import math

import pytest
import torch
from pydantic import ValidationError

from models import ByteTokenizer, Llama, ModelConfig, build_model, lm_loss

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=32)


def _tokens(seed=0, B=2, T=16):
    return torch.randint(0, 256, (B, T), generator=torch.Generator().manual_seed(seed))


def test_shapes_and_stage_outputs():
    x = _tokens()
    assert build_model(CFG, 0)(x).shape == (2, 16, 256)
    assert build_model(CFG, 0, head=False)(x).shape == (2, 16, 32)
    h = torch.randn(2, 16, 32)
    assert build_model(CFG, 0, layers=(1, 2), embed=False)(h).shape == (2, 16, 256)


def test_causal_mask():
    model = build_model(CFG, 1)
    x = _tokens()
    x2 = x.clone()
    x2[:, 10:] = (x2[:, 10:] + 1) % 256
    a, b = model(x), model(x2)
    assert torch.equal(a[:, :10], b[:, :10])
    assert not torch.allclose(a[:, 10:], b[:, 10:])


def test_init_deterministic_and_independent_of_global_rng():
    torch.manual_seed(123)
    a = build_model(CFG, 7).state_dict()
    torch.manual_seed(999)
    torch.rand(1000)
    state = torch.get_rng_state()
    b = build_model(CFG, 7).state_dict()
    assert torch.equal(state, torch.get_rng_state()), "init must not consume the global RNG"
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    c = build_model(CFG, 8).state_dict()
    assert not torch.equal(a["layers.0.attn.wq.weight"], c["layers.0.attn.wq.weight"])


def test_stage_split_equals_whole_model():
    cfg = CFG.model_copy(update={"n_layers": 3})
    whole = build_model(cfg, 3)
    stages = [build_model(cfg, 3, layers=(0, 1), head=False),
              build_model(cfg, 3, layers=(1, 3), embed=False, head=False),
              build_model(cfg, 3, layers=(3, 3), embed=False, head=True)]
    x = _tokens(1)
    h = x
    for s in stages:
        h = s(h)
    assert (h - whole(x)).abs().max().item() <= 1e-6
    full = whole.state_dict()
    for s in stages:
        sd = s.state_dict()
        assert sd.keys() <= full.keys(), sd.keys() - full.keys()
        for k, v in sd.items():
            assert torch.equal(v, full[k]), k
    assert "layers.1.attn.wq.weight" in stages[1].state_dict()
    assert "layers.0.attn.wq.weight" not in stages[1].state_dict()


def test_tied_and_untied_heads():
    whole = build_model(CFG, 0)
    assert whole.head.weight is whole.embed.weight
    head_stage = build_model(CFG, 0, layers=(2, 2), embed=False)
    assert torch.equal(head_stage.head.weight, whole.embed.weight)   # same init, own tensor
    untied = build_model(CFG.model_copy(update={"tie_embeddings": False}), 0)
    assert untied.head.weight is not untied.embed.weight
    assert not torch.equal(untied.head.weight, untied.embed.weight)


def test_bad_layer_range():
    with pytest.raises(ValueError, match="n_layers"):
        Llama(CFG, layers=(1, 5))


def test_config_validation_messages():
    with pytest.raises(ValidationError, match="not divisible by model.n_heads"):
        ModelConfig(d_model=30, n_heads=4)
    with pytest.raises(ValidationError, match="odd"):
        ModelConfig(d_model=12, n_heads=4)
    with pytest.raises(ValidationError):
        ModelConfig(unknown=1)
    assert ModelConfig().ffn_hidden == 168 and ModelConfig().ffn_hidden % 8 == 0
    assert "SwiGLU" in ModelConfig.model_fields["ffn_mult"].description


def test_too_long_sequence():
    with pytest.raises(ValueError, match="max_seq_len"):
        build_model(CFG, 0)(_tokens(T=33))


def test_loss_at_init_near_uniform():
    model = build_model(ModelConfig(), 0)
    x = _tokens(B=4, T=64)
    loss = lm_loss(model(x[:, :-1]), x[:, 1:]).item()
    assert abs(loss - math.log(256)) < 0.3, loss


def test_overfit_tiny_batch():
    torch.manual_seed(0)
    model = build_model(CFG, 0)
    x = _tokens(B=2, T=17)
    inp, tgt = x[:, :-1], x[:, 1:]
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)
    first = lm_loss(model(inp), tgt).item()
    for _ in range(30):
        loss = lm_loss(model(inp), tgt)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first, (first, loss.item())


def test_bf16_model_runs_and_trains():
    model = build_model(CFG.model_copy(update={"dtype": "bfloat16"}), 0)
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())
    assert model.head.weight is model.embed.weight                  # tie survives the cast
    ref = build_model(CFG, 0)
    assert torch.equal(model.embed.weight, ref.embed.weight.bfloat16())
    x = _tokens()
    logits = model(x)
    assert logits.dtype == torch.bfloat16
    loss = lm_loss(logits[:, :-1], x[:, 1:])
    assert loss.dtype == torch.float32 and torch.isfinite(loss)
    loss.backward()
    assert model.embed.weight.grad is not None
    h = build_model(CFG.model_copy(update={"dtype": "bfloat16"}), 0, layers=(1, 2), embed=False)
    assert h(torch.randn(2, 16, 32)).dtype == torch.bfloat16   # fp32 activations are cast


@pytest.mark.parametrize("text", ["hello", "", "naïve café — 東京 🚀\n\ttab"])
def test_byte_tokenizer_round_trip(text):
    tok = ByteTokenizer()
    ids = tok.encode(text)
    assert all(0 <= i < tok.vocab_size for i in ids)
    assert len(ids) == len(text.encode("utf-8"))
    assert tok.decode(ids) == text


def test_byte_tokenizer_invalid_utf8_replaced():
    assert ByteTokenizer().decode([0xFF, 0x41]) == "\ufffdA"


def test_models_package_imports_no_comm_code():
    """docs/architecture.md, 'Layer rules': models never import comm (static check of every import statement)."""
    import ast
    import pathlib

    import models

    banned = {"grpc", "hivemind", "libp2p", "protocol", "node", "pipeline", "optimizers", "rl"}
    for path in pathlib.Path(models.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for name in names:
                assert name.split(".")[0] not in banned, f"{path.name} imports {name}"
