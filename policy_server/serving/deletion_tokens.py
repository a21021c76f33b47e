"""Per-session deletion tokens: how a client deletes its own session without the admin key.

Role: every answer of a recorded session carries ``X-Hindsight-Deletion-Token``, an HMAC-SHA256 of the session
id under a random key the store keeps (created once, shared by every replica, surviving restarts:
policy_server.store.privacy ``deletion_key``). ``DELETE /v1/sessions/{id}`` with that token in the same header
deletes the session (policy_server.api.sessions); the token names one session only and cannot be forged
without the key. Anyone the client gives the token to can delete the session, nothing else; a client that
keeps no headers can still ask the operator (admin key).
"""

from __future__ import annotations

import hashlib
import hmac

TOKEN_HEADER = "X-Hindsight-Deletion-Token"


class DeletionTokens:
    """Makes and checks the deletion tokens of sessions under one key (pure)."""

    def __init__(self, key: bytes) -> None:
        if len(key) < 16:
            raise ValueError("a deletion-token key needs at least 16 bytes")
        self._key = key

    def token(self, session_id: str) -> str:
        """The session's token (hex)."""
        return hmac.new(self._key, session_id.encode("utf-8"), hashlib.sha256).hexdigest()

    def check(self, session_id: str, token: str) -> bool:
        """Whether ``token`` is the session's (constant-time)."""
        return hmac.compare_digest(self.token(session_id), token.strip().lower())
