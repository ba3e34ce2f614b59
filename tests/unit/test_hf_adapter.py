"""Unit tests for models/hf_adapter.py: a tiny random LlamaForCausalLM saved and reloaded locally.

Nothing is downloaded: the checkpoint is built in Python and written to tmp_path.
"""

import pytest
import torch

from models import ModelConfig, build_from_config, load_hf_causal_lm
from models.llama import Llama

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    cfg = transformers.LlamaConfig(
        vocab_size=256, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(cfg).eval()
    path = tmp_path_factory.mktemp("tiny_llama")
    model.save_pretrained(path)
    return model, path


def test_load_matches_in_memory_model(tiny_checkpoint, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    ref, path = tiny_checkpoint
    wrapped = load_hf_causal_lm(str(path))
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(1))
    logits = wrapped(ids)
    assert isinstance(logits, torch.Tensor) and logits.shape == (2, 12, 256)
    with torch.no_grad():
        expected = ref(input_ids=ids).logits
    assert (logits.detach() - expected).abs().max().item() <= 1e-6
    assert all(p.dtype == torch.float32 for p in wrapped.parameters())


def test_build_from_config_chooses_model(tiny_checkpoint):
    _, path = tiny_checkpoint
    hf = build_from_config(ModelConfig(hf_path=str(path), dtype="bfloat16"), seed=0)
    assert next(hf.parameters()).dtype == torch.bfloat16
    assert hf(torch.zeros(1, 4, dtype=torch.long)).shape == (1, 4, 256)
    assert isinstance(build_from_config(ModelConfig(), seed=0), Llama)


def test_missing_folder_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"model\.hf_path.*never downloads"):
        load_hf_causal_lm(str(tmp_path / "missing"))
    with pytest.raises(FileNotFoundError, match="config.json"):
        load_hf_causal_lm(str(tmp_path))
