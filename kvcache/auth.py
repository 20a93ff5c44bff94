"""Who may move states between servers: a shared secret, never sent over the wire.

Every server of one deployment holds the same secret (`DSUF_KV_SECRET`). Two keys are derived
from it: one for the transfer handshake, one for the MAC states carry.

Handshake (on the TCP control connection both transports use, protocol.py): the owner speaks
first with a fresh nonce; the fetcher answers with its own nonce and an HMAC-SHA256 over both
nonces, the key it asks for and the rest of its request; the owner checks it before it looks
the key up, and seals its reply the same way (so the fetcher knows it talks to a peer, not to
whatever a Redis record points at). Fresh nonces on both sides make a recorded exchange useless
on another connection.

State MAC: HMAC-SHA256 over the cache key, the token count, the size and the payload's tree
digest (a collision-resistant hash of every byte), made by the owner and checked by the fetcher
before a byte of the state is parsed. It binds the bytes to their key: a state served under
another key, or bytes changed on the way, fail it.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

SECRET_ENV = "DSUF_KV_SECRET"
MIN_SECRET_LEN = 16
NONCE_BYTES = 16


class PeerAuth:
    def __init__(self, secret: str | bytes):
        raw = secret.encode() if isinstance(secret, str) else bytes(secret)
        self._hs = hmac.new(raw, b"dsuf-kv handshake v1", hashlib.sha256).digest()
        self._st = hmac.new(raw, b"dsuf-kv state mac v1", hashlib.sha256).digest()

    @classmethod
    def from_secret(cls, secret: str | None) -> PeerAuth | None:
        """None when no usable secret is given (sharing then stays off)."""
        if not secret or len(secret) < MIN_SECRET_LEN:
            return None
        return cls(secret)

    # ---- handshake -----------------------------------------------------------------------
    def proof(self, role: str, server_nonce: str, client_nonce: str, key: str, fields: dict) -> str:
        """HMAC of one side's frame: its role, both nonces, the key and every other field."""
        body = {k: v for k, v in fields.items() if k != "mac"}
        msg = b"\0".join((role.encode(), server_nonce.encode(), client_nonce.encode(), key.encode(),
                          json.dumps(body, sort_keys=True, separators=(",", ":")).encode()))
        return hmac.new(self._hs, msg, hashlib.sha256).hexdigest()

    def check(self, mac: object, role: str, server_nonce: str, client_nonce: str, key: str, fields: dict) -> bool:
        if not isinstance(mac, str) or not server_nonce or not client_nonce:
            return False
        return hmac.compare_digest(mac.encode(), self.proof(role, server_nonce, client_nonce, key, fields).encode())

    # ---- state MAC -------------------------------------------------------------------------
    def state_mac(self, key: bytes, n_tokens: int, size: int, digest: bytes) -> str:
        msg = b"dsuf-state\0" + key + n_tokens.to_bytes(8, "little") + size.to_bytes(8, "little") + digest
        return hmac.new(self._st, msg, hashlib.sha256).hexdigest()

    def check_state(self, mac: object, key: bytes, n_tokens: int, size: int, digest: bytes) -> bool:
        if not isinstance(mac, str):
            return False
        return hmac.compare_digest(mac.encode(), self.state_mac(key, n_tokens, size, digest).encode())


def new_nonce() -> str:
    return os.urandom(NONCE_BYTES).hex()
