"""security/keys.py: key file format and checks, peer IDs, sign/verify (no hivemind needed)."""

import hashlib
import os
import subprocess
import sys

import base58
import pytest

from security.keys import (
    IdentityError,
    RecordRejected,
    decode_private_key,
    encode_private_key,
    generate_key,
    load_key_file,
    peer_id_bytes,
    peer_id_str,
    public_key_bytes,
    public_key_of,
    sign,
    verify,
    write_key_file,
)


def test_key_file_bytes_are_go_libp2p_protobuf():
    key = generate_key()
    raw = encode_private_key(key)
    assert raw[:4] == bytes([0x08, 0x01, 0x12, 64]) and len(raw) == 68
    assert raw[-32:] == public_key_bytes(key.public_key())
    assert public_key_bytes(decode_private_key(raw).public_key()) == public_key_bytes(key.public_key())


def test_write_load_round_trip(tmp_path):
    key = generate_key()
    path = write_key_file(tmp_path / "sub" / "dir" / "node.key", key)
    assert (os.stat(path).st_mode & 0o777) == 0o600
    loaded = load_key_file(path)
    assert peer_id_str(loaded) == peer_id_str(key)
    assert [p.name for p in path.parent.iterdir()] == ["node.key"]  # no temp file left behind


def test_refuses_overwrite_unless_asked(tmp_path):
    path = tmp_path / "node.key"
    first = generate_key()
    write_key_file(path, first)
    with pytest.raises(IdentityError, match="--force") as info:
        write_key_file(path, generate_key())
    assert info.value.exit_code == 3
    assert peer_id_str(load_key_file(path)) == peer_id_str(first)
    second = generate_key()
    write_key_file(path, second, overwrite=True)
    assert peer_id_str(load_key_file(path)) == peer_id_str(second)
    assert (os.stat(path).st_mode & 0o777) == 0o600


def test_rejects_group_or_world_readable_with_chmod_hint(tmp_path):
    path = write_key_file(tmp_path / "node.key", generate_key())
    os.chmod(path, 0o644)
    with pytest.raises(IdentityError) as info:
        load_key_file(path)
    assert f"chmod 600 {path}" in str(info.value)
    assert info.value.exit_code == 3
    load_key_file(path, allow_insecure_mode=True)  # the public demo key is exempt


def test_missing_file_says_how_to_create(tmp_path):
    with pytest.raises(IdentityError, match="identity init"):
        load_key_file(tmp_path / "absent.key")


def test_unreadable_path(tmp_path):
    with pytest.raises(IdentityError, match="not a regular file"):
        load_key_file(tmp_path)


@pytest.mark.parametrize("content, match", [
    (b"", "not a libp2p private key"),
    (b"garbage bytes \xff\xff\xff", "not a libp2p private key"),
    (bytes([0x08, 0x00, 0x12, 0x04]) + b"\x30\x82\x01\x00", "RSA key"),  # what hivemind writes
    (bytes([0x08, 0x01, 0x12, 0x20]) + b"\x01" * 32, "32 bytes"),  # py-libp2p's 32-byte seed form
])
def test_rejects_wrong_format(tmp_path, content, match):
    path = tmp_path / "bad.key"
    path.write_bytes(content)
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match=match):
        load_key_file(path)


def test_rejects_mismatched_public_half(tmp_path):
    raw = bytearray(encode_private_key(generate_key()))
    raw[-1] ^= 1
    path = tmp_path / "bad.key"
    path.write_bytes(bytes(raw))
    os.chmod(path, 0o600)
    with pytest.raises(IdentityError, match="does not match"):
        load_key_file(path)


def test_peer_id_shape_and_round_trip():
    key = generate_key()
    pid = peer_id_str(key)
    assert pid.startswith("12D3KooW")
    assert pid == peer_id_str(key.public_key())
    raw = peer_id_bytes(key.public_key())
    assert raw[0] == 0x00 and raw[1] == len(raw) - 2 == 36
    assert base58.b58decode(pid) == raw
    for form in (pid, raw):
        assert public_key_bytes(public_key_of(form)) == public_key_bytes(key.public_key())


def test_qm_and_garbage_peer_ids_rejected():
    qm = base58.b58encode(bytes([0x12, 0x20]) + hashlib.sha256(b"rsa key").digest()).decode()
    assert qm.startswith("Qm")
    with pytest.raises(RecordRejected, match="sha256"):
        public_key_of(qm)
    with pytest.raises(ValueError):  # RecordRejected is a ValueError
        public_key_of("not-base58-0OIl")
    secp = bytes([0x08, 0x02, 0x12, 0x21]) + b"\x02" * 33
    with pytest.raises(RecordRejected, match="Ed25519"):
        public_key_of(bytes([0x00, len(secp)]) + secp)
    with pytest.raises(RecordRejected):
        public_key_of(b"\x00")


def test_sign_verify():
    key, other = generate_key(), generate_key()
    sig = sign(key, b"hello")
    assert verify(peer_id_str(key), b"hello", sig)
    assert verify(peer_id_bytes(key), b"hello", sig)
    assert not verify(peer_id_str(key), b"hellO", sig)
    assert not verify(peer_id_str(other), b"hello", sig)
    assert not verify("QmNotAnEd25519PeerId", b"hello", sig)


def test_keys_module_imports_no_hivemind_or_torch():
    code = ("import sys, security.keys; "
            "bad = [m for m in ('hivemind', 'torch') if m in sys.modules]; "
            "assert not bad, bad")
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    subprocess.run([sys.executable, "-c", code], check=True, cwd=root)
