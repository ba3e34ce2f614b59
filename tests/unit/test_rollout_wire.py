"""rl/rollout.py: 8 bytes per token, round trip, signing bytes, rejections with reasons."""

import dataclasses
import struct

import numpy as np
import pytest

from rl.rollout import (BYTES_PER_TOKEN, SIGN_DOMAIN, Completion, Expect, PromptGroup,
                        RolloutBatch, RolloutRejected, check, decode, encode, parse,
                        signing_bytes)

PIDS = [bytes([i]) * 32 for i in range(3)]
EX = Expect(run="r1", round=7, tokenizer_hash="tok", temperature=1.0, vocab_size=256,
            max_tokens=16, prompt_ids=frozenset(PIDS), max_completions_per_group=4)


def _batch(lengths=((3, 5), (16,)), **kw) -> RolloutBatch:
    rng = np.random.default_rng(0)
    groups = [PromptGroup(PIDS[g], [Completion(rng.integers(0, 256, n),
                                               -rng.random(n).astype(np.float32), n == 16)
                                    for n in ls])
              for g, ls in enumerate(lengths)]
    fields = dict(run="r1", round=7, sender="peerA", tokenizer_hash="tok", temperature=1.0,
                  groups=groups, config_hash="cfg", model_id="m")
    fields.update(kw)
    return RolloutBatch(**fields)


def _header_len(b: RolloutBatch) -> int:
    return len(encode(dataclasses.replace(b, groups=[])))


def test_round_trip_and_eight_bytes_per_token():
    b = _batch()
    data = encode(b)
    out = decode(data)
    assert out.run == "r1" and out.round == 7 and out.sender == "peerA"
    assert out.tokenizer_hash == "tok" and out.temperature == 1.0 and out.config_hash == "cfg"
    for g0, g1 in zip(b.groups, out.groups):
        assert g0.prompt_id == g1.prompt_id
        for c0, c1 in zip(g0.completions, g1.completions):
            assert np.array_equal(c0.token_ids, c1.token_ids) and c1.token_ids.dtype == np.int32
            assert np.array_equal(c0.gen_logp, c1.gen_logp) and c1.gen_logp.dtype == np.float32
            assert c0.truncated == c1.truncated
    # payload: 8 bytes per token; per group 2+32+2 bytes, per completion 5 bytes of framing
    n_tok, n_comp = b.n_tokens(), 3
    framing = _header_len(b) + 2 * (2 + 32 + 2) + 5 * n_comp
    assert len(data) - framing == BYTES_PER_TOKEN * n_tok == 8 * 24
    longer = _batch(lengths=((3, 5), (16,), (10,)))
    assert len(encode(longer)) - len(data) == (2 + 32 + 2) + 5 + 8 * 10
    assert encode(decode(data)) == data                               # deterministic


def test_signing_bytes_canonical_and_tamper_sensitive():
    b = _batch()
    sb = signing_bytes(b)
    assert sb.startswith(SIGN_DOMAIN) and len(sb) == len(SIGN_DOMAIN) + 32
    assert signing_bytes(decode(encode(b))) == sb
    t = decode(encode(b))
    t.groups[0].completions[0].gen_logp[0] -= 1.0
    assert signing_bytes(t) != sb
    assert signing_bytes(dataclasses.replace(b, round=8)) != sb


@pytest.mark.parametrize("mutate,category,needle", [
    (lambda b: dataclasses.replace(b, tokenizer_hash="other"), "schema", "tokenizer_hash"),
    (lambda b: dataclasses.replace(b, temperature=0.7), "schema", "temperature"),
    (lambda b: dataclasses.replace(b, temperature=float("nan")), "schema", "temperature"),
    (lambda b: dataclasses.replace(b, round=6), "stale", "round"),
    (lambda b: dataclasses.replace(b, run="r2"), "schema", "run"),
    (lambda b: dataclasses.replace(b, groups=[]), "schema", "no prompt groups"),
])
def test_header_mismatches_rejected_with_reason(mutate, category, needle):
    batch, err = parse(encode(mutate(_batch())), EX)
    assert batch is None and err.category == category and needle in err.reason


def _with_completion(ids, lps, **kw):
    b = _batch()
    b.groups[0].completions[0] = Completion(np.asarray(ids), np.asarray(lps, np.float32))
    return b


@pytest.mark.parametrize("ids,lps,needle", [
    ([1, 256, 3], [-1, -1, -1], "outside the vocabulary"),
    ([1, -1, 3], [-1, -1, -1], "outside the vocabulary"),
    ([1, 2, 3], [-1, float("nan"), -1], "non-finite"),
    ([1, 2, 3], [-1, float("-inf"), -1], "non-finite"),
    ([1, 2, 3], [-1, 0.5, -1], "positive log-prob"),
    ([], [], "empty completion"),
])
def test_completion_content_rejected_with_reason(ids, lps, needle):
    batch, err = parse(encode(_with_completion(ids, lps)), EX)
    assert batch is None and err.category == "schema" and needle in err.reason, err


def test_caps_prompt_ids_sender_and_counts():
    over = _batch(lengths=((3,), (17,)))
    _, err = parse(encode(over), EX)
    assert "cap 16" in err.reason                                   # refused while decoding
    assert "cap 16" in check(over, EX).reason                        # and by check alone
    stranger = _batch()
    stranger.groups[0].prompt_id = b"\x09" * 32
    assert "not one of round 7" in check(stranger, EX).reason
    dup = _batch()
    dup.groups[1].prompt_id = dup.groups[0].prompt_id
    assert "repeated" in check(dup, EX).reason
    many = _batch(lengths=((1, 1, 1, 1, 1),))
    assert "5 completions > 4" in check(many, EX).reason
    assert "came from" in check(_batch(), EX, sender="peerB").reason
    assert check(_batch(), EX, sender="peerA") is None
    assert check(_batch(), dataclasses.replace(EX, config_hash="zzz")).reason.startswith(
        "config_hash")


def test_malformed_bytes_never_raise_through_parse():
    data = encode(_batch())
    for bad in (b"", b"XXXX" + data[4:], data[:-1], data + b"\x00", data[:40],
                data[:4] + b"\x02" + data[5:]):
        batch, err = parse(bad, EX)
        assert batch is None and isinstance(err, RolloutRejected) and err.reason
    # a huge claimed token count is refused before allocating
    head = data[:_header_len(_batch()) - 4] + struct.pack("<I", 1)
    bogus = head + struct.pack("<H", 32) + PIDS[0] + struct.pack("<H", 1) + \
        struct.pack("<BI", 0, 2**31)
    _, err = parse(bogus, dataclasses.replace(EX, max_tokens=2**32))
    assert "truncated" in err.reason
    with pytest.raises(RolloutRejected):
        decode(data[:-3])


def test_encode_refuses_length_mismatch():
    b = _batch()
    b.groups[0].completions[0].gen_logp = np.zeros(1, np.float32)
    with pytest.raises(ValueError, match="log-probs"):
        encode(b)
    assert "log-probs" in check(b, EX).reason
