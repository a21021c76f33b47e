"""Stored Responses-API answers, for ``previous_response_id`` (a Store role class).

Role: a ``/v1/responses`` answer created with ``store: true`` (the API's default) is kept with the session
it was recorded under, as the messages it added to its conversation, in the chat shape the policy renders:
the request's new input messages (never its ``instructions``) and the assistant message of the answer. An
answer that continued a stored one (``previous_id``) keeps only what it added, so a chain of N answers
stores O(N) messages, not O(N^2); :meth:`get_response` rebuilds the whole conversation by walking the chain.
A later request naming the answer as ``previous_response_id`` continues that conversation
(policy_server.api.responses.routes), so its prompt, turn record and pairing are exactly those of a client that
resent the whole history. Rows are written once and never changed.
"""

from __future__ import annotations

import time

from policy_server.store.base import StoreDB
from policy_server.store.records import StoredConversation, StoredResponse
from policy_server.store.rows import messages_json, messages_of

# A chain deeper than this is refused rather than walked (a conversation of that many stored answers).
MAX_CHAIN = 10_000


class StoreResponses(StoreDB):
    """``put_response`` / ``get_response`` (see the module docstring)."""

    def put_response(self, response: StoredResponse) -> None:
        """Keep what one answer added to its conversation (one transaction); an id is written once."""
        with self._tx() as db:
            db.execute(
                "INSERT INTO responses (response_id, session_id, previous_id, created_at, messages) "
                "VALUES (?, ?, ?, ?, ?)",
                (
                    response.response_id,
                    response.session_id,
                    response.previous_id,
                    time.time(),
                    messages_json(response.messages),
                ),
            )

    def response_session(self, response_id: str) -> str | None:
        """The session of a stored answer (None when unknown, or stored without one): one row, no chain walk."""
        with self._read() as db:
            row = db.execute("SELECT session_id FROM responses WHERE response_id=?", (response_id,)).fetchone()
        return None if row is None else row["session_id"]

    def get_response(self, response_id: str) -> StoredConversation | None:
        """A stored answer's session and whole conversation (the chain's messages, oldest first), or None when
        no answer has that id."""
        parts: list[list[dict[str, object]]] = []
        session_id: str | None = None
        with self._read() as db:
            current: str | None = response_id
            while current is not None:
                row = db.execute(
                    "SELECT session_id, previous_id, messages FROM responses WHERE response_id=?", (current,)
                ).fetchone()
                if row is None:
                    if not parts:
                        return None
                    raise LookupError(f"stored response {response_id} continues {current}, which is not stored")
                if not parts:
                    session_id = row["session_id"]
                parts.append(messages_of(row["messages"]))
                current = row["previous_id"]
                if len(parts) > MAX_CHAIN:
                    raise LookupError(f"stored response {response_id} ends a chain of more than {MAX_CHAIN} answers")
        conversation = [m for part in reversed(parts) for m in part]
        return StoredConversation(session_id=session_id, conversation=conversation)
