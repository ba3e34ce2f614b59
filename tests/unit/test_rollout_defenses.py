"""Poisoned-rollout defenses (docs/grpo.md, 'Defenses'): the logit / support check, the judges and their cache, the
rejection-rate ban, the per-sender token budget, and the GRPO glue (rl/defense.py) against the
attack harness (rl/adversary.py) on real tiny models. Pure CPU, no network."""

from __future__ import annotations

import hashlib
import math

import numpy as np
import pytest
import torch

from models import ModelConfig
from rl.adversary import Adversary, craft
from rl.defense import Defense
from rl.grpo_config import AdversaryConfig, GRPOConfig
from rl.learner import Learner
from rl.rollout import Completion, PromptGroup, RolloutBatch
from security.judge import ArithJudge, CachedJudge, decide, truncate_middle
from security.rollout_filters import LogitCheckParams, logit_check, support_stats
from security.sender_policy import RejectionRatePolicy, TokenBudget
from tests.tiny_judge import save_tiny_judge


# ---------------- logit / support check on synthetic logits ----------------
def _logits(V=8, L=4):
    """Every position: token 0 at p ~ 0.9, tokens 1-2 share most of the rest, the others ~1e-6."""
    z = torch.full((1, L, V), -12.0)
    z[..., 0], z[..., 1], z[..., 2] = 2.0, -0.5, -0.7
    return z


def test_support_stats_match_the_samplers_processed_distribution():
    from models.generate import processed_logprobs
    z = torch.randn(3, 5, 11)
    toks = torch.randint(0, 11, (3, 5))
    ref = processed_logprobs(z, 0.7, 0, 0.9).gather(-1, toks[..., None]).squeeze(-1)
    st = support_stats(z, toks, 0.7, 0, 0.9)
    fin = torch.isfinite(ref)
    assert torch.equal(fin, torch.isfinite(st.processed_logp))
    assert torch.allclose(st.processed_logp[fin], ref[fin], atol=1e-5)


def test_logit_check_accepts_the_samplers_tokens_and_rejects_each_poison():
    z = _logits()
    p = LogitCheckParams(temperature=1.0, top_p=0.95, support_slack=0.04, min_token_prob=1e-4, eps_lp=1.0,
                         support_min_tokens=2)
    mask = torch.ones(1, 4, dtype=torch.bool)
    honest = torch.tensor([[0, 1, 0, 0]])
    st = support_stats(z, honest, 1.0, 0, 0.95)
    assert logit_check(st, st.processed_logp, mask, p) == [None]
    # an appended off-distribution marker token (p ~ 1e-6): below the floor
    marker = torch.tensor([[0, 0, 0, 5]])
    st = support_stats(z, marker, 1.0, 0, 0.95)
    assert logit_check(st, torch.where(torch.isfinite(st.processed_logp), st.processed_logp,
                                       torch.full_like(st.logp, -1.0)), mask, p) == ["min_prob"]
    # a liar: honest tokens, claimed log-probs -20 (importance weights pushed to C)
    st = support_stats(z, honest, 1.0, 0, 0.95)
    assert logit_check(st, torch.full((1, 4), -20.0), mask, p) == ["logp_mismatch"]
    # claiming *higher* log-probs (-0.05) only shrinks the sender's own weights: not a mismatch
    assert logit_check(st, torch.full((1, 4), -0.05), mask, LogitCheckParams(top_p=0.95, eps_lp=0.2)) == [None]


def test_support_needs_several_off_support_tokens_and_masks_padding():
    V = 8
    z = torch.full((1, 4, V), 0.0)
    z[..., 0] = 6.0                                     # p(0) ~ 0.98: token 1..7 each ~ 0.003 (above the floor)
    p = LogitCheckParams(top_p=0.95, support_slack=0.01, min_token_prob=1e-4, eps_lp=100.0, support_min_tokens=2)
    one_off = torch.tensor([[0, 3, 0, 0]])
    two_off = torch.tensor([[0, 3, 4, 0]])
    mask = torch.ones(1, 4, dtype=torch.bool)
    gen = torch.full((1, 4), -0.02)
    assert logit_check(support_stats(z, one_off, 1.0, 0, 0.95), gen, mask, p) == [None]
    assert logit_check(support_stats(z, two_off, 1.0, 0, 0.95), gen, mask, p) == ["support"]
    padded = mask.clone()
    padded[0, 2:] = False                               # the second off-support token is padding
    assert logit_check(support_stats(z, two_off, 1.0, 0, 0.95), gen, padded, p) == [None]
    p1 = LogitCheckParams(top_p=0.95, support_slack=0.01, min_token_prob=1e-4, eps_lp=100.0, support_min_tokens=1)
    assert logit_check(support_stats(z, one_off, 1.0, 0, 0.95), gen, mask, p1) == ["support"]


def test_a_liar_with_one_off_support_token_is_still_compared_on_the_rest():
    """Was a gap (strict xfail in the vertical topology): a row with fewer off-support tokens than
    ``support_min_tokens`` skipped the claimed log-prob comparison altogether, so a liar claiming
    -20 on every token passed when one of its tokens fell outside the support."""
    V = 8
    z = torch.full((1, 4, V), 0.0)
    z[..., 0] = 6.0
    p = LogitCheckParams(top_p=0.95, support_slack=0.01, min_token_prob=1e-4, eps_lp=1.0, support_min_tokens=2)
    one_off, mask = torch.tensor([[0, 3, 0, 0]]), torch.ones(1, 4, dtype=torch.bool)
    st = support_stats(z, one_off, 1.0, 0, 0.95)
    assert logit_check(st, torch.full((1, 4), -20.0), mask, p) == ["logp_mismatch"]
    truthful = torch.where(torch.isfinite(st.processed_logp), st.processed_logp, st.logp)
    assert logit_check(st, truthful, mask, p) == [None]      # the honest claims of the same row pass


def test_min_token_weight_lets_drift_through_and_still_rejects_a_truthful_or_lying_poisoner():
    """A same-model peer that trained apart samples a token ours finds improbable (p ~ 1e-6) but its
    own sampler found probable (claimed -0.1 nats): with ``min_token_weight`` that is drift (F-TIS
    weight exp(-13.7) teaches nothing) and passes; a poisoner claiming its own model's (low) log-prob
    for the same token is rejected, and a liar claiming -20 everywhere too (its weights go to C)."""
    z = _logits()
    mask = torch.ones(1, 4, dtype=torch.bool)
    marker = torch.tensor([[0, 0, 0, 5]])
    st = support_stats(z, marker, 1.0, 0, 0.95)
    low_claim = torch.where(torch.isfinite(st.processed_logp), st.processed_logp, st.logp)  # truthful: ~ -13.8
    drift_claim = low_claim.clone()
    drift_claim[0, 3] = -0.1                                # the sender's sampler found it probable
    base = dict(temperature=1.0, top_p=0.95, support_slack=0.04, min_token_prob=1e-4, eps_lp=1.0, support_min_tokens=1)
    off = LogitCheckParams(**base)
    on = LogitCheckParams(**base, min_token_weight=0.05)
    assert logit_check(st, drift_claim, mask, off) == ["min_prob"]       # without the weight rule: a false reject
    assert logit_check(st, drift_claim, mask, on) == [None]
    assert logit_check(st, low_claim, mask, on) == ["min_prob"]
    assert logit_check(st, torch.full((1, 4), -20.0), mask, on) == ["min_prob"]
    # off-support tokens alike: counted only when the sender claims them improbable too
    two_off = torch.tensor([[0, 3, 4, 0]])
    zz = torch.full((1, 4, 8), 0.0)
    zz[..., 0] = 6.0
    st2 = support_stats(zz, two_off, 1.0, 0, 0.95)
    p_on = LogitCheckParams(top_p=0.95, support_slack=0.01, min_token_prob=1e-4, eps_lp=100.0, support_min_tokens=2,
                            min_token_weight=0.05)
    assert logit_check(st2, torch.full((1, 4), -0.02), mask, p_on) == [None]     # claimed probable: drift
    assert logit_check(st2, st2.logp, mask, p_on) == ["support"]                  # claimed as improbable as ours


# ---------------- judges ----------------
@pytest.mark.parametrize("task, text, verdict", [
    ("3+4:", "3+4=7=>7\n", "safe"),
    ("1+2+3:", "1+2=3,3+3=6=>6\n", "safe"),
    ("3+4:", "3+4=7=>7 !!\n", "poison"),            # injection: outside the task's alphabet
    ("3+4:", "2+2=5,3+4=7=>7\n", "poison"),         # in-context edit: a false statement added
    ("3+4:", "0+0=0,0+0=0,3+4=7=>7\n", "poison"),   # verbose padding: statements beyond the chain
    ("3+4:", "3+4=7=>7,1+1=3\n", "poison"),         # a statement after the answer
    ("3+4:", "3+4=8=>7\n", "unsound"),              # the chain with wrong arithmetic, right answer
    ("3+4:", "3+5=8=>7\n", "unsound"),              # wrong operand
])
def test_arith_judge_checks_every_step_not_just_the_answer(task, text, verdict):
    assert ArithJudge.verdict(task, text) == verdict
    assert ArithJudge().judge(task, text) is (verdict == "safe")


def test_decision_rule_unparseable_is_unsafe_and_margin_applies():
    assert decide(math.log(0.9), math.log(0.05)) is True
    assert decide(math.log(0.05), math.log(0.9)) is False
    assert decide(math.log(0.2), math.log(0.1)) is False          # p_S + p_U < 0.5: unparseable
    assert decide(math.log(0.5), math.log(0.4), margin=0.5) is False
    assert decide(float("-inf"), float("-inf")) is False


def test_truncation_keeps_head_and_tail():
    out = truncate_middle(list(range(100)), 10, [-1])
    assert len(out) == 10 and out[:4] == [0, 1, 2, 3] and out[-5:] == [95, 96, 97, 98, 99] and -1 in out
    assert truncate_middle([1, 2], 10, [-1]) == [1, 2]


class _Counting:
    name = "counting"

    def __init__(self):
        self.calls = 0

    def judge(self, task, completion):
        self.calls += 1
        return "!!" not in completion


def test_verdict_cache_hits_by_completion_hash():
    inner = _Counting()
    j = CachedJudge(inner, size=2)
    pid = hashlib.sha256(b"p").digest()
    assert j.judge_cached(pid, b"abc", "3+4:", "3+4=7=>7 !!\n") is False
    assert j.judge_cached(pid, b"abc", "3+4:", "3+4=7=>7 !!\n") is False
    assert (inner.calls, j.hits, j.misses) == (1, 1, 1)
    assert j.judge_cached(hashlib.sha256(b"q").digest(), b"abc", "3+4:", "x") is True   # another prompt: new key
    assert j.judge_cached(pid, b"abd", "3+4:", "x") is True                             # evicts the oldest (size 2)
    assert j.judge_cached(pid, b"abc", "3+4:", "3+4=7=>7 !!\n") is False
    assert inner.calls == 4


transformers = pytest.importorskip("transformers")
tokenizers = pytest.importorskip("tokenizers")


@pytest.fixture(scope="module")
def tiny_judge_folder(tmp_path_factory):
    """A tiny random Llama and a word-level tokenizer with a chat template, saved locally (no download)."""
    return save_tiny_judge(tmp_path_factory.mktemp("tiny_judge"), extra_words=(" SAFE", " UNSAFE"))


def test_hf_judge_mechanics_with_a_tiny_random_model(tiny_judge_folder):
    from security.judge import HFJudge
    j = HFJudge(str(tiny_judge_folder), margin=0.0, max_tokens=16, style="one_word")
    assert j.name.startswith("hf:")
    # fixed prompt with per-call random delimiters; the completion is truncated and stripped
    long = "3+4=7" * 40 + "\x07"
    p1, p2 = j.prompt("3+4:", long), j.prompt("3+4:", long)
    assert p1 != p2 and "audit" in p1 and "<|asst|>" in p1 and "\x07" not in p1
    assert "3+4=7" * 10 not in p1                      # cut to 16 judge tokens around the marker
    # the decision is the documented rule over teacher-forced sequence log-probs
    s, u = j.scores(j.prompt("3+4:", "3+4=7=>7\n", delimiter="<<d>>"))
    assert s < 0 and u < 0 and math.isfinite(s) and math.isfinite(u)
    assert j.judge("3+4:", "3+4=7=>7\n") is decide(s, u, 0.0)
    # cached by completion hash: the second identical verdict costs no forward
    cj = CachedJudge(j)
    pid = hashlib.sha256(b"p").digest()
    v1 = cj.judge_cached(pid, b"ids", "3+4:", "3+4=7=>7 !!\n")
    calls = j.calls
    assert cj.judge_cached(pid, b"ids", "3+4:", "3+4=7=>7 !!\n") == v1 and j.calls == calls and cj.hits == 1


def test_hf_judge_never_downloads(tmp_path):
    from security.judge import HFJudge
    with pytest.raises(Exception):
        HFJudge(str(tmp_path / "not-here"))


# ---------------- sender policy ----------------
def test_ban_needs_the_rate_not_a_count():
    t = [0.0]
    p = RejectionRatePolicy(window=256, min_checked=32, ban_rate=0.5, clock=lambda: t[0])
    # an honest peer at 3% rejections: hundreds of rejections over 10,000 checks, never banned
    rng = np.random.default_rng(0)
    for _ in range(10_000):
        assert not p.record("honest", bool(rng.random() < 0.03))
    assert p.rate("honest").total_rejected > 200 and not p.is_banned("honest")
    # 40% rejected: far more rejections than 32, still under the rate: never banned
    for k in range(2000):
        p.record("sloppy", k % 5 < 2)
    assert not p.is_banned("sloppy")
    # always rejected: not before 32 checks, banned at the 32nd
    for k in range(31):
        assert not p.record("liar", True)
    assert not p.is_banned("liar")
    assert p.record("liar", True) and p.is_banned("liar")
    # the ban expires after ban_s
    t[0] += 601
    assert not p.is_banned("liar")


def test_token_budget_caps_a_sender_per_round():
    b = TokenBudget(100)
    assert b.take(1, "a", 60) and not b.take(1, "a", 50) and b.take(1, "a", 40) and not b.take(1, "a", 1)
    assert b.take(1, "b", 100)
    assert b.take(2, "a", 100)                           # a new round, a new budget


# ---------------- the glue against the attack harness, on real tiny models ----------------
CFG = GRPOConfig(max_operand=5, top_p=0.95, max_completion_tokens=24, prompts_per_round=8, heldout_size=20,
                 eval_samples=2, warmup_target_acc=0.15)


@pytest.fixture(scope="module")
def warm(tmp_path_factory):
    cache = tmp_path_factory.mktemp("warm")
    mc = ModelConfig(d_model=32, n_layers=1, n_heads=4, max_seq_len=64)
    torch.set_num_threads(1)
    learners = []
    for i in range(2):
        L = Learner(CFG, mc, 5, "unit", f"peer{i}")
        L.warmup(cache)
        L.gen.manual_seed(100 + i)
        learners.append(L)
    return learners


@pytest.fixture(params=["horizontal", "vertical"])
def topo(warm, request):
    """The warm learners in one ``grpo.topology`` (vertical: the attacker publishes whole groups for
    prompts of its own; the receiver checks them as groups of their own)."""
    saved = [L.cfg for L in warm]
    for L in warm:
        L.cfg = L.cfg.model_copy(update={"topology": request.param})
    yield warm
    for L, cfg in zip(warm, saved):
        L.cfg = cfg


def _defended(L):
    d = Defense(L.cfg, L.model_id, L.policy.decode)
    L.defense = d
    return d


def _rejections(L, attacker, rounds=(1, 2)):
    """Train L on the attacker's batches; returns the defense's per-sender report."""
    d = _defended(L)
    for r in rounds:
        L.train(L.generate(r), [attacker(r)])
    L.defense = None
    return d.sender_report()


@pytest.mark.parametrize("mode, reasons", [
    ("inject", {"min_prob", "support"}),
    ("edit", {"min_prob", "support"}),
    ("fake_logp", {"logp_mismatch"}),
    ("inject+fake_logp", {"min_prob", "support", "logp_mismatch"}),
])
def test_logit_check_rejects_the_crafted_poison_of_a_same_model_peer(topo, mode, reasons):
    """Vertical ``fake_logp`` was a strict xfail: the attacker's own prompts bring 2 of its 32
    crafted completions with 1-2 tokens outside the support, and the claimed log-probs were tested
    only on rows with no off-support token, while ``support`` needs ``support_min_tokens`` (3): such a
    liar passed both. The claims are now compared on the row's on-support tokens."""
    me, peer = topo
    adv = Adversary(peer, AdversaryConfig(mode=mode))
    rep = _rejections(me, lambda r: adv.batch(peer.generate(r)))[peer.sender]
    assert rep["checked"] >= 16 and rep["rejected"] == rep["checked"], rep
    assert set(rep) & {"min_prob", "support", "logp_mismatch"} <= reasons


def test_logit_check_accepts_honest_completions_of_the_same_model(topo):
    me, peer = topo
    rep = _rejections(me, lambda r: peer.batch(peer.generate(r)), rounds=range(10, 30))[peer.sender]
    assert rep["checked"] >= 300 and rep.get("rejected", 0) == 0, rep


def test_crafted_completions_are_correct_and_keep_the_answer(warm):
    L = warm[0]
    p = L.task.prompts("unit", 3, 4)[0]
    for mode, needle in (("inject", " !!"), ("edit", "2+2=5"), ("verbose", "0+0=0")):
        text = craft(L.task, p, AdversaryConfig(mode=mode), CFG.max_completion_tokens, L.policy.encode)
        assert needle in text and L.task.reward(p, text) == 1.0 and len(L.policy.encode(text)) <= 24


def test_judge_path_rejects_poison_of_another_model_and_bans_it(topo):
    me, peer = topo
    d = Defense(me.cfg.model_copy(update={"defense": CFG.defense.model_copy(update={"kind": "judge"})}), me.model_id,
                me.policy.decode)
    me.defense = d
    adv = Adversary(peer, AdversaryConfig(mode="edit"))
    for r in range(1, 6):
        me.train(me.generate(r), [adv.batch(peer.generate(r))])
    me.defense = None
    rep = d.sender_report()[peer.sender]
    assert rep["banned"] and rep["rate"] == 1.0 and rep["judge_poison"] == rep["checked"] >= 32
    assert d.judge_name == "arith-rule-v1" and d.judge.hits > 0     # resent identical poison: cache hits


def test_token_budget_caps_a_verbose_peer(warm):
    me, peer = warm
    cfg = CFG.model_copy(update={"defense": CFG.defense.model_copy(update={"kind": "off"})})
    d = Defense(cfg, me.model_id, me.policy.decode)
    adv = Adversary(peer, AdversaryConfig(mode="verbose"))
    g = peer.generate(1)
    verbose = adv.batch(g)
    honest = peer.batch(g)
    budget = d.budget.per_sender
    assert budget == CFG.prompts_per_round * CFG.per_sender_per_prompt * CFG.max_completion_tokens // 2
    sent = sum(len(c.token_ids) for grp in verbose.groups for c in grp.completions[:CFG.per_sender_per_prompt])
    assert sent > budget
    kept = d.admit(1, [verbose])
    assert sum(len(c.token_ids) for b in kept for grp in b.groups for c in grp.completions) <= budget
    assert d.rejected["quota"] > 0
    # an honest peer's batch fits its budget untouched
    d2 = Defense(cfg, me.model_id, me.policy.decode)
    kept = d2.admit(1, [honest])
    assert sum(len(grp.completions) for b in kept for grp in b.groups) == \
        CFG.prompts_per_round * CFG.per_sender_per_prompt and d2.rejected["quota"] == 0
    # the learner trains on at most the budget from that sender
    me.defense = d2
    st = me.train(me.generate(1), [adv.batch(peer.generate(1))])
    me.defense = None
    assert 0 < st.foreign_tokens[peer.sender] <= budget


def test_banned_sender_is_dropped_unopened_as_quota():
    d = Defense(CFG, "m", lambda ids: "")
    for _ in range(32):
        d.policy.record("x", True)
    b = RolloutBatch("unit", 1, "x", "t", 0.7, [PromptGroup(b"p", [Completion(np.arange(3), -np.ones(3))])], "c", "m")
    assert d.admit(1, [b]) == [] and d.rejected["quota"] == 1
