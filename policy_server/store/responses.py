"""Stored Responses-API answers, for ``previous_response_id`` (a Store role class).

Role: a ``/v1/responses`` answer created with ``store: true`` (the API's default) is kept as the whole
conversation it ends, in the chat shape the policy renders (the input messages without the request's
``instructions``, then the assistant message of the answer), with the session it was recorded under. A
later request naming it as ``previous_response_id`` continues that conversation
(policy_server.api.responses), so its prompt, its turn record and its pairing are exactly those of a client
that resent the whole history. Rows are written once and never changed.
"""

from __future__ import annotations

import json
import time
from typing import Any

from policy_server.store.base import StoreDB


class StoreResponses(StoreDB):
    """``put_response`` / ``get_response`` (see the module docstring)."""

    def put_response(self, response_id: str, session_id: str | None, conversation: list[dict[str, Any]]) -> None:
        """Keep one answer's conversation (one transaction); an id is written once."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO responses (response_id, session_id, created_at, conversation) VALUES (?, ?, ?, ?)",
                (response_id, session_id, time.time(), json.dumps(conversation, ensure_ascii=False)),
            )

    def get_response(self, response_id: str) -> dict[str, Any] | None:
        """``{"session_id", "conversation"}`` of a stored answer, or None when no answer has that id."""
        with self._read() as db:
            row = db.execute(
                "SELECT session_id, conversation FROM responses WHERE response_id=?", (response_id,)
            ).fetchone()
        if row is None:
            return None
        return {"session_id": row["session_id"], "conversation": json.loads(row["conversation"])}
