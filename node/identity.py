"""Load this node's Ed25519 identity, creating it on first start when configured.

Owns the policy (create or refuse, where, the peer ID logged at start); the key format,
signing and peer-ID derivation are ``security/keys.py``. hivemind never writes our key: left
to itself it would write RSA (``Qm…`` IDs), which our validators reject.
"""

from __future__ import annotations

import logging
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from node.config import IdentityConfig
from node.logs import emit
from security.keys import IdentityError, generate_key, load_key_file, peer_id_str, write_key_file

log = logging.getLogger("swarmnode.identity")


def ensure_identity(cfg: IdentityConfig) -> tuple[Ed25519PrivateKey, str, str]:
    """Return (private key, peer ID, absolute key path). Raises IdentityError (exit 3)."""
    path = Path(cfg.path).expanduser().resolve()
    if not path.exists():
        if not cfg.create_if_missing:
            raise IdentityError(
                f"identity file {path} not found. Create one with `swarmnode identity init --path {path}` "
                "or set identity.create_if_missing = true; refusing to make a new peer ID silently.")
        key = generate_key()
        write_key_file(path, key)
        emit(log, "identity_created", "created a new identity at {path}", path=str(path),
             peer=peer_id_str(key.public_key()))
    key = load_key_file(path, allow_insecure_mode=cfg.allow_insecure_mode)
    return key, peer_id_str(key.public_key()), str(path)
