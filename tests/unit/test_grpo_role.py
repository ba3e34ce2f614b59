"""Round-logic pieces of the grpo role: signed batches, bus shards, the validating inbox (refusals
counted by reason, per-sender ignore window), the round config hash, foreign selection, one
learner step over mixed groups, the run knobs and the role's size, and the exchange policy
(rl/grpo_peers.py: collect, publish) over a fake DHT index. Pure CPU, no network."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from models import ModelConfig
from rl import rollout as RO
from rl.grpo_config import GRPOConfig
from rl.grpo_exchange import Inbox, RolloutServicer, Signed, decode_shard, open_signed, reason_of, shards, \
    sign_batch
from rl.learner import Learner
from rl.rollout import Completion, Expect, PromptGroup, RolloutBatch, RolloutRejected
from security.keys import generate_key, peer_id_str

RUN = "unit"
TOKHASH = "tok"


def _batch(sender: str, round_: int = 3, temperature: float = 0.7, groups: int = 2, n: int = 5,
           tokenizer_hash: str = TOKHASH, config_hash: str = "cfg") -> RolloutBatch:
    gs = []
    for g in range(groups):
        comps = [Completion(np.arange(n, dtype=np.int32) + 40 + c, -np.full(n, 0.5, np.float32))
                 for c in range(2)]
        gs.append(PromptGroup(hashlib.sha256(b"p%d" % g).digest(), comps))
    return RolloutBatch(RUN, round_, sender, tokenizer_hash, temperature, gs, config_hash, "m")


def _expect(round_: int = 3) -> Expect:
    return Expect(run=RUN, round=round_, tokenizer_hash=TOKHASH, temperature=0.7, vocab_size=256, max_tokens=24,
                  prompt_ids=frozenset(hashlib.sha256(b"p%d" % g).digest() for g in range(4)),
                  max_completions_per_group=8, config_hash="cfg")


@pytest.fixture
def key():
    return generate_key()


def test_signed_batch_verifies_and_tampering_fails(key):
    pid = peer_id_str(key)
    s = sign_batch(key, _batch(pid))
    batch, err = open_signed(s.body, s.signature, _expect(), pid)
    assert err is None and batch.sender == pid and batch.n_tokens() == 20
    # one flipped log-prob bit: the signature no longer verifies
    body = bytearray(s.body)
    body[-1] ^= 0x01
    batch, err = open_signed(bytes(body), s.signature, _expect(), pid)
    assert batch is None and reason_of(err) == "signature"
    # impersonation: a batch naming another peer, signed by us
    other = peer_id_str(generate_key())
    forged = sign_batch(key, _batch(other))
    batch, err = open_signed(forged.body, forged.signature, _expect(), other)
    assert batch is None and reason_of(err) == "signature"
    # a batch naming a sender other than the one it came from
    batch, err = open_signed(s.body, s.signature, _expect(), other)
    assert batch is None and reason_of(err) == "schema" and "came from" in err.reason


@pytest.mark.parametrize("change,reason", [
    (dict(round_=2), "stale"), (dict(tokenizer_hash="other"), "config"), (dict(temperature=1.0), "config"),
    (dict(config_hash="x"), "config"), (dict(n=30), "schema")])
def test_refusals_are_classified(key, change, reason):
    pid = peer_id_str(key)
    s = sign_batch(key, _batch(pid, **change))
    batch, err = open_signed(s.body, s.signature, _expect(), pid)
    assert batch is None and reason_of(err) == reason, err


def test_malformed_bytes_rejected_without_raising(key):
    pid = peer_id_str(key)
    s = sign_batch(key, _batch(pid))
    for body in (b"", b"SNRB", s.body[:-3], s.body + b"\0", b"\x80\x04pickle"):
        batch, err = open_signed(body, s.signature, _expect(), pid)
        assert batch is None and reason_of(err) == "schema"


def test_inbox_counts_refusals_and_ignores_a_bad_sender(key):
    pid = peer_id_str(key)
    counted = []
    inbox = Inbox("me", max_rejections=3, window=5, on_reject=counted.append)
    good = sign_batch(key, _batch(pid))
    assert inbox.offer(good, pid, _expect()) is not None
    stale = sign_batch(key, _batch(pid, round_=1))
    hot = sign_batch(key, _batch(pid, temperature=1.3))
    assert inbox.offer(stale, pid, _expect()) is None
    assert inbox.offer(hot, pid, _expect()) is None
    assert counted == ["stale", "config"]
    assert inbox.offer(Signed(b"junk", good.signature), pid, _expect()) is None
    assert counted[-1] == "schema"
    # 3 refusals within the window: the sender is ignored, even with a good batch
    assert inbox.banned(pid, 3)
    assert inbox.offer(good, pid, _expect()) is None and counted[-1] == "quota"
    assert not inbox.banned(pid, 8)
    # the earlier good batch is still there, once; own messages are never taken
    assert inbox.offer(sign_batch(key, _batch("me")), "me", _expect()) is None
    got = inbox.take(3)
    assert [b.sender for b in got] == [pid] and len(got[0].groups) == 2
    assert inbox.take(3) == []


def test_inbox_digest_mismatch_and_duplicate_groups(key):
    pid = peer_id_str(key)
    counted = []
    inbox = Inbox("me", on_reject=counted.append)
    s = sign_batch(key, _batch(pid))
    assert inbox.offer(s, pid, _expect(), digest="0" * 64) is None and counted == ["digest"]
    assert inbox.offer(s, pid, _expect(), digest=hashlib.sha256(s.body).hexdigest()) is not None
    assert inbox.offer(s, pid, _expect()) is not None  # same groups again (bus + fetch): kept once
    (merged,) = inbox.take(3)
    assert len(merged.groups) == 2


def test_shards_fit_the_cap_and_each_verifies(key):
    pid = peer_id_str(key)
    batch = _batch(pid, groups=4, n=20)
    one = len(RO.encode(_batch(pid, groups=1, n=20))) + 68
    msgs = shards(key, batch, cap=2 * one)
    assert len(msgs) == 2 and all(len(m) <= 2 * one for m in msgs)
    inbox = Inbox("me")
    for m in msgs:
        s = decode_shard(m)
        assert inbox.offer(s, pid, _expect()) is not None
    (merged,) = inbox.take(3)
    assert [g.prompt_id for g in merged.groups] == [g.prompt_id for g in batch.groups]
    with pytest.raises(ValueError, match="over the rollouts topic cap"):
        shards(key, batch, cap=one - 10)
    with pytest.raises(RolloutRejected):
        decode_shard(b"SNRB" + b"\0" * 80)


def test_servicer_keeps_last_rounds():
    sv = RolloutServicer(RUN, keep=2)
    for r in range(4):
        sv.put(r, Signed(b"b%d" % r, b"s"))
    assert sorted(sv._batches) == [2, 3]


def test_round_config_hash_covers_swarm_fields_only():
    """G12: another T, top-p, top-k (or B, cap, round length, task, tokenizer, chat template) is
    another config_hash; learner knobs are not in it."""
    base = GRPOConfig().config_hash("tok")
    assert GRPOConfig(mode="solo", lr=1, C=3, delta=1, foreign_per_prompt=1).config_hash("tok") == base
    for change in (dict(temperature=1.0), dict(top_p=0.9), dict(top_k=5), dict(prompts_per_round=4),
                   dict(max_completion_tokens=30), dict(round_s=9), dict(max_operand=20),
                   dict(task="rgym")):
        assert GRPOConfig(**change).config_hash("tok") != base, change
    assert GRPOConfig().config_hash("tok2") != base
    assert GRPOConfig().config_hash("tok", "template") != base
    assert RO.WIRE_VERSION == 1  # = rl.grpo_config.WIRE_VERSION


def test_run_knobs_share_the_training_names_and_keep_the_old_one():
    """``[grpo]`` is a RunSettings: exit_after (once exit_after_rounds), eval_every, torch_threads;
    checkpoint_every is refused (the role writes none); run knobs are not in config_hash."""
    assert GRPOConfig.model_validate({"exit_after_rounds": 12}).exit_after == 12
    assert GRPOConfig(exit_after=3, eval_every=0, torch_threads=1).config_hash("tok") == \
        GRPOConfig().config_hash("tok")
    with pytest.raises(ValueError, match="same setting"):
        GRPOConfig.model_validate({"exit_after_rounds": 1, "exit_after": 2})
    with pytest.raises(ValueError, match="writes no checkpoints"):
        GRPOConfig(checkpoint_every=5)
    assert GRPOConfig().eval_every == 5


def test_tally_reward_span_and_role_class_size():
    """The finish figures average the first and last (up to) 5 rounds; the role stays an engine
    plus round policy: at most 20 instance attributes, base included."""
    import ast
    import inspect
    import textwrap

    from node.roles import RoleBase
    from node.training import TrainingRole
    from rl.grpo_metrics import Tally
    from rl.grpo_role import GRPOCard, GRPORole

    t = Tally(rewards=[0.0] * 20 + [1.0] * 20)
    assert t.reward_span() == (0.0, 1.0)
    assert Tally(rewards=[0.5]).reward_span() == (0.5, 0.5) and Tally().reward_span() == (0.0, 0.0)
    attrs = set()
    for cls in (GRPORole, TrainingRole, RoleBase):
        for node in ast.walk(ast.parse(textwrap.dedent(inspect.getsource(cls)))):
            if isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) and \
                    isinstance(node.value, ast.Name) and node.value.id == "self":
                attrs.add(node.attr)
    assert 10 < len(attrs) <= 20, sorted(attrs)
    assert GRPOCard(round=3, reward=0.5).details() == {"round": 3, "reward": 0.5}
    assert len(GRPOCard.model_fields) <= 16   # a node card carries at most 16 details


def _learners(mode: str):
    cfg = GRPOConfig(mode=mode, prompts_per_round=4, completions_per_prompt=3, warmup_target_acc=0,
                     max_completion_tokens=8, heldout_size=4, foreign_per_prompt=2, per_sender_per_prompt=1)
    a = Learner(cfg, ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=32), 0, RUN, "a")
    b = Learner(cfg, ModelConfig(d_model=48, n_layers=1, n_heads=4, max_seq_len=32), 1, RUN, "b")
    c = Learner(cfg, ModelConfig(d_model=32, n_layers=2, n_heads=2, max_seq_len=32), 2, RUN, "c")
    return a, b, c


@pytest.mark.parametrize("mode", ["ftis", "uncorrected", "solo"])
def test_learner_step_mixes_foreign_rollouts(mode):
    torch.manual_seed(0)
    a, b, c = _learners(mode)
    ga, gb, gc = a.generate(5), b.generate(5), c.generate(5)
    assert [p.prompt_id for p in ga.prompts] == [p.prompt_id for p in gb.prompts]  # same prompts
    foreign = [RO.decode(RO.encode(b.batch(gb))), RO.decode(RO.encode(c.batch(gc)))]
    before = [p.detach().clone() for p in a.model.parameters()]
    st = a.train(ga, foreign)
    assert st.n_local == 12
    if mode == "solo":
        assert st.n_foreign == 0 and st.senders == 0
    else:  # per_sender_per_prompt 1, F = 2: one from each sender per prompt
        assert st.n_foreign == 8 and st.senders == 2
    assert np.isfinite(st.loss)
    changed = any(not torch.equal(x, y) for x, y in zip(before, a.model.parameters()))
    assert changed or all(r in (0.0, 1.0) for r in ga.rewards)


def test_learner_batch_is_what_the_sampler_produced():
    a, _, _ = _learners("ftis")
    g = a.generate(1)
    batch = RO.decode(RO.encode(a.batch(g)))
    assert len(batch.groups) == 4 and all(len(gr.completions) == 3 for gr in batch.groups)
    first = batch.groups[0].completions[0]
    assert first.token_ids.tolist() == g.samples.completion(0)
    assert len(RO.encode(batch)) - len(RO.encode(RolloutBatch(RUN, 1, "a", batch.tokenizer_hash, 0.7, [
        PromptGroup(gr.prompt_id, [Completion(np.zeros(0, np.int32), np.zeros(0, np.float32), c.truncated)
                                   for c in gr.completions]) for gr in batch.groups],
        batch.config_hash, batch.model_id))) == 8 * batch.n_tokens()
    assert RO.check(batch, Expect(RUN, 1, a.tokenizer_hash, 0.7, 256, 8, config_hash=a.config_hash)) is None


def test_foreign_rewards_are_recomputed_from_the_tokens():
    """G15: the receiver scores a foreign completion from its token ids alone; nothing the sender
    could claim enters the reward."""
    a, b, _ = _learners("ftis")
    g = a.generate(2)
    p = g.prompts[0]
    right = a.policy.encode(a.task.reference(p))
    wrong = a.policy.encode(a.task.reference(p).replace("=>", "=>1"))
    foreign = [RolloutBatch(RUN, 2, sender, a.tokenizer_hash, 0.7, [PromptGroup(p.prompt_id, [
        Completion(np.array(ids, np.int32), np.full(len(ids), -0.1, np.float32))])], a.config_hash, "m")
        for sender, ids in (("b", right), ("c", wrong))]
    m = a.mix(g, foreign)
    got = dict(zip(m.senders[m.n_local:], m.rewards[m.n_local:]))
    assert got == {"b": 1.0, "c": 0.0}
    assert bool(m.foreign[m.n_local:].all()) and int(m.group[m.n_local]) == 0


def test_content_filters_drop_foreign_rows_from_the_step():
    """The seam for rollout filters: a filter sees the mixed rows and the one re-scoring pass;
    rows it rejects leave the advantages and the loss (own rows are never dropped)."""
    a, b, c = _learners("ftis")
    ga, gb = a.generate(4), b.generate(4)
    seen = {}

    def reject_all(mixed, logp):
        seen["shape"] = tuple(logp.shape)
        return torch.zeros(len(mixed.rewards), dtype=torch.bool)

    a.filters.append(reject_all)
    st = a.train(ga, [RO.decode(RO.encode(b.batch(gb)))])
    assert st.rejected == st.n_foreign == 4 and seen["shape"][0] == st.n_local + st.n_foreign
    assert st.filtered == 0


def test_warmup_is_cached_by_its_settings(tmp_path):
    cfg = GRPOConfig(prompts_per_round=2, completions_per_prompt=2, max_completion_tokens=8, heldout_size=4,
                     warmup_target_acc=1.0, warmup_max_steps=3, eval_samples=1)
    mc = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    first = Learner(cfg, mc, 0, RUN, "a")
    assert first.warmup(tmp_path)[0] == 3
    again = Learner(cfg, mc, 0, RUN, "a")
    steps, acc = again.warmup(tmp_path)
    assert steps == 3 and acc == first.accuracy()
    assert all(torch.equal(x, y) for x, y in zip(first.model.state_dict().values(), again.model.state_dict().values()))
    other = Learner(cfg, mc, 1, RUN, "a")             # another seed: another key, warmed afresh
    assert other.warmup_key() != first.warmup_key()
    assert len(list(tmp_path.glob("grpo-warmup-*.pt"))) == 1


def test_learner_runs_under_the_configured_precision():
    """device.precision = "bf16" (autocast; weights stay fp32): a round samples, re-scores and
    steps; sampled and re-scored log-probs agree to bf16 accuracy."""
    cfg = GRPOConfig(prompts_per_round=2, completions_per_prompt=2, max_completion_tokens=8, heldout_size=2,
                     warmup_target_acc=0)
    learner = Learner(cfg, ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=32), 0, RUN, "a",
                      device="cpu", precision="bf16")
    g = learner.generate(1)
    mixed = learner.mix(g, [])
    with torch.no_grad():
        lp = learner.rescore(mixed)
    m = learner.train_mask(mixed)
    assert torch.allclose(lp[m], mixed.gen_logp[m], atol=0.1)
    st = learner.train(g, [])
    assert np.isfinite(st.loss) and all(p.dtype == torch.float32 for p in learner.model.parameters())


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("precision", ["fp32", "bf16"])
def test_learner_samples_and_trains_on_cuda(precision):
    """The same round on the GPU: sampling (KV cache), re-scoring and the step stay on the device;
    the published batch is host data; a CPU peer accepts it."""
    cfg = GRPOConfig(prompts_per_round=4, completions_per_prompt=2, max_completion_tokens=8, heldout_size=4,
                     warmup_target_acc=0)
    mc = ModelConfig(d_model=32, n_layers=1, n_heads=2, max_seq_len=32)
    gpu = Learner(cfg, mc, 0, RUN, "g", device="cuda", precision=precision)
    cpu = Learner(cfg, mc, 1, RUN, "c")
    assert next(gpu.model.parameters()).is_cuda
    g = gpu.generate(2)
    batch = RO.decode(RO.encode(gpu.batch(g)))
    assert RO.check(batch, Expect(RUN, 2, cpu.tokenizer_hash, cfg.temperature, 256, 8,
                                  config_hash=cpu.config_hash)) is None
    st = gpu.train(g, [RO.decode(RO.encode(cpu.batch(cpu.generate(2))))])
    assert np.isfinite(st.loss) and st.n_foreign > 0


# ---------------- the rollout exchange policy (rl/grpo_peers.py), with a fake DHT index ----------------
def _peers(key, monkeypatch, entries, fetched):
    """A RolloutPeers with a real supervisor and inbox; the DHT index and the gRPC fetch are fakes."""
    from types import SimpleNamespace

    from node.supervisor import Supervisor
    from rl import grpo_peers

    async def read(dht, run, r, timeout):
        return entries

    async def publish(*args, **kwargs):
        raise OSError("dht down")

    monkeypatch.setattr(grpo_peers.INDEX, "read", read)
    monkeypatch.setattr(grpo_peers.INDEX, "publish", publish)
    config = SimpleNamespace(run_id=RUN, grpc=SimpleNamespace(max_message_bytes=1 << 20))
    ctx = SimpleNamespace(config=config, peer_id="me", eventbus=None, supervisor=Supervisor(), grpc_addr="127.0.0.1:1",
                          membership=SimpleNamespace(dht=None))
    peers = grpo_peers.RolloutPeers(ctx, GRPOConfig(transport="dht", temperature=0.7, max_completion_tokens=24,
                                                    prompts_per_round=4), key)
    prompts = [SimpleNamespace(prompt_id=hashlib.sha256(b"p%d" % g).digest()) for g in range(4)]
    peers.learner = SimpleNamespace(round_prompts=lambda r, peer=None: {p.prompt_id: p for p in prompts},
                                    tokenizer_hash=TOKHASH, policy=SimpleNamespace(vocab_size=256), config_hash="cfg")

    async def fetch(addr, pid, run, r, me, timeout):
        return fetched.get(pid)

    peers.fetcher.fetch = fetch
    return peers


async def test_collect_fetches_indexed_peers_until_the_deadline(key, monkeypatch):
    import time

    from rl.grpo_exchange import RolloutIndexEntry

    other = generate_key()
    pid = peer_id_str(other)
    good = sign_batch(other, _batch(pid))
    entries = {pid: RolloutIndexEntry(round=3, digest=hashlib.sha256(good.body).hexdigest(), n_groups=2,
                                      n_tokens=20, grpc_addr="127.0.0.1:2"),
               "12D3KooWgone": RolloutIndexEntry(round=3, digest="0" * 64, n_groups=1, n_tokens=1,
                                                 grpc_addr="127.0.0.1:3"),
               "me": RolloutIndexEntry(round=3, digest="0" * 64, n_groups=1, n_tokens=1, grpc_addr="127.0.0.1:1")}
    peers = _peers(key, monkeypatch, entries, {pid: good})
    t0 = time.time()
    got = await peers.collect(3, t0 + 0.4, lambda: False)
    assert [b.sender for b in got] == [pid] and peers.last_collect == (2, 1)   # 2 others listed, 1 fetched
    assert time.time() - t0 >= 0.3          # a peer that never answers does not end the collection early
    got = await peers.collect(3, time.time() + 5, lambda: True)   # stopping: returns at once, nothing new
    assert got == [] and peers.expect(3, pid).prompt_ids == frozenset(peers.learner.round_prompts(3))
    assert peers.expect(3, pid).group_size is None          # horizontal: any share of a group
    await peers.close()


async def test_publish_serves_the_batch_and_a_failure_is_logged_not_fatal(key, monkeypatch, caplog):
    import asyncio

    from rl.grpo_peers import PUBLISH_SLOTS

    peers = _peers(key, monkeypatch, {}, {})
    b = _batch(peer_id_str(key))
    s = sign_batch(key, b)
    peers.publish_in_background(3, s, b)
    assert peers.servicer._batches[3] is s
    await asyncio.sleep(0.05)
    assert peers.ctx.supervisor.failed is None
    assert [r._fields["round"] for r in caplog.records if getattr(r, "event", None) == "grpo_publish_failed"] == [3]

    async def stuck(*args, **kwargs):
        await asyncio.sleep(30)

    monkeypatch.setattr("rl.grpo_peers.INDEX.publish", stuck)
    peers.publish_in_background(4, s, b)
    peers.publish_in_background(4 + PUBLISH_SLOTS, s, b)   # the slot is still busy: logged, not raised
    assert [r._fields["round"] for r in caplog.records if getattr(r, "event", None) == "grpo_publish_failed"] == [3, 12]
    await peers.ctx.supervisor.cancel_all()
