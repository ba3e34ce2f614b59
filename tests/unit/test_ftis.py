"""rl/ftis.py: truncated weights, the KL filter, stats and the three modes (docs/grpo.md, 'F-TIS')."""

import math

import pytest
import torch

from rl.ftis import FTISParams, ftis_loss, kl_filter, sample_kl, sequence_kl, truncated_weights
from rl.grpo import group_advantages, grpo_loss


def test_truncated_weights_detached_capped_and_one_on_policy():
    lp = torch.log(torch.tensor([[0.5, 0.9, 0.1]])).requires_grad_()
    gen = torch.log(torch.tensor([[0.5, 0.1, 0.2]]))
    w = truncated_weights(lp, gen, C=2.0)
    assert not w.requires_grad
    assert w.tolist()[0] == pytest.approx([1.0, 2.0, 0.5])         # 9 -> capped at 2; 0.5 kept
    assert torch.equal(truncated_weights(lp, lp.detach(), 2.0), torch.ones(1, 3))
    assert float(truncated_weights(lp, gen, math.inf)[0, 1]) == pytest.approx(9.0, rel=1e-5)


def test_kl_filter_drops_exactly_negative_and_far():
    adv = torch.tensor([-1.0, -1.0, 1.0, 1.0, 0.0, -0.1])
    kl = torch.tensor([0.6, 0.4, 5.0, 0.1, 9.0, 0.51])
    assert kl_filter(adv, kl, 0.5).tolist() == [0, 1, 1, 1, 1, 0]    # never a positive


def test_sample_kl_is_masked_mean():
    lp = torch.tensor([[-1.0, -2.0, -7.0]])
    gen = torch.tensor([[-0.5, -1.0, 0.0]])
    mask = torch.tensor([[True, True, False]])
    assert sample_kl(lp, gen, mask).tolist() == pytest.approx([0.75])


def _round(seed=0, N=8, L=5):
    g = torch.Generator().manual_seed(seed)
    lp = (-torch.rand(N, L, generator=g) * 3).requires_grad_()
    gen = -torch.rand(N, L, generator=g) * 3
    mask = torch.ones(N, L, dtype=torch.bool)
    mask[::3, 3:] = False
    rewards = torch.tensor([1., 0., 0., 1., 0., 1., 1., 0.])[:N]
    group = torch.tensor([0, 0, 0, 0, 1, 1, 1, 1])[:N]
    foreign = torch.tensor([0, 0, 1, 1, 0, 0, 1, 1], dtype=torch.bool)[:N]
    return lp, gen, mask, rewards, group, foreign


def test_all_local_on_policy_ftis_is_bit_identical_to_plain_grpo():
    """G10 (and G9's 'local samples pass when gen = l')."""
    lp, _, mask, rewards, group, _ = _round()
    foreign = torch.zeros(8, dtype=torch.bool)
    res = ftis_loss(lp, lp.detach().clone(), mask, rewards, group, foreign)
    plain = grpo_loss(lp, group_advantages(rewards, group), mask, n_slots=8)
    assert torch.equal(res.loss.loss, plain.loss)
    assert res.keep.tolist() == [1.0] * 8 and res.stats.filtered == 0
    g1 = torch.autograd.grad(res.loss.loss, lp)[0]
    g2 = torch.autograd.grad(plain.loss, lp)[0]
    assert torch.equal(g1, g2)


def test_ftis_mode_filters_far_negative_foreign_and_reports_stats():
    lp, gen, mask, rewards, group, foreign = _round()
    gen = gen.clone()
    gen[2] = lp.detach()[2] + 2.0          # foreign, reward 0 -> A < 0, KL = 2 > 0.5: dropped
    gen[3] = lp.detach()[3] + 2.0          # foreign, reward 1 -> A > 0: kept despite KL
    gen[6] = lp.detach()[6] - 3.0          # foreign, w = e^3 -> capped at C
    gen[7] = lp.detach()[7]
    gen[[0, 1, 4, 5]] = lp.detach()[[0, 1, 4, 5]]
    res = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", C=2.0, delta=0.5))
    assert res.keep.tolist() == [1, 1, 0, 1, 1, 1, 1, 1]
    assert res.stats.filtered == 1 and res.stats.filtered_frac == pytest.approx(1 / 8)
    assert res.stats.n_local == 4 and res.stats.n_foreign == 4
    assert float(res.weights.max()) == 2.0
    fm = mask & foreign[:, None]
    expect_w = torch.exp(lp.detach() - gen).clamp(max=2.0)[fm].mean()
    assert res.stats.weight_mean == pytest.approx(float(expect_w), rel=1e-6)
    assert res.stats.truncated_frac == pytest.approx(float(mask[6].sum()) / float(fm.sum()))
    (grad,) = torch.autograd.grad(res.loss.loss, lp)
    assert (grad[2] == 0).all() and (grad[3][mask[3]] != 0).all()
    # the filtered sample stays in S: the step shrinks rather than re-normalising
    assert res.loss.token_loss[2].abs().sum() == 0


def test_uncorrected_and_solo_modes_same_code_path():
    lp, gen, mask, rewards, group, foreign = _round(1)
    unc = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("uncorrected"))
    assert torch.equal(unc.weights, torch.ones_like(unc.weights)) and unc.keep.sum() == 8
    plain = grpo_loss(lp, group_advantages(rewards, group), mask, n_slots=8)
    assert torch.equal(unc.loss.loss, plain.loss)                  # foreign = on-policy
    solo = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("solo"))
    local = ~foreign
    assert (solo.advantages[foreign] == 0).all() and (solo.keep[foreign] == 0).all()
    own = grpo_loss(lp[local], group_advantages(rewards[local], group[local]), mask[local],
                    n_slots=4)
    torch.testing.assert_close(solo.loss.loss, own.loss)
    (grad,) = torch.autograd.grad(solo.loss.loss, lp)
    assert (grad[foreign] == 0).all()
    with pytest.raises(ValueError, match="mode"):
        ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("bogus"))


def test_mixed_group_advantages_use_foreign_rewards():
    """The local sample's advantage depends on the foreign rewards in its group."""
    lp, gen, mask, _, group, foreign = _round(2)
    r1 = torch.tensor([1., 0., 0., 0., 1., 0., 0., 0.])
    r2 = torch.tensor([1., 0., 1., 1., 1., 0., 0., 0.])
    a1 = ftis_loss(lp, gen, mask, r1, group, foreign).advantages
    a2 = ftis_loss(lp, gen, mask, r2, group, foreign).advantages
    assert float(a1[0]) > float(a2[0]) > 0



def test_sequence_kl_is_masked_sum():
    lp = torch.tensor([[-1.0, -2.0, -7.0], [-1.0, -1.0, -1.0]])
    gen = torch.tensor([[-0.5, -1.0, 0.0], [-0.5, -0.5, -0.5]])
    mask = torch.tensor([[True, True, False], [True, True, True]])
    assert sequence_kl(lp, gen, mask).tolist() == pytest.approx([1.5, 1.5])
    assert sample_kl(lp, gen, mask).tolist() == pytest.approx([0.75, 0.5])


def _long_and_short():
    """Two negative-advantage foreign rows, 0.8 nats/token apart from the learner: 4 tokens (3.2
    nats in all) and 40 tokens (32 nats in all); a local pair sets the advantages."""
    L = 40
    lp = torch.full((4, L), -1.0, requires_grad=True)
    gen = lp.detach().clone()
    gen[2] += 0.8
    gen[3] += 0.8
    mask = torch.zeros(4, L, dtype=torch.bool)
    mask[:, :4] = True
    mask[3] = True
    rewards = torch.tensor([1.0, 1.0, 0.0, 0.0])
    group = torch.zeros(4, dtype=torch.long)
    foreign = torch.tensor([False, False, True, True])
    return lp, gen, mask, rewards, group, foreign


def test_kl_stat_token_mean_is_length_free_sequence_grows_with_length():
    lp, gen, mask, rewards, group, foreign = _long_and_short()
    tok = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", delta=0.5))
    assert tok.keep.tolist() == [1, 1, 0, 0]                       # 0.8 > 0.5 per token, both lengths
    seq = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", kl_stat="sequence", g=10.0))
    assert seq.keep.tolist() == [1, 1, 1, 0]                       # 3.2 <= 10 kept, 32 > 10 dropped
    paper = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", kl_stat="sequence", g=50.0))
    assert paper.keep.tolist() == [1, 1, 1, 1]                     # g = 50 keeps both at these lengths
    for res in (tok, seq, paper):                                  # both statistics reported either way
        assert res.stats.kl_foreign_mean == pytest.approx(0.8)
        assert res.stats.kl_seq_foreign_mean == pytest.approx((3.2 + 32.0) / 2)
    assert seq.stats.kl_stat == "sequence" and tok.stats.kl_stat == "token_mean"
    assert seq.stats.filtered == 1 and seq.stats.filtered_frac == pytest.approx(1 / 4)
    with pytest.raises(ValueError, match="kl_stat"):
        ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", kl_stat="bogus"))


def test_sequence_filter_never_drops_positives():
    lp, gen, mask, _, group, foreign = _long_and_short()
    rewards = torch.tensor([0.0, 0.0, 1.0, 1.0])                   # the far foreign rows are the good ones
    res = ftis_loss(lp, gen, mask, rewards, group, foreign, FTISParams("ftis", kl_stat="sequence", g=1.0))
    assert res.keep.tolist() == [1, 1, 1, 1]
