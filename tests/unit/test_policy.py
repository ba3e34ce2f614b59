"""models/policy.py: the embedded decoder at several sizes shares one tokenizer hash; a local
Hugging Face checkpoint (a tiny random LlamaForCausalLM and a character-level tokenizer, both
built here and saved to a temporary folder: nothing is downloaded) samples with its KV cache,
re-scores to the same log-probs, and runs a GRPO learner round."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from models import ModelConfig
from models.generate import rescore, sample
from models.policy import BYTE_TOKENIZER_HASH, build_policy
from rl import rollout as RO
from rl.grpo_config import GRPOConfig
from rl.learner import Learner

transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")

CHARS = "0123456789+=>,:\n "


def _save_tokenizer(folder, extra: str = "") -> None:
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, "<unk>": 3, **{c: i + 4 for i, c in enumerate(CHARS + extra)}}
    tk = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, unk_token="<unk>"))
    tk.pre_tokenizer = tokenizers.pre_tokenizers.Split(pattern="", behavior="isolated")
    tk.decoder = tokenizers.decoders.Fuse()
    transformers.PreTrainedTokenizerFast(tokenizer_object=tk, pad_token="<pad>", bos_token="<s>",
                                         eos_token="</s>", unk_token="<unk>").save_pretrained(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny_hf_policy")
    _save_tokenizer(folder)
    cfg = transformers.LlamaConfig(vocab_size=4 + len(CHARS), hidden_size=32, intermediate_size=64,
                                   num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                   max_position_embeddings=64, bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    transformers.LlamaForCausalLM(cfg).save_pretrained(folder)
    return folder


def test_embedded_sizes_share_the_tokenizer_hash_not_the_model_id():
    small = build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2), seed=0)
    big = build_policy(ModelConfig(d_model=64, n_layers=2, n_heads=4), seed=0)
    assert small.tokenizer_hash == big.tokenizer_hash == BYTE_TOKENIZER_HASH
    assert small.model_id != big.model_id
    assert small.model_id != build_policy(ModelConfig(d_model=32, n_layers=1, n_heads=2), seed=1).model_id
    assert small.stop_id == ord("\n") and small.vocab_size == 256 and small.kind == "embedded"
    with pytest.raises(ValueError, match="vocab_size"):
        build_policy(ModelConfig(vocab_size=100), seed=0)


def test_hf_policy_samples_with_its_cache_and_rescores_the_same(hf_folder, monkeypatch):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    p = build_policy(ModelConfig(hf_path=str(hf_folder)), seed=0)
    assert p.kind == "hf" and p.vocab_size == 4 + len(CHARS) and p.max_seq_len == 64
    assert p.decode(p.encode("12+9=21=>21\n")) == "12+9=21=>21\n"
    assert p.stop_id == p.encode("\n")[0]
    assert p.tokenizer_hash != BYTE_TOKENIZER_HASH
    q = [p.encode("3+4:"), p.encode("12+9+3:")]          # different lengths: left padding
    s = sample(p.model, q, 3, 8, 0.7, stop_token=p.stop_id, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        lp = rescore(p.model, q, s.tokens, s.mask, s.prompt_index, 0.7)
    assert s.mask.sum() > 6
    assert torch.allclose(lp[s.mask], s.logp[s.mask], atol=1e-5)
    # the same folder gives the same hashes; another vocabulary gives another tokenizer hash
    assert build_policy(ModelConfig(hf_path=str(hf_folder)), seed=5).tokenizer_hash == p.tokenizer_hash
    other = hf_folder.parent / "other_tok"
    other.mkdir(exist_ok=True)
    _save_tokenizer(other, extra="x")
    from models.policy import tokenizer_hash
    assert tokenizer_hash(transformers.AutoTokenizer.from_pretrained(str(other))) != p.tokenizer_hash


def test_hf_learner_round_and_tokenizer_mismatch_refused(hf_folder):
    cfg = GRPOConfig(prompts_per_round=2, completions_per_prompt=2, max_completion_tokens=8, heldout_size=2,
                     warmup_target_acc=0)
    hf = Learner(cfg, ModelConfig(hf_path=str(hf_folder)), 0, "run", "hf")
    emb = Learner(cfg, ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=64), 0, "run", "emb")
    assert hf.config_hash != emb.config_hash          # the tokenizer hash is in the round config
    g = hf.generate(3)
    batch = RO.decode(RO.encode(hf.batch(g)))
    assert batch.tokenizer_hash == hf.tokenizer_hash and batch.n_tokens() == int(g.samples.mask.sum())
    before = [t.detach().clone() for t in hf.model.parameters()]
    st = hf.train(g, [])
    assert np.isfinite(st.loss) and st.n_local == 4
    assert any(not torch.equal(a, b) for a, b in zip(before, hf.model.parameters())) or \
        len(set(g.rewards)) == 1
    # the embedded peer refuses the HF peer's batch: another tokenizer
    ex = RO.Expect("run", 3, emb.tokenizer_hash, cfg.temperature, 256, cfg.max_completion_tokens)
    err = RO.check(batch, ex)
    assert err is not None and "tokenizer_hash" in err.reason
