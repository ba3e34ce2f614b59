"""models/llama.py KV-cache path and models/generate.py sampling / re-scoring (CPU, fp32)."""

import pytest
import torch
import torch.nn.functional as F

from models import ModelConfig, build_model
from models.generate import processed_logprobs, rescore, sample
from models.llama import KVCache

CFG = ModelConfig(d_model=32, n_layers=2, n_heads=4, max_seq_len=64)


@pytest.fixture(scope="module")
def model():
    m = build_model(CFG, 3)
    with torch.no_grad():          # break the tiny-init near-uniformity so sampling matters
        for p in m.parameters():
            p.mul_(6.0 if p.dim() == 2 else 1.0)
    return m.eval()


def _ids(seed, n):
    return torch.randint(0, 256, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_cached_logits_equal_full_forward_left_padded(model):
    seqs = [_ids(1, 12), _ids(2, 7), _ids(3, 3)]
    width = 12
    ids = torch.zeros(3, width, dtype=torch.long)
    valid = torch.zeros(3, width, dtype=torch.bool)
    for i, s in enumerate(seqs):
        ids[i, width - len(s):] = torch.tensor(s)
        valid[i, width - len(s):] = True
    extra = torch.randint(0, 256, (3, 5), generator=torch.Generator().manual_seed(9))
    with torch.no_grad():
        cache = KVCache(model, 3, width + 5)
        step_logits = [model.forward_cached(ids, valid, cache)[:, -1]]
        for t in range(5):
            step_logits.append(model.forward_cached(extra[:, t:t + 1], None, cache)[:, -1])
        for i, s in enumerate(seqs):
            full = model(torch.tensor([s + extra[i].tolist()]))[0]
            L = len(s)
            for t in range(6):
                torch.testing.assert_close(step_logits[t][i], full[L - 1 + t],
                                           atol=1e-5, rtol=0)
        # the padded full forward (no cache) equals too, on every real position
        padded = model.forward_cached(torch.cat([ids, extra], 1),
                                      torch.cat([valid, torch.ones(3, 5, dtype=torch.bool)], 1))
        for i, s in enumerate(seqs):
            full = model(torch.tensor([s + extra[i].tolist()]))[0]
            torch.testing.assert_close(padded[i, width - len(s):], full, atol=1e-5, rtol=0)


def test_forward_cached_refuses_stage_and_overlong(model):
    stage = build_model(CFG, 0, layers=(0, 1), head=False)
    with pytest.raises(ValueError, match="full model"):
        stage.forward_cached(torch.zeros(1, 2, dtype=torch.long))
    with pytest.raises(ValueError, match="max_seq_len"):
        model.forward_cached(torch.zeros(1, 65, dtype=torch.long))


def test_sample_shapes_stop_and_mask(model):
    prompts = [_ids(4, 5), _ids(5, 9)]
    gen = torch.Generator().manual_seed(0)
    s = sample(model, prompts, G=3, max_new_tokens=10, temperature=1.0, stop_token=10,
               generator=gen)
    assert s.tokens.shape == (6, 10) and s.logp.shape == (6, 10)
    assert s.prompt_index.tolist() == [0, 0, 0, 1, 1, 1]
    for i in range(6):
        n = int(s.mask[i].sum())
        assert s.mask[i, :n].all() and not s.mask[i, n:].any()      # contiguous prefix
        toks = s.tokens[i, :n].tolist()
        assert 10 not in toks[:-1]                                  # nothing after the stop
        assert bool(s.truncated[i]) == (toks[-1] != 10 and n == 10)
        assert (s.logp[i, n:] == 0).all() and (s.logp[i, :n] <= 0).all()
    again = sample(model, prompts, G=3, max_new_tokens=10, stop_token=10,
                   generator=torch.Generator().manual_seed(0))
    assert torch.equal(again.tokens, s.tokens)                       # seeded -> reproducible


def test_sampled_logprobs_equal_rescoring_and_training_forward(model):
    """G2: teacher-forced log-probs = sampled ones at the same T; re-scoring = training forward."""
    prompts = [_ids(6, 4), _ids(7, 11), _ids(8, 1)]
    T = 0.7
    s = sample(model, prompts, G=4, max_new_tokens=12, temperature=T, stop_token=10,
               generator=torch.Generator().manual_seed(1))
    lp = rescore(model, prompts, s.tokens, s.mask, s.prompt_index, temperature=T)
    torch.testing.assert_close(lp[s.mask], s.logp[s.mask], atol=1e-5, rtol=0)
    assert (lp[~s.mask] == 0).all()
    # the training forward: model(q ++ a) unpadded, one row at a time
    for i in range(len(s.tokens)):
        q, a = prompts[int(s.prompt_index[i])], s.completion(i)
        logits = model(torch.tensor([q + a]))[0, len(q) - 1:len(q) - 1 + len(a)]
        ref = F.log_softmax(logits / T, -1).gather(1, torch.tensor(a)[:, None]).squeeze(1)
        torch.testing.assert_close(lp[i, :len(a)], ref, atol=1e-5, rtol=0)


def test_rescore_keeps_the_graph(model):
    prompts = [_ids(1, 3)]
    s = sample(model, prompts, G=2, max_new_tokens=4, generator=torch.Generator().manual_seed(2))
    lp = rescore(model, prompts, s.tokens, s.mask, s.prompt_index)
    lp.sum().backward()
    assert model.embed.weight.grad is not None and model.embed.weight.grad.abs().sum() > 0
    model.zero_grad(set_to_none=True)


def test_processed_logprobs_top_k_top_p():
    logits = torch.tensor([[3.0, 2.0, 1.0, 0.0]])
    lk = processed_logprobs(logits, 1.0, top_k=2)
    assert torch.isinf(lk[0, 2:]).all() and torch.allclose(lk[0, :2].exp().sum(), torch.tensor(1.))
    p = logits.softmax(-1)[0]                                   # .644 .237 .087 .032
    lp = processed_logprobs(logits, 1.0, top_p=0.85)
    assert torch.isfinite(lp[0, :2]).all() and torch.isinf(lp[0, 2:]).all()
    torch.testing.assert_close(lp[0, 0].exp(), p[0] / (p[0] + p[1]))
    with pytest.raises(ValueError, match="temperature"):
        processed_logprobs(logits, 0.0)


def test_top_k_sampling_logprobs_are_the_processed_ones(model):
    s = sample(model, [_ids(3, 6)], G=8, max_new_tokens=6, top_k=5,
               generator=torch.Generator().manual_seed(3))
    assert (s.logp[s.mask] > torch.log(torch.tensor(1e-6))).all()
    plain = rescore(model, [_ids(3, 6)], s.tokens, s.mask, s.prompt_index)
    assert (s.logp[s.mask] >= plain[s.mask] - 1e-6).all()        # renormalised: never lower
