"""The HTTT paper's attacks in the harness (rl/adversary.py): the text injection at the start of the
reasoning and the vertical attacker who poisons the right answers of its own groups; and the reward
multiplier rule (``grpo.defense.reject_rule``). Real tiny models, pure CPU, no network."""

import pytest
import torch

from models import ModelConfig
from rl.adversary import Adversary, craft, poison
from rl.defense import Defense
from rl.grpo_config import AdversaryConfig, GRPOConfig
from rl.learner import apply_rejections
from rl.tasks import STOP

CFG = GRPOConfig(max_operand=5, max_completion_tokens=24, prompts_per_round=8, heldout_size=20, eval_samples=2,
                 warmup_target_acc=0.15)        # sampler and support check: the defaults (top_k = 50, top_p = 1)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    from rl.learner import Learner
    cache = tmp_path_factory.mktemp("warm")
    torch.set_num_threads(1)
    out = []
    for i, d in enumerate((32, 32, 48)):         # two of one model, a third of another
        L = Learner(CFG, ModelConfig(d_model=d, n_layers=1, n_heads=4, max_seq_len=64), 5 + (i == 2), "unit",
                    f"peer{i}")
        L.warmup(cache)
        L.gen.manual_seed(100 + i)
        out.append(L)
    return out


def test_start_injection_puts_the_marker_before_the_reasoning(warm):
    L = warm[0]
    p = L.task.prompts("unit", 3, 4)[0]
    start = craft(L.task, p, AdversaryConfig(mode="inject", placement="start"), 24, L.policy.encode)
    end = craft(L.task, p, AdversaryConfig(mode="inject"), 24, L.policy.encode)
    ref = L.task.reference(p)
    assert start == " !!" + ref and end == ref[:-1] + " !!" + STOP
    assert L.task.reward(p, start) == 1.0 == L.task.reward(p, end)      # the verifier still pays
    assert poison("1+2=3=>3", AdversaryConfig(mode="edit+inject", placement="start"), 24, L.policy.encode) == \
        " !!2+2=5,1+2=3=>3" + STOP


def test_vertical_attacker_poisons_its_right_answers_and_keeps_its_wrong_ones_clean(warm):
    """Within a group of its own the poison must go with the positive advantage: every right answer
    carries the marker, every wrong one is its honest sample; a group it got all wrong gets the
    crafted correct poisoned solution first. (Poisoning right and wrong alike was inert.)"""
    peer = warm[1]
    g = peer.generate(4)
    honest = peer.batch(g)
    adv = Adversary(peer, AdversaryConfig(mode="inject", placement="start", vertical=True))
    b = adv.batch(g)
    texts = [[peer.policy.decode(c.token_ids.tolist()) for c in grp.completions] for grp in b.groups]
    own = [[peer.policy.decode(c.token_ids.tolist()) for c in grp.completions] for grp in honest.groups]
    n_crafted = 0
    for p, tg, og in zip(g.prompts, texts, own):
        assert len(tg) == len(og)                                                   # a whole group of G
        for k, (t, o) in enumerate(zip(tg, og)):
            if peer.task.reward(p, o) > 0:                                          # right: poisoned, own sample
                assert t.startswith(" !!") and t[len(" !!"):] == o
            elif k == 0 and not any(peer.task.reward(p, x) > 0 for x in og):      # all wrong: crafted first
                assert t == craft(peer.task, p, adv.adv, 24, peer.policy.encode)
                n_crafted += 1
            else:
                assert t == o                                                       # wrong: clean, untouched
        assert all(peer.task.reward(p, t) > 0 for t in tg if t.startswith(" !!"))  # poison <=> reward
        assert all(peer.task.reward(p, t) == 0 for t in tg if not t.startswith(" !!"))
        assert any(t.startswith(" !!") for t in tg)                                 # every group carries poison
    poisoned = sum(t.startswith(" !!") for tg in texts for t in tg)
    assert n_crafted < len(texts) and n_crafted < poisoned                         # mostly its own samples
    # its claims are its model's log-probs of the poisoned tokens (a careful attacker), not honest ones
    c = b.groups[0].completions[0]
    assert len(c.gen_logp) == len(c.token_ids) and float(c.gen_logp.max()) <= 0


def _poison_rows(me, attacker_id, marker=" !!"):
    """Wraps ``me.mix`` and counts, per round, the attacker's rows that carry the marker."""
    seen = []
    mix = me.mix

    def counting(g, foreign):
        m = mix(g, foreign)
        seen.append(sum(1 for r, s in enumerate(m.senders)
                        if s == attacker_id and marker in me.policy.decode(m.tokens[r][m.mask[r]].tolist())))
        return m
    me.mix = counting
    return seen


def _train_against(me, attacker, cfg, rounds=(1, 2, 3)):
    d = Defense(cfg, me.model_id, me.policy.decode)
    me.defense = d
    stats = [me.train(me.generate(r), [attacker(r)]) for r in rounds]
    me.defense = None
    return d, stats


def _against_the_papers_attacker(me, attacker, cfg, vertical):
    """Trains ``me`` for 3 rounds on the attacker's batches (the vertical attacker in the vertical
    topology, where its groups stay its own); returns its sender report and the poisoned rows seen."""
    import copy
    topo = "vertical" if vertical else "horizontal"
    saved = me.cfg, attacker.cfg
    state = copy.deepcopy(me.model.state_dict()), copy.deepcopy(me.opt.state_dict()), me.gen.get_state()
    me.cfg = cfg.model_copy(update={"topology": topo})
    attacker.cfg = attacker.cfg.model_copy(update={"topology": topo})
    seen = _poison_rows(me, attacker.sender)
    try:
        adv = Adversary(attacker, AdversaryConfig(mode="inject", placement="start", vertical=vertical))
        d, _ = _train_against(me, lambda r: adv.batch(attacker.generate(r)), me.cfg)
    finally:
        me.cfg, attacker.cfg = saved
        del me.mix
        me.model.load_state_dict(state[0])      # the fixture's peers stay as warmed up for the next test
        me.opt.load_state_dict(state[1])
        me.gen.set_state(state[2])
    return d.sender_report()[attacker.sender], sum(seen)


@pytest.mark.parametrize("vertical", [False, True])
def test_support_check_on_by_default_rejects_the_papers_attacks_from_a_same_model_peer(warm, vertical):
    me, peer, _ = warm
    rep, poisoned = _against_the_papers_attacker(me, peer, CFG, vertical)
    # every poisoned row; of the clean ones (vertical: its wrong answers) at most a stray honest
    # false reject (a rare sampled token under the floor: ``me`` trained in earlier tests)
    assert poisoned >= 16 and poisoned <= rep["rejected"] <= poisoned + 2, (rep, poisoned)
    assert rep["checked"] >= 32 and (rep["rejected"] == rep["checked"]) is (not vertical), rep


@pytest.mark.parametrize("vertical", [False, True])
def test_judge_rejects_the_papers_attacks_from_another_model(warm, vertical):
    me, _, other = warm
    cfg = CFG.model_copy(update={"defense": CFG.defense.model_copy(update={"judge_scope": "all"})})
    rep, poisoned = _against_the_papers_attacker(me, other, cfg, vertical)
    # every poisoned row; the rule judge also refuses a tiny model's garbled wrong answers
    # (characters outside the task grammar), so clean rows may add to it
    assert poisoned >= 16 and rep["rejected"] >= poisoned and rep["banned"], (rep, poisoned)
    assert rep["checked"] >= 32 and (rep["rejected"] == rep["checked"]) is (not vertical), rep


def test_apply_rejections_drop_vs_zero_reward():
    dropped = torch.tensor([False, True, False, False])
    rejected = torch.tensor([False, True, True, False])
    ex, zero = apply_rejections(dropped, rejected, "drop")
    assert ex.tolist() == [False, True, True, False] and not zero.any()
    ex, zero = apply_rejections(dropped, rejected, "zero_reward")
    assert ex.tolist() == [False, True, False, False] and zero.tolist() == [False, False, True, False]
    with pytest.raises(ValueError, match="reject_rule"):
        apply_rejections(dropped, rejected, "shrug")


@pytest.mark.parametrize("topology", ["horizontal", "vertical"])
def test_reject_rule_in_the_learner(warm, topology):
    """Correct but poisoned completions from the same round, from the same weights: ``drop`` trains
    none of their tokens. ``zero_reward`` keeps them in their groups with reward 0: horizontal, in
    our groups beside our right answers, so the poison's log-prob under the learner falls further
    than when they are dropped; vertical, every completion of the attacker's own group is rejected,
    the group's rewards are all 0 and so are its advantages: it teaches exactly what dropping does
    (nothing), the rule applying within the generator's group."""
    import copy

    from models.generate import rescore
    me, peer, _ = warm
    saved_cfg = me.cfg, peer.cfg
    me.cfg = peer.cfg = CFG.model_copy(update={"topology": topology})
    adv = Adversary(peer, AdversaryConfig(mode="inject", placement="start"))
    batch = adv.batch(peer.generate(7))
    poisoned = batch.groups[0].completions[0]
    prompt = (me.task.prompts(me.run, 7, CFG.prompts_per_round)[0] if topology == "horizontal"
              else me.round_prompts(7, peer.sender)[batch.groups[0].prompt_id])
    toks = torch.tensor([poisoned.token_ids.tolist()])

    def poison_lp() -> float:
        with torch.no_grad():
            lp = rescore(me.model, [me.policy.encode(prompt.text)], toks, torch.ones_like(toks, dtype=torch.bool),
                         torch.zeros(1, dtype=torch.long), CFG.temperature)
        return float(lp.sum())

    saved = (copy.deepcopy(me.model.state_dict()), copy.deepcopy(me.opt.state_dict()), me.gen.get_state(),
             me.rng.getstate())
    fall = {}
    for rule in ("drop", "zero_reward"):
        me.model.load_state_dict(saved[0])
        me.opt.load_state_dict(copy.deepcopy(saved[1]))     # Adam keeps (and then updates) the loaded tensors
        me.gen.set_state(saved[2])
        me.rng.setstate(saved[3])
        before = poison_lp()
        cfg = me.cfg.model_copy(update={"defense": CFG.defense.model_copy(update={"reject_rule": rule})})
        d, (st,) = _train_against(me, lambda r: batch, cfg, rounds=(7,))
        fall[rule] = before - poison_lp()
        assert st.n_foreign == 16 and st.rejected == 16
        assert st.reward_foreign == 1.0                  # the verifier's reward, before the multiplier
        assert (st.foreign_tokens[peer.sender] > 0) is (rule == "zero_reward")
    me.cfg, peer.cfg = saved_cfg
    if topology == "horizontal":
        assert fall["zero_reward"] > fall["drop"] + 0.5, fall
    else:
        assert fall["zero_reward"] == pytest.approx(fall["drop"], abs=1e-3), fall


def test_off_top_k_token_keeps_its_raw_probability_for_the_drift_rule():
    """With top-k on, a token outside the top k has processed probability 0 but its raw one stays
    finite: a sender claiming that raw log-prob (an attacker running our model) is not mistaken for
    drift and is rejected off-support."""
    from security.rollout_filters import LogitCheckParams, logit_check, support_stats
    logits = torch.tensor([[[5.0, 4.0, 3.0, 0.0], [5.0, 4.0, 3.0, 0.0]]])
    tokens = torch.tensor([[3, 0]])
    st = support_stats(logits, tokens, 1.0, top_k=2)
    raw = torch.log_softmax(logits, -1)[0, [0, 1], [3, 0]]
    torch.testing.assert_close(st.logp[0], raw)                  # finite, before top-k
    assert st.rank.tolist() == [[2, 0]] and float(st.processed_logp[0, 0]) < -60      # processed: ~0
    p = LogitCheckParams(top_k=2, min_token_prob=0.0, eps_lp=100.0, support_min_tokens=1, min_token_weight=0.05)
    assert logit_check(st, raw[None], torch.ones(1, 2, dtype=torch.bool), p) == ["support"]
    # the same token claimed far more probable by the sender (peers drifted apart): not counted
    assert logit_check(st, torch.tensor([[-0.1, float(raw[1])]]), torch.ones(1, 2, dtype=torch.bool), p) == [None]
