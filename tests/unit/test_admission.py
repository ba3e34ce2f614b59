"""security.admission: token issue/verify, strict encoding, the `swarmnode admit` CLI."""

from __future__ import annotations

import pytest

from protocol.admission_pb2 import SignedAdmissionToken
from security.admission import (AdmissionRejected, decode_b64, decode_token, issue_token,
                                parse_expires, verify_token)
from security.keys import generate_key, peer_id_str, write_key_file

NOW = 1_800_000_000.0


@pytest.fixture
def keys():
    coord, peer = generate_key(), generate_key()
    return coord, peer_id_str(coord), peer_id_str(peer)


def _issue(coord, peer, **kw):
    args = dict(run_id="run-a", peer_id=peer, expires_at=NOW + 3600, roles=["noloco"], now=NOW, serial=7)
    args.update(kw)
    return issue_token(coord, **args)


def _reason(blob, coord_id, peer, **kw) -> str:
    args = dict(coordinator_peer_id=coord_id, run_id="run-a", peer_id=peer, now=NOW)
    args.update(kw)
    with pytest.raises(AdmissionRejected) as ei:
        verify_token(blob, **args)
    return ei.value.reason


def test_valid_token_verifies(keys):
    coord, coord_id, peer = keys
    blob = _issue(coord, peer)
    tok = verify_token(blob, coordinator_peer_id=coord_id, run_id="run-a", peer_id=peer, role="noloco", now=NOW)
    assert (tok.peer_id, tok.roles, tok.serial, tok.expires_at) == (peer, ("noloco",), 7, int(NOW + 3600))
    assert tok.not_before == int(NOW - 60)
    assert issue_token(coord, run_id="r", peer_id=peer, expires_at=NOW + 10, now=NOW, serial=1) == \
        issue_token(coord, run_id="r", peer_id=peer, expires_at=NOW + 10, now=NOW, serial=1)  # deterministic


def test_rejections_have_distinct_reasons(keys):
    coord, coord_id, peer = keys
    blob = _issue(coord, peer)
    assert _reason(blob, coord_id, peer, now=NOW + 3600) == "expired"
    assert _reason(blob, coord_id, peer, now=NOW - 61) == "not_yet_valid"
    assert _reason(blob, coord_id, peer, run_id="run-b") == "wrong_run"
    assert _reason(blob, coord_id, peer_id_str(generate_key())) == "wrong_peer"
    assert _reason(blob, coord_id, peer, role="stage") == "role"
    assert _reason(blob, coord_id, peer, revoked_serials=[7]) == "revoked"
    forged = _issue(generate_key(), peer)  # signed by a stranger
    assert _reason(forged, coord_id, peer) == "signature"


def test_tampered_and_malformed_tokens(keys):
    coord, coord_id, peer = keys
    signed = SignedAdmissionToken.FromString(_issue(coord, peer))
    tampered = SignedAdmissionToken(token=signed.token.replace(b"run-a", b"run-b"), signature=signed.signature)
    assert _reason(tampered.SerializeToString(), coord_id, peer, run_id="run-b") == "signature"
    assert _reason(b"\xff\xff\xff", coord_id, peer) == "malformed"
    assert _reason(signed.SerializeToString() + b"\x1a\x00", coord_id, peer) == "malformed"  # extra field
    assert _reason(b"\x0a" + b"\x00" * 3000, coord_id, peer) == "oversize"
    with pytest.raises(AdmissionRejected):
        decode_b64("not base64!")


def test_any_role_when_roles_empty(keys):
    coord, coord_id, peer = keys
    blob = _issue(coord, peer, roles=[])
    assert decode_token(blob)[0].roles == ()
    verify_token(blob, coordinator_peer_id=coord_id, run_id="run-a", peer_id=peer, role="grpo", now=NOW)


def test_issue_refuses_bad_input(keys):
    coord, _, peer = keys
    with pytest.raises(ValueError):
        _issue(coord, "QmYyQSo1c1Ym7orWxLYvCrM2EmxFTANf8wXmmE7DWjhx5N")
    with pytest.raises(ValueError):
        _issue(coord, peer, expires_at=NOW - 100)


def test_parse_expires():
    assert parse_expires("24h", now=NOW) == int(NOW + 86400)
    assert parse_expires("90s", now=NOW) == int(NOW + 90)
    assert parse_expires("2030-01-01T00:00:00Z", now=NOW) == 1893456000
    for bad in ("tomorrow", "2030-01-01T00:00:00", "2020-01-01T00:00:00Z"):
        with pytest.raises(ValueError):
            parse_expires(bad, now=NOW)


def test_cli_admit_prints_verifiable_token(tmp_path, keys, capsys):
    from node.cli import main

    coord, coord_id, peer = keys
    path = write_key_file(tmp_path / "coord.key", coord)
    rc = main(["admit", "--peer-id", peer, "--expires", "1h", "--roles", "noloco,stage",
               "--identity", str(path), "--run-id", "run-a"])
    out = capsys.readouterr().out.strip()
    assert rc == 0
    tok = verify_token(decode_b64(out), coordinator_peer_id=coord_id, run_id="run-a", peer_id=peer, role="stage")
    assert tok.roles == ("noloco", "stage")
    rc = main(["admit", "--peer-id", "bogus", "--identity", str(path), "--run-id", "run-a"])
    assert rc == 2 and "peer ID" in capsys.readouterr().err


def test_own_token_is_checked_before_a_node_starts(keys):
    from security.admission import check_own_token

    coord, coord_id, peer = keys
    args = dict(coordinator_peer_id=coord_id, run_id="run-a", peer_id=peer, role="noloco", now=NOW)
    assert check_own_token(_issue(coord, peer), **args).peer_id == peer
    assert check_own_token(None, **{**args, "peer_id": coord_id}) is None  # the coordinator needs none
    with pytest.raises(ValueError, match="swarmnode admit --peer-id"):
        check_own_token(None, **args)
    with pytest.raises(ValueError, match=r"\(expired\)"):
        check_own_token(_issue(coord, peer, expires_at=NOW - 1, not_before=NOW - 100), **args)
    with pytest.raises(ValueError, match=r"\(role\)"):
        check_own_token(_issue(coord, peer, roles=["stage"]), **args)
