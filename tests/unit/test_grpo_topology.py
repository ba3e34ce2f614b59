"""``grpo.topology``: vertical (whole groups per generator, the F-TIS paper's) vs horizontal (mixed groups, ours).

Pure parts with exact numbers (rl/topology.py, the advantages per generator group, the wire check
of whole groups, the round config hash), then the learner's group assembly and the defenses'
admission on real tiny models."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from models import ModelConfig
from rl.defense import Defense
from rl.ftis import FTISParams, ftis_loss
from rl.grpo import group_advantages
from rl.grpo_config import GRPOConfig
from rl.learner import Learner
from rl.rollout import Completion, Expect, PromptGroup, RolloutBatch, check
from rl.topology import pick_groups, prompt_key


def _comp(n: int = 3, tok: int = 1) -> Completion:
    return Completion(np.full(n, tok, np.int32), np.full(n, -0.5, np.float32))


def _batch(sender: str, n_groups: int, size: int = 2, round_: int = 1) -> RolloutBatch:
    groups = [PromptGroup(f"{sender}{g}".encode(), [_comp(tok=g + 1) for _ in range(size)]) for g in range(n_groups)]
    return RolloutBatch("run", round_, sender, "tok", 0.7, groups, "cfg", "m")


# ---------------- pure ----------------
def test_prompt_key_shares_prompts_horizontally_and_separates_peers_vertically():
    assert prompt_key("run", "horizontal", "A") == prompt_key("run", "horizontal", "B") == "run"
    assert prompt_key("run", "vertical", "A") == "run/vertical/A" != prompt_key("run", "vertical", "B")
    with pytest.raises(ValueError, match="grpo.topology 'diagonal'"):
        prompt_key("run", "diagonal", "A")


def test_pick_groups_takes_whole_groups_round_robin_within_the_row_budget():
    a, b = _batch("A", 3), _batch("B", 2)
    got = pick_groups([a, b], max_rows=6, max_senders=16, rng=random.Random(0))
    assert [g.sender for g in got] == ["A", "B", "A"]                 # round-robin across senders
    assert [len(g.completions) for g in got] == [2, 2, 2]             # whole groups only
    assert len({g.prompt_id for g in got}) == 3
    # every group when the budget allows; none past max_senders
    assert len(pick_groups([a, b], 100, 16, random.Random(0))) == 5
    assert {g.sender for g in pick_groups([a, b], 100, 1, random.Random(0))} == {"A"}
    # a group that does not fit whole is skipped, a smaller one later still fits
    c = RolloutBatch("run", 1, "C", "tok", 0.7, [PromptGroup(b"big", [_comp()] * 3), PromptGroup(b"small", [_comp()])],
                     "cfg", "m")
    got = pick_groups([c], max_rows=2, max_senders=16, rng=random.Random(1))
    assert [(g.prompt_id, len(g.completions)) for g in got] == [(b"small", 1)]
    assert pick_groups([a], max_rows=0, max_senders=16, rng=random.Random(0)) == []


def test_advantages_are_normalised_within_the_generators_group():
    """Own group rewards [1, 0], a foreign generator's group [1, 1] for the same question.
    Horizontal (one mixed group): mean 0.75, std 0.5 -> A = [0.25, -0.75, 0.25, 0.25] / 0.5001.
    Vertical (two groups): ours -> [+-0.5 / (0.70711 + 1e-4)], the foreign constant group -> 0."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 1.0])
    horizontal = group_advantages(rewards, torch.tensor([0, 0, 0, 0]))
    assert horizontal.tolist() == pytest.approx([0.25 / 0.5001, -0.75 / 0.5001, 0.25 / 0.5001, 0.25 / 0.5001],
                                                abs=1e-6)
    vertical = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    a = 0.5 / (2 ** -0.5 + 1e-4)
    assert vertical.tolist() == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)
    # the F-TIS loss uses exactly these advantages (foreign rows flagged, weights per foreign token)
    lp = torch.zeros(4, 2)
    res = ftis_loss(lp, torch.full((4, 2), -0.1), torch.ones(4, 2, dtype=torch.bool), rewards,
                    torch.tensor([0, 0, 1, 1]), torch.tensor([False, False, True, True]), FTISParams())
    assert res.advantages.tolist() == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)
    assert res.weights[2:].flatten().tolist() == pytest.approx([float(np.exp(0.1))] * 4, abs=1e-6)   # exp(0 + 0.1)


def test_a_rejection_zeroes_the_reward_inside_its_own_group_only():
    """reject_rule = zero_reward on the foreign group [1, 1] (one row rejected): that group becomes
    [1, 0] -> +-0.70700; our group [1, 0] keeps its advantages (horizontal would shift them)."""
    rewards = torch.tensor([1.0, 0.0, 1.0, 0.0])                   # row 3 zeroed by the verdict
    adv = group_advantages(rewards, torch.tensor([0, 0, 1, 1]))
    a = 0.5 / (2 ** -0.5 + 1e-4)
    assert adv.tolist() == pytest.approx([a, -a, a, -a], abs=1e-6)
    # drop: the rejected row leaves its group; the foreign group has one member left -> A = 0
    adv = group_advantages(torch.tensor([1.0, 0.0, 1.0, 1.0]), torch.tensor([0, 0, 1, 1]),
                           valid=torch.tensor([True, True, True, False]))
    assert adv.tolist() == pytest.approx([a, -a, 0.0, 0.0], abs=1e-6)


def test_the_wire_check_refuses_a_partial_group_with_a_clear_reason():
    ex = Expect("run", 1, "tok", 0.7, 256, 24, prompt_ids=frozenset({b"A0", b"A1"}), group_size=2)
    assert check(_batch("A", 2), ex) is None
    partial = _batch("A", 2)
    partial.groups[1].completions.pop()
    err = check(partial, ex)
    assert err.category == "schema" and err.reason.startswith("group 1: 1 completions, but the vertical topology "
                                                              "trades whole groups of G = 2")
    err = check(_batch("B", 1), ex)                       # another sender's prompts: not this sender's
    assert "is not one of round 1's prompts for this sender" in err.reason
    assert check(partial, Expect("run", 1, "tok", 0.7, 256, 24)) is None    # horizontal: any share


def test_topology_is_in_the_round_config_hash_only_when_vertical():
    h = GRPOConfig()
    assert h.topology == "horizontal" and "topology" not in h.round_config("tok")   # old peers keep their hash
    v = GRPOConfig(topology="vertical")
    assert v.round_config("tok")["topology"] == "vertical" and v.config_hash("tok") != h.config_hash("tok")
    with pytest.raises(ValueError):
        GRPOConfig(topology="diagonal")


# ---------------- the learner and the defenses on tiny real models ----------------
CFG = GRPOConfig(max_operand=5, prompts_per_round=4, heldout_size=8, eval_samples=1, warmup_target_acc=0,
                 max_completion_tokens=12, foreign_per_prompt=2, topology="vertical")


@pytest.fixture(scope="module")
def peers():
    torch.set_num_threads(1)
    mc = ModelConfig(d_model=16, n_layers=1, n_heads=2, max_seq_len=40)
    return [Learner(CFG, mc, 7 + i, "unit", f"peer{i}") for i in range(3)]


def test_vertical_peers_draw_their_own_prompts_and_rebuild_each_others(peers):
    a, b, _ = peers
    mine, theirs = a.round_prompts(5), b.round_prompts(5)
    assert len(mine) == len(theirs) == 4 and not set(mine) & set(theirs)
    assert list(a.round_prompts(5, "peer1")) == list(theirs)                  # rebuilt from the sender's ID
    assert [p.prompt_id for p in a.generate(5).prompts] == list(mine)
    h = Learner(CFG.model_copy(update={"topology": "horizontal"}), a.mcfg, 7, "unit", "peer0", policy=a.policy)
    assert list(h.round_prompts(5)) == list(h.round_prompts(5, "peer1"))   # horizontal: the same for all


def test_vertical_mix_keeps_each_generators_group_apart_and_scores_it_locally(peers):
    a, b, c = peers
    g = a.generate(2)
    foreign = [b.batch(b.generate(2)), c.batch(c.generate(2))]
    m = a.mix(g, foreign)
    B, G = CFG.prompts_per_round, CFG.completions_per_prompt
    n_foreign = B * CFG.foreign_per_prompt // G                  # B * F = 8 slots / G = 2: 4 groups (of 8)
    assert m.group.tolist() == [i for i in range(B) for _ in range(G)] + \
        [B + k for k in range(n_foreign) for _ in range(G)]
    assert m.n_local == B * G and int(m.foreign.sum()) == n_foreign * G and len(m.prompts) == B + n_foreign
    assert sorted(m.senders[B * G:]) == ["peer1"] * 4 + ["peer2"] * 4        # round-robin: 2 groups each
    for row in range(B * G, len(m.rewards)):
        p = m.prompts[int(m.group[row])]
        assert p.prompt_id in a.round_prompts(2, m.senders[row])            # the sender's own prompt
        text = a.policy.decode(m.tokens[row][m.mask[row]].tolist())
        assert m.rewards[row] == a.task.reward(p, text)                     # our verifier, not the sender's
    st = a.train(g, foreign)
    assert st.n_foreign == n_foreign * G and st.senders == 2
    # a batch with prompts that are not its sender's is left out (the inbox refuses it first)
    forged = b.batch(b.generate(2))
    forged.sender = "peer2"
    assert a.mix(g, [forged]).n_local == len(a.mix(g, [forged]).rewards)


def test_vertical_admission_keeps_or_drops_whole_groups():
    d = Defense(CFG, "m", lambda ids: "")
    assert d.budget.per_sender == CFG.prompts_per_round * CFG.completions_per_prompt * 12 // 2   # B * G * cap / 2
    big = RolloutBatch("unit", 1, "x", "t", 0.7, [PromptGroup(f"p{i}".encode(), [_comp(10), _comp(10)])
                                                  for i in range(3)], "c", "m")
    kept = d.admit(1, [big])                                  # 48 tokens: two groups of 20 fit, the third not
    assert [len(g.completions) for b in kept for g in b.groups] == [2, 2] and d.rejected["quota"] == 2
    hcfg = CFG.model_copy(update={"topology": "horizontal", "per_sender_per_prompt": 1,
                                  "defense": CFG.defense.model_copy(update={"sender_token_budget": 1000})})
    h = Defense(hcfg, "m", lambda ids: "")
    assert [len(g.completions) for b in h.admit(1, [big]) for g in b.groups] == [1, 1, 1]   # horizontal: a share


def test_the_role_expects_each_senders_own_prompts_in_whole_groups(peers):
    from rl.grpo_peers import RolloutPeers

    config = SimpleNamespace(run_id="unit", grpc=SimpleNamespace(max_message_bytes=1 << 20))
    ctx = SimpleNamespace(config=config, peer_id="peer0", eventbus=None, supervisor=None, grpc_addr="127.0.0.1:1",
                          membership=SimpleNamespace(dht=None))
    rp = RolloutPeers(ctx, CFG, key=None)
    rp.learner = peers[0]
    ex1, ex2 = rp.expect(3, "peer1"), rp.expect(3, "peer2")
    assert ex1.prompt_ids == frozenset(peers[1].round_prompts(3)) != ex2.prompt_ids
    assert ex1.group_size == CFG.completions_per_prompt
    assert check(peers[1].batch(peers[1].generate(3)), ex1) is None
    assert check(peers[2].batch(peers[2].generate(3)), ex1) is not None      # peer2's groups under peer1's name
