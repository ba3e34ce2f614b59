"""Node identity: the Ed25519 key file, peer IDs derived from it, sign and verify.

Owns the on-disk key format and everything that maps a key to a libp2p peer ID:

* Key file = go-libp2p's serialized ``crypto.pb.PrivateKey`` protobuf: field 1 (``Type``,
  varint) = 1 (Ed25519), field 2 (``Data``) = 64 bytes seed‖public key. This is the form p2pd
  loads through hivemind's ``identity_path``, so the DHT's peer ID equals ``peer_id_str(key)``.
  The few protobuf bytes are encoded by hand: importing a second ``crypto.pb`` definition would
  clash with hivemind's in protobuf's default pool (see docs/security.md, 'Process separation').
* Peer ID = identity multihash (``0x00``, length, ``PublicKey`` protobuf), base58btc
  ``12D3KooW…``; the public key is inside it, so a signature is checked from the peer ID alone.
  ``Qm…`` IDs (sha256 multihash of an RSA key, what hivemind's ``generate_identity`` makes) are
  rejected.

Pure: cryptography and base58 only, no hivemind or torch import.
"""

from __future__ import annotations

import os
import shlex
import stat
import tempfile
from pathlib import Path

import base58
from cryptography.exceptions import InvalidSignature
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey, Ed25519PublicKey

__all__ = [
    "IdentityError",
    "RecordRejected",
    "generate_key",
    "write_key_file",
    "load_key_file",
    "encode_private_key",
    "decode_private_key",
    "public_key_bytes",
    "peer_id_bytes",
    "peer_id_str",
    "public_key_of",
    "sign",
    "verify",
]

KEY_TYPE_RSA, KEY_TYPE_ED25519 = 0, 1
_KEY_TYPE_NAMES = {0: "RSA", 1: "Ed25519", 2: "Secp256k1", 3: "ECDSA"}
_IDENTITY_MULTIHASH, _SHA256_MULTIHASH = 0x00, 0x12
_INIT_HINT = "create one with `swarmnode identity init` (or set identity.create_if_missing = true)"


class IdentityError(Exception):
    """The node's key file is missing, unreadable, insecure or not an Ed25519 key (exit 3)."""

    exit_code = 3


class RecordRejected(ValueError):
    """Peer-supplied data failed a check; ``reason`` is the short counter label."""

    def __init__(self, message: str, reason: str = "not_ed25519"):
        super().__init__(message)
        self.reason = reason


# --- the two tiny protobuf messages (crypto.pb.PrivateKey / PublicKey) ---

def _encode_key_message(key_type: int, data: bytes) -> bytes:
    # tag 0x08 = field 1 varint; tag 0x12 = field 2 length-delimited; lengths here are < 128
    assert key_type < 128 and len(data) < 128
    return bytes([0x08, key_type, 0x12, len(data)]) + data


def _read_varint(buf: bytes, pos: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        if pos >= len(buf) or shift > 63:
            raise ValueError("truncated varint")
        byte = buf[pos]
        pos += 1
        value |= (byte & 0x7F) << shift
        if not byte & 0x80:
            return value, pos
        shift += 7


def _decode_key_message(buf: bytes) -> tuple[int, bytes]:
    """Parse a crypto.pb.{Private,Public}Key message -> (type, data). Raises ValueError."""
    key_type: int | None = None
    data: bytes | None = None
    pos = 0
    while pos < len(buf):
        tag, pos = _read_varint(buf, pos)
        if tag == 0x08:
            key_type, pos = _read_varint(buf, pos)
        elif tag == 0x12:
            length, pos = _read_varint(buf, pos)
            if pos + length > len(buf):
                raise ValueError("truncated Data field")
            data, pos = buf[pos:pos + length], pos + length
        else:
            raise ValueError(f"unexpected protobuf field tag {tag:#x}")
    if key_type is None or data is None:
        raise ValueError("missing Type or Data field")
    return key_type, data


def public_key_bytes(public_key: Ed25519PublicKey) -> bytes:
    return public_key.public_bytes(serialization.Encoding.Raw, serialization.PublicFormat.Raw)


def encode_private_key(key: Ed25519PrivateKey) -> bytes:
    """The go-libp2p key file bytes: PrivateKey{Type=Ed25519, Data=seed‖public key}."""
    seed = key.private_bytes(serialization.Encoding.Raw, serialization.PrivateFormat.Raw,
                             serialization.NoEncryption())
    return _encode_key_message(KEY_TYPE_ED25519, seed + public_key_bytes(key.public_key()))


def decode_private_key(buf: bytes) -> Ed25519PrivateKey:
    """Inverse of :func:`encode_private_key`. Raises ValueError saying what is wrong."""
    try:
        key_type, data = _decode_key_message(buf)
    except ValueError as exc:
        raise ValueError(f"not a libp2p private key protobuf ({exc})") from None
    if key_type != KEY_TYPE_ED25519:
        name = _KEY_TYPE_NAMES.get(key_type, f"type {key_type}")
        extra = " (hivemind's generate_identity writes RSA keys)" if key_type == KEY_TYPE_RSA else ""
        raise ValueError(f"a {name} key, not Ed25519{extra}")
    if len(data) != 64:
        raise ValueError(f"Ed25519 key data is {len(data)} bytes, expected 64 (seed‖public key)")
    key = Ed25519PrivateKey.from_private_bytes(data[:32])
    if public_key_bytes(key.public_key()) != data[32:]:
        raise ValueError("the public half does not match the seed (corrupt key file)")
    return key


# --- key files ---

def generate_key() -> Ed25519PrivateKey:
    return Ed25519PrivateKey.generate()


def write_key_file(path: str | os.PathLike, key: Ed25519PrivateKey, *, overwrite: bool = False) -> Path:
    """Write ``key`` to ``path`` with mode 0600, atomically (temp file in the same dir, then rename).

    Parent directories are created (0700). An existing file is kept unless ``overwrite``.
    """
    path = Path(path)
    if path.exists() and not overwrite:
        raise IdentityError(f"key file {path} already exists; remove it first or pass --force to replace it "
                            "(this changes the node's peer ID)")
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")  # mode 0600
    except OSError as exc:
        raise IdentityError(f"cannot write key file {path}: {exc.strerror or exc}") from None
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(encode_private_key(key))
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)
        if overwrite:
            os.replace(tmp, path)
        else:
            try:  # link refuses to clobber a file created meanwhile
                os.link(tmp, path)
            except FileExistsError:
                raise IdentityError(f"key file {path} already exists; remove it first or pass --force") from None
            except OSError:  # filesystem without hard links
                os.replace(tmp, path)
    except OSError as exc:
        raise IdentityError(f"cannot write key file {path}: {exc.strerror or exc}") from None
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def load_key_file(path: str | os.PathLike, *, allow_insecure_mode: bool = False) -> Ed25519PrivateKey:
    """Load and check the node's key file. Every failure is an :class:`IdentityError` (exit 3)."""
    path = Path(path)
    try:
        st = path.stat()
    except FileNotFoundError:
        raise IdentityError(f"no key file at {path}: {_INIT_HINT}") from None
    except OSError as exc:
        raise IdentityError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    if not stat.S_ISREG(st.st_mode):
        raise IdentityError(f"key file {path} is not a regular file")
    if st.st_mode & 0o077 and not allow_insecure_mode:
        raise IdentityError(f"key file {path} is readable by group or others (mode {stat.S_IMODE(st.st_mode):04o}); "
                            f"run `chmod 600 {shlex.quote(str(path))}` and start again")
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise IdentityError(f"cannot read key file {path}: {exc.strerror or exc}") from None
    try:
        return decode_private_key(raw)
    except ValueError as exc:
        raise IdentityError(f"key file {path} is not a go-libp2p Ed25519 key: {exc}; move it away and "
                            f"{_INIT_HINT}") from None


# --- peer IDs ---

def _as_public(key: Ed25519PublicKey | Ed25519PrivateKey) -> Ed25519PublicKey:
    return key.public_key() if isinstance(key, Ed25519PrivateKey) else key


def peer_id_bytes(public_key: Ed25519PublicKey | Ed25519PrivateKey) -> bytes:
    """Identity multihash of the PublicKey protobuf: equals hivemind's ``PeerID.to_bytes()``."""
    msg = _encode_key_message(KEY_TYPE_ED25519, public_key_bytes(_as_public(public_key)))
    return bytes([_IDENTITY_MULTIHASH, len(msg)]) + msg


def peer_id_str(public_key: Ed25519PublicKey | Ed25519PrivateKey) -> str:
    """Base58btc peer ID (``12D3KooW…``): equals hivemind's ``PeerID.to_base58()``."""
    return base58.b58encode(peer_id_bytes(public_key)).decode()


def public_key_of(peer_id: bytes | str) -> Ed25519PublicKey:
    """The Ed25519 key embedded in an identity-multihash peer ID; RecordRejected otherwise."""
    if isinstance(peer_id, str):
        try:
            peer_id = base58.b58decode(peer_id.encode("ascii"))
        except (ValueError, UnicodeEncodeError):
            raise RecordRejected("peer ID is not base58") from None
    if not isinstance(peer_id, (bytes, bytearray)):
        raise RecordRejected(f"peer ID must be bytes or str, got {type(peer_id).__name__}")
    peer_id = bytes(peer_id)
    if len(peer_id) >= 2 and peer_id[0] == _SHA256_MULTIHASH:
        raise RecordRejected("peer ID is a sha256 multihash (Qm…, e.g. an RSA key): only Ed25519 "
                             "identity peer IDs (12D3KooW…) are accepted")
    if len(peer_id) < 2 or peer_id[0] != _IDENTITY_MULTIHASH or peer_id[1] != len(peer_id) - 2:
        raise RecordRejected("peer ID is not an identity multihash")
    try:
        key_type, data = _decode_key_message(peer_id[2:])
    except ValueError as exc:
        raise RecordRejected(f"peer ID holds no valid public key ({exc})") from None
    if key_type != KEY_TYPE_ED25519 or len(data) != 32:
        raise RecordRejected("peer ID key is not a 32-byte Ed25519 key")
    if _encode_key_message(key_type, data) != peer_id[2:]:
        raise RecordRejected("peer ID is not canonically encoded")
    return Ed25519PublicKey.from_public_bytes(data)


def sign(key: Ed25519PrivateKey, message: bytes) -> bytes:
    return key.sign(message)


def verify(peer_id: bytes | str, message: bytes, signature: bytes) -> bool:
    """True iff ``signature`` over ``message`` verifies under the key inside ``peer_id``."""
    try:
        public_key_of(peer_id).verify(bytes(signature), message)
        return True
    except (RecordRejected, InvalidSignature, TypeError, ValueError):
        return False
