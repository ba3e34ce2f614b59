"""The ``<run>/revoked`` DHT record (docs/security.md, 'Revocation'): its namespace and the
coordinator's signature over it.

Coordinator-only (``Namespace(coordinator_only=True)``): the validator of every node accepts it
only under the subkey ``security.coordinator_peer_id`` with that key's signature, so a forged
list is refused at store and at lookup and never read. The list itself is
``security/revocation.py``; reading and re-publishing it, ``node/revocation_sync.py``.
"""

from __future__ import annotations

import time

from security.keys import peer_id_str
from security.records import RECORD_TAG, Namespace, encode_payload, signing_bytes
from security.revocation import MAX_REVOKED_BYTES, REVOKED_RECORD_TTL_S, RevocationList, RevokedEntry, revoked_key

__all__ = ["REVOKED_NAMESPACE", "signed_record_value"]

REVOKED_NAMESPACE = Namespace(name="revoked", model=RevocationList, max_payload_bytes=MAX_REVOKED_BYTES,
                              max_ttl_s=REVOKED_RECORD_TTL_S, coordinator_only=True)


def signed_record_value(key, run_id: str, entries: list[RevokedEntry], expiration: float,
                        now: float | None = None) -> dict:
    """The ``<run>/revoked`` value signed with the coordinator ``key`` (Ed25519PrivateKey), ready
    for ``dht.store(revoked_key(run_id), value, expiration, subkey=<coordinator peer ID>)`` from
    any DHT node: the validator's ``sign_value`` leaves an already signed envelope alone."""
    payload = encode_payload(RevocationList(entries=entries, published_at=time.time() if now is None else now))
    if len(payload) > MAX_REVOKED_BYTES:
        raise ValueError(f"the revocation list is {len(payload)} bytes (cap {MAX_REVOKED_BYTES})")
    k, subkey = revoked_key(run_id), peer_id_str(key)
    return {"v": RECORD_TAG, "k": k, "p": payload, "s": key.sign(signing_bytes(k, subkey, payload, expiration))}
