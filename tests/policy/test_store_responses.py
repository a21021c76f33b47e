"""Stored Responses answers on both store backends (policy_server.store.responses).

Contract: an answer keeps only the messages it added and the answer it continued; reading it back
rebuilds the whole conversation by walking the chain, with the session of the answer read; an unknown id
reads as None, and a chain whose start is missing is an error, never a silently shorter conversation.
"""

from __future__ import annotations

import pytest

from policy_server.store.records import StoredConversation, StoredResponse


def test_chain_rebuilds_the_conversation(store_factory):
    st = store_factory()
    user = {"role": "user", "content": "hi"}
    reply = {
        "role": "assistant",
        "content": None,
        "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}],
    }
    result = {"role": "tool", "tool_call_id": "c1", "content": "ok"}
    final = {"role": "assistant", "content": "done"}
    st.put_response(StoredResponse("resp_1", "s1", None, [user, reply]))
    st.put_response(StoredResponse("resp_2", "s1", "resp_1", [result, final]))
    assert st.get_response("resp_1") == StoredConversation(session_id="s1", conversation=[user, reply])
    assert st.get_response("resp_2") == StoredConversation(session_id="s1", conversation=[user, reply, result, final])
    assert st.get_response("resp_nope") is None
    st.put_response(StoredResponse("resp_3", None, "resp_gone", [user]))
    with pytest.raises(LookupError, match="resp_gone"):
        st.get_response("resp_3")
