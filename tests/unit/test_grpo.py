"""rl/grpo.py: advantages, clipping, k3 KL, loss aggregation (docs/grpo.md, 'GRPO loss')."""

import math

import pytest
import torch

from rl.grpo import aggregate, group_advantages, grpo_loss, k3_kl, token_logprobs


def test_group_advantages_zero_mean_unit_std_mixed_groups():
    rewards = torch.tensor([1., 0., 0., 1., 1.,   0., 1., 0.,   1., 1., 1.])
    group = torch.tensor([0, 0, 0, 0, 0, 1, 1, 1, 2, 2, 2])
    A = group_advantages(rewards, group)
    for g in range(2):
        a = A[group == g]
        assert abs(float(a.mean())) < 1e-6
        assert float(a.std(unbiased=True)) == pytest.approx(1.0, abs=1e-3)   # eps 1e-4
    assert (A[group == 2] == 0).all() and torch.isfinite(A).all()           # constant group
    # hand value: group 1 = (0,1,0): mean 1/3, std ddof1 = sqrt(1/3)
    assert float(A[6]) == pytest.approx((2 / 3) / (math.sqrt(1 / 3) + 1e-4), rel=1e-6)


def test_group_advantages_batch_none_valid_and_singletons():
    rewards = torch.tensor([1., 0., 0.5, 0.5, 1.])
    group = torch.tensor([0, 0, 1, 1, 2])
    none = group_advantages(rewards, group, "none")
    assert none.tolist() == [0.5, -0.5, 0.0, 0.0, 0.0]                      # singleton -> 0
    batch = group_advantages(rewards, group, "batch")
    std = float(rewards.std(unbiased=True))
    assert batch.tolist() == pytest.approx([0.5 / (std + 1e-4), -0.5 / (std + 1e-4), 0, 0, 0])
    # rows excluded by valid neither get an advantage nor move their group's statistics
    v = torch.tensor([True, True, True, True, False])
    r2 = torch.tensor([1., 0., 0.5, 0.5, 123.])
    assert torch.equal(group_advantages(r2, group, valid=v), group_advantages(rewards, group))
    r3 = torch.tensor([1., 0., 1.0, 0.0])
    a3 = group_advantages(r3, torch.tensor([0, 0, 0, 0]), valid=torch.tensor([1, 1, 0, 0]))
    assert a3[2:].tolist() == [0.0, 0.0]
    with pytest.raises(ValueError, match="scale_rewards"):
        group_advantages(rewards, group, "bogus")


def _policy(L=2, V=5, seed=0):
    logits = torch.randn(3, L, V, generator=torch.Generator().manual_seed(seed),
                         requires_grad=True)
    tokens = torch.randint(0, V, (3, L), generator=torch.Generator().manual_seed(seed + 1))
    return logits, tokens


def test_mu1_loss_is_minus_mean_advantage_and_gradient_is_minus_A_grad_logpi():
    logits, tokens = _policy()
    adv = torch.tensor([1.0, -0.5, 2.0])
    mask = torch.ones(3, 2, dtype=torch.bool)
    lp = token_logprobs(logits, tokens)
    out = grpo_loss(lp, adv, mask, agg="sample")
    assert out.loss.item() == pytest.approx(-float(adv.mean()), abs=1e-6)
    out.loss.backward()
    g = logits.grad.clone()
    logits.grad = None
    ref = -(adv[:, None] * token_logprobs(logits, tokens)).mean(1).sum() / 3
    ref.backward()
    torch.testing.assert_close(g, logits.grad)
    assert out.clip_frac == 0.0


def test_clip_removes_gradient_and_is_counted():
    lp = torch.log(torch.tensor([[0.5, 0.5], [0.5, 0.5]])).requires_grad_()
    old = torch.log(torch.tensor([[0.3, 0.5], [0.8, 0.5]]))   # rho: 1.67, 1 / 0.625, 1
    adv = torch.tensor([1.0, -1.0])
    mask = torch.ones(2, 2, dtype=torch.bool)
    out = grpo_loss(lp, adv, mask, old_logp=old, eps_lo=0.2, eps_hi=0.28)
    out.loss.backward()
    assert lp.grad[0, 0] == 0 and lp.grad[1, 0] == 0          # A>0, rho>1.28 / A<0, rho<0.8
    assert lp.grad[0, 1] != 0 and lp.grad[1, 1] != 0
    assert out.clip_frac == pytest.approx(0.5)
    # inside the clip range on the "wrong" side the gradient stays (min picks the unclipped)
    lp2 = torch.log(torch.tensor([[0.5]])).requires_grad_()
    grpo_loss(lp2, torch.tensor([-1.0]), torch.ones(1, 1, dtype=torch.bool),
              old_logp=torch.log(torch.tensor([[0.3]]))).loss.backward()
    assert lp2.grad[0, 0] != 0


def test_k3_kl_and_beta():
    lp = torch.log(torch.tensor([[0.2, 0.5, 0.9]]))
    ref = torch.log(torch.tensor([[0.4, 0.5, 0.1]]))
    D = k3_kl(lp, ref)
    assert (D >= 0).all() and D[0, 1] == 0
    assert float(k3_kl(lp, lp).abs().max()) == 0.0
    mask = torch.ones(1, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match="ref_logp"):
        grpo_loss(lp, torch.tensor([0.0]), mask, beta=0.1)
    out = grpo_loss(lp, torch.tensor([0.0]), mask, beta=0.1, ref_logp=ref)
    assert out.loss.item() == pytest.approx(0.1 * float(D.mean()), rel=1e-6)
    assert out.kl_mean == pytest.approx(float(D.mean()), rel=1e-6)


def test_aggregations_match_hand_computation():
    ell = torch.tensor([[1.0, 2.0, 3.0, 9.0], [4.0, 9.0, 9.0, 9.0]])
    mask = torch.tensor([[1, 1, 1, 0], [1, 0, 0, 0]], dtype=torch.bool)
    # per-sample means: 2.0 and 4.0; tokens 1+2+3+4 = 10 over 4
    assert float(aggregate(ell, mask, "sample", n_slots=8)) == pytest.approx(6.0 / 8)
    assert float(aggregate(ell, mask, "sample")) == pytest.approx(3.0)
    assert float(aggregate(ell, mask, "seq")) == pytest.approx(3.0)
    assert float(aggregate(ell, mask, "token")) == pytest.approx(2.5)
    assert float(aggregate(ell, mask, "dr_grpo", n_slots=8, max_len=5)) == pytest.approx(10 / 40)
    with pytest.raises(ValueError, match="loss_agg"):
        aggregate(ell, mask, "mean")


def test_micro_batches_sum_to_full_batch_with_shared_normaliser():
    ell = torch.rand(6, 5, generator=torch.Generator().manual_seed(0))
    mask = torch.rand(6, 5, generator=torch.Generator().manual_seed(1)) > 0.3
    mask[:, 0] = True
    for agg, kw in (("sample", {"n_slots": 10}), ("token", {"n_tokens_total": float(mask.sum())}),
                    ("seq", {"n_samples_total": 6}), ("dr_grpo", {"n_slots": 10})):
        full = aggregate(ell, mask, agg, **kw)
        parts = aggregate(ell[:2], mask[:2], agg, **kw) + aggregate(ell[2:], mask[2:], agg, **kw)
        torch.testing.assert_close(full, parts)


def test_sample_agg_is_length_robust_token_is_not():
    """A long completion pulls no harder than a short one under `sample`; under `token` it does."""
    def pull(agg, long_len):
        lp = torch.zeros(2, long_len, requires_grad=True)
        mask = torch.zeros(2, long_len, dtype=torch.bool)
        mask[0, :2] = True
        mask[1, :] = True
        grpo_loss(lp, torch.tensor([1.0, 1.0]), mask, agg=agg).loss.backward()
        return float(lp.grad[1].abs().sum()), float(lp.grad[0].abs().sum())
    long_s, short_s = pull("sample", 40)
    assert long_s == pytest.approx(short_s)
    long_t, short_t = pull("token", 40)
    assert long_t == pytest.approx(20 * short_t)


def test_padding_tokens_enter_neither_loss_nor_normaliser():
    """G3: masked positions (garbage log-probs, huge ratio) change neither loss nor normaliser."""
    mask = torch.tensor([[1, 1, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    adv = torch.tensor([0.7, -1.2])
    lp = torch.randn(2, 4, generator=torch.Generator().manual_seed(0))
    old = lp.clone()
    old[~mask] = -50.0                         # rho would be huge on padding
    lp.requires_grad_()
    expect = {"sample": -(0.7 + -1.2) / 2, "seq": -(0.7 + -1.2) / 2,
              "token": -(2 * 0.7 + 3 * -1.2) / 5, "dr_grpo": -(2 * 0.7 + 3 * -1.2) / (2 * 4)}
    for agg, value in expect.items():
        out = grpo_loss(lp, adv, mask, old_logp=old, agg=agg)
        assert out.loss.item() == pytest.approx(value, rel=1e-6)
        assert out.n_tokens == 5 and out.clip_frac == 0.0
        (g,) = torch.autograd.grad(out.loss, lp)
        assert (g[~mask] == 0).all() and (g[mask] != 0).all()
