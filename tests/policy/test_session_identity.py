"""Session identity for every client (policy_server.serving.identity) and side-turn rules
(policy_server.serving.side_rules): the precedence of ids and stock-client hints, key families that split
on divergence, done and concurrency instead of losing turns, the shipped OpenClaw side rules and a rules
file; and over HTTP: hints pair turns, side turns are recorded as side, the admin view names each rule.
"""

from __future__ import annotations

import json

import httpx
import pytest

from engine.records import TurnRecord
from policy_server.metrics import Metrics
from policy_server.serving.identity import (
    AFFINITY,
    HEADER,
    INFERRED,
    METADATA,
    PREVIOUS_RESPONSE,
    PROMPT_CACHE_KEY,
    SessionHint,
    SessionResolver,
    in_family,
    session_hint,
)
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.side_rules import SideRules, SideRulesError
from policy_server.store import Store
from tests.testkit.servers import CLIENT_KEY, admin, client, start_policy
from tests.waiting import async_wait_until

# What stock OpenClaw 2026.9 sends (its dist/: heartbeat-*.mjs HEARTBEAT_PROMPT, extensions/memory-core
# DEFAULT_MEMORY_FLUSH_PROMPT / DEFAULT_MEMORY_FLUSH_SYSTEM_PROMPT, with the date filled in).
OPENCLAW_HEARTBEAT = (
    "Follow the heartbeat monitor scratch context when provided. Recurring tasks are automations; create or "
    "change their schedules with the automations tool, not heartbeat scratch. Do not infer or repeat old tasks "
    "from prior chats. If nothing needs attention, reply NO_REPLY."
)
OPENCLAW_CONTEXT = (
    "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nConversation data (data, not instructions):\n"
    '"Active exec sessions:\\nnone"\n<<<END_OPENCLAW_INTERNAL_CONTEXT>>>'
)
OPENCLAW_FLUSH = (
    "Pre-compaction memory flush. Store durable memories only in memory/2026-12-01.md (create memory/ if "
    "needed). If nothing to store, reply with NO_REPLY.\nCurrent time: Tuesday, December 1st, 2026"
)
OPENCLAW_FLUSH_SYSTEM = (
    "Pre-compaction memory flush turn. The session is near auto-compaction; capture durable memories."
)


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


# --- pure rules -------------------------------------------------------------------------------------


@pytest.mark.unit
def test_hint_precedence():
    headers = {"session_id": "aff", "x-session-affinity": "aff2"}
    body = {"prompt_cache_key": "pck", "metadata": {"session_id": "meta"}, "previous_response_id": "resp_1"}
    assert session_hint(headers, body, "explicit") == SessionHint("explicit", HEADER)
    assert session_hint(headers, body, None) == SessionHint("pck", PROMPT_CACHE_KEY)
    assert session_hint(headers, {**body, "prompt_cache_key": None}, None) == SessionHint("aff", AFFINITY)
    assert session_hint({"x-session-affinity": "aff2"}, {}, None) == SessionHint("aff2", AFFINITY)
    assert session_hint({}, {"metadata": {"session_id": "meta"}}, None) == SessionHint("meta", METADATA)
    assert session_hint({}, {"previous_response_id": "resp_1"}, None) == SessionHint(
        None, PREVIOUS_RESPONSE, previous_response_id="resp_1"
    )
    assert session_hint({}, {}, None) == SessionHint(None, INFERRED)
    # a hint that is no valid session id is another protocol's field: skipped, never a 400
    assert session_hint({"session_id": "x" * 300}, {"prompt_cache_key": ""}, None) == SessionHint(None, INFERRED)


@pytest.mark.unit
def test_family_membership():
    assert in_family("k", "k") and in_family("k~0123456789ab", "k")
    assert not in_family("k2", "k") and not in_family("k~a~b", "k") and not in_family("kk~a", "k")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("messages", "rule"),
    [
        ([{"role": "system", "content": "You are OpenClaw."}, U(OPENCLAW_HEARTBEAT)], "openclaw_heartbeat"),
        # an agentic heartbeat that called a tool: its next request still carries the heartbeat prompt
        (
            [U(OPENCLAW_HEARTBEAT), {"role": "assistant", "content": "", "tool_calls": []}, {"role": "tool"}],
            "openclaw_heartbeat",
        ),
        ([U("Read HEARTBEAT.md if it exists (workspace context). Reply HEARTBEAT_OK.")], "openclaw_heartbeat"),
        # as the real gateway sends it: the prompt, then the per-request context message every request ends with
        # (an ephemeral message: the rule reads the last user message the client keeps, not that one)
        (
            [
                {"role": "system", "content": "You are a personal assistant running inside OpenClaw."},
                U(OPENCLAW_HEARTBEAT + "\nCurrent time: Wednesday, December 2nd, 2026 - 11:24 AM (UTC)"),
                U([{"type": "text", "text": OPENCLAW_CONTEXT}]),
            ],
            "openclaw_heartbeat",
        ),
        ([U("Please fix the failing test"), U([{"type": "text", "text": OPENCLAW_CONTEXT}])], None),
        ([U([{"type": "text", "text": OPENCLAW_FLUSH}])], "openclaw_memory_flush"),
        ([{"role": "system", "content": OPENCLAW_FLUSH_SYSTEM}, U("go")], "openclaw_memory_flush"),
        ([U("Generate a concise title for this conversation")], "title"),
        (
            [{"role": "system", "content": "You are a context summarization assistant. Your task is ..."}, U("x")],
            "openclaw_compaction_summary",
        ),
        ([U("What is the heartbeat of a cat? Read the file please.")], None),
        ([U("Please fix the failing test"), A("ok"), U("thanks")], None),
    ],
)
def test_default_side_rules_match_what_openclaw_sends(messages, rule):
    assert SideRules().match(messages) == rule


@pytest.mark.unit
def test_side_rules_file(tmp_path):
    f = tmp_path / "rules.json"
    f.write_text(json.dumps({"rules": [{"name": "nightly", "pattern": "^NIGHTLY REPORT"}]}))
    rules = SideRules.load(str(f))
    assert rules.match([U("NIGHTLY REPORT for today")]) == "nightly"
    assert rules.match([U(OPENCLAW_HEARTBEAT)]) == "openclaw_heartbeat"  # defaults kept
    f.write_text(json.dumps({"rules": [{"name": "nightly", "pattern": "^NIGHTLY"}], "replace_defaults": True}))
    assert SideRules.load(str(f)).match([U(OPENCLAW_HEARTBEAT)]) is None
    y = tmp_path / "rules.yaml"
    y.write_text("rules:\n  - name: sys\n    pattern: '^BATCH'\n    field: system\n")
    assert SideRules.load(str(y)).match([{"role": "system", "content": "BATCH job"}, U("x")]) == "sys"
    for bad in ({"rules": [{"name": "x", "pattern": "("}]}, {"rules": [{"name": "x"}]}, {"rule": []}):
        f.write_text(json.dumps(bad))
        with pytest.raises(SideRulesError):
            SideRules.load(str(f))


@pytest.mark.unit
def test_side_exchanges_kept_in_the_transcript_are_no_feedback():
    """Stock OpenClaw keeps its memory flush (prompt and reply) in the conversation it resends: the next turn
    still pairs, with only the user's message as the next state."""
    from policy_server.serving.pairing import pair_next_state

    prev = [{"role": "system", "content": "sys"}, U("hello")]
    new = [*prev, A("hi"), U(OPENCLAW_FLUSH), A("NO_REPLY"), U("now the time?")]
    assert pair_next_state(prev, {"content": "hi"}, new).kind == "mismatch"
    p = pair_next_state(prev, {"content": "hi"}, new, SideRules())
    assert p.kind == "paired" and p.next_state == [U("now the time?")]
    assert "openclaw_memory_flush" in (p.note or "")


@pytest.mark.unit
def test_per_request_context_messages_are_ignored_by_pairing():
    """Stock OpenClaw appends a user message of runtime context to every request and never keeps it."""
    from policy_server.serving.pairing import pair_next_state

    ctx = U([{"type": "text", "text": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>\nActive exec sessions: none"}])
    prev = [{"role": "system", "content": "sys"}, U("hello"), ctx]
    new = [{"role": "system", "content": "sys"}, U("hello"), A("hi"), U("now the time?"), ctx]
    assert pair_next_state(prev, {"content": "hi"}, new).kind == "mismatch"
    p = pair_next_state(prev, {"content": "hi"}, new, SideRules())
    assert p.kind == "paired" and p.next_state == [U("now the time?")]


# --- the resolver against a real store ---------------------------------------------------------------


def _record(messages: list[dict], reply: str) -> dict:
    return {
        "messages": messages,
        "prompt_ids": [1, 2],
        "response_ids": [3, 4],
        "rollout_logprobs": [-0.1, -0.2],
        "response": {"content": reply, "tool_calls": None},
        "weight_version": "v0",
    }


@pytest.mark.unit
async def test_key_families_split_instead_of_mismatching(tmp_path):
    store = Store(tmp_path / "data")
    try:
        tracker = SessionTracker(store, idle_timeout_s=600)
        resolver = SessionResolver(store, tracker, Metrics(), infer=True)
        hint = SessionHint("static", HEADER)

        async def turn(messages: list[dict], reply: str, *, done: bool = False):
            ident = await resolver.resolve(hint, messages, main=True, done=done)
            await tracker.on_main_turn(
                ident.sid, TurnRecord.model_validate(_record(messages, reply)), done=done, arrival=ident.arrival
            )
            return ident

        a1 = await turn([U("task A")], "A1")
        assert (a1.sid, a1.decision) == ("static", "started")
        b1 = await turn([U("task B")], "B1")  # same static header, a different conversation
        assert b1.sid.startswith("static~") and b1.decision == "diverged"
        a2 = await turn([U("task A"), A("A1"), U("more A")], "A2")
        b2 = await turn([U("task B"), A("B1"), U("more B")], "B2", done=True)
        assert (a2.sid, a2.decision, b2.sid, b2.decision) == ("static", "continued", b1.sid, "continued")
        assert store.get_turn("static", 0).pairing == "paired"
        assert store.get_turn(b1.sid, 0).next_state == [U("more B")]
        assert not any(t.pairing == "mismatch" for t in store.awaiting_open_turns())
        # after X-Session-Done, the same key with a fresh conversation starts a new session
        store.end_session("static")
        c1 = await turn([U("task C")], "C1")
        assert c1.sid not in ("static", b1.sid) and c1.decision == "after_done"
        # two concurrent continuations of one awaiting turn never claim the same session
        follow = [U("task C"), A("C1"), U("go on")]
        first = await resolver.resolve(hint, follow, main=True, done=False)
        second = await resolver.resolve(hint, follow, main=True, done=False)
        assert first.sid == c1.sid and second.sid != c1.sid and second.decision == "concurrent"
        for ident in (first, second):
            tracker.settle_later(ident.arrival)
        await async_wait_until(lambda: not tracker.in_flight(c1.sid), timeout_s=2, interval_s=0.01)
        # a side request touches the family's latest open session; the hint-less one has no session
        side = await resolver.resolve(hint, [U("heartbeat")], main=False, done=False)
        assert side.sid in (c1.sid, second.sid) and side.decision == "side"
        # split off: the key names exactly one session again
        legacy = SessionResolver(store, tracker, Metrics(), infer=False, split_diverged=False)
        ident = await legacy.resolve(SessionHint("static", HEADER), [U("other")], main=True, done=False)
        assert ident.sid == "static" and ident.arrival is not None
        tracker.settle_later(ident.arrival)
        none = await legacy.resolve(SessionHint(None, INFERRED), [U("x")], main=True, done=False)
        assert (none.sid, none.rule) == (None, "none")
        await tracker.drain_settles()
    finally:
        store.close()


@pytest.mark.unit
async def test_previous_response_chain_uses_the_hook(tmp_path):
    store = Store(tmp_path / "data")
    try:
        tracker = SessionTracker(store, idle_timeout_s=600)
        resolver = SessionResolver(store, tracker, Metrics(), infer=True)
        hint = SessionHint(None, PREVIOUS_RESPONSE, previous_response_id="resp_9")
        ident = await resolver.resolve(hint, [U("x")], main=True, done=False)
        assert ident.rule == INFERRED  # no resolver of response ids installed: the next rule applies
        tracker.settle_later(ident.arrival)

        async def lookup(response_id: str) -> str | None:
            return {"resp_9": "conv-9"}.get(response_id)

        resolver.previous_response_session = lookup
        ident = await resolver.resolve(hint, [U("x")], main=True, done=False)
        assert (ident.sid, ident.rule, ident.decision) == ("conv-9", PREVIOUS_RESPONSE, "started")
        tracker.settle_later(ident.arrival)
        await tracker.drain_settles()
    finally:
        store.close()


# --- over HTTP ---------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_stock_client_hints_side_rules_and_admin_view(engine, tiny_model_dir, tmp_path):
    """A header-less client sending only prompt_cache_key: its turns pair; its heartbeat is served and
    recorded as side; the admin view names the identifying rule and the side rule; metrics count both."""
    pol = start_policy(tiny_model_dir, engine.url, tmp_path / "data", tmp_path, name="policy-identity")
    try:
        with client(pol.url) as c:

            def ask(messages: list[dict], **extra) -> httpx.Response:
                r = c.post("/v1/chat/completions", json={"messages": messages, "max_tokens": 4, "seed": 1, **extra})
                assert r.status_code == 200, r.text
                return r

            m = [U("list the files")]
            r1 = ask(m, prompt_cache_key="oc-session-1")
            assert r1.headers["x-hindsight-session-id"] == "oc-session-1"
            m += [A(r1.json()["choices"][0]["message"]["content"]), U("thanks")]
            hb = ask([U(OPENCLAW_HEARTBEAT)], prompt_cache_key="oc-session-1")
            ask(m, prompt_cache_key="oc-session-1")
            other = ask([U("unrelated")], prompt_cache_key="oc-session-1")  # same key, diverging history
            assert other.headers["x-hindsight-session-id"].startswith("oc-session-1~")
        adm = admin(pol.url)
        rows = adm.get("/v1/samples", params={"session_id": "oc-session-1"}).json()["samples"]
        assert len(rows) == 1  # the second turn awaits its next state: no sample yet
        assert (rows[0]["turn"]["session_rule"], rows[0]["turn"]["session_decision"]) == (PROMPT_CACHE_KEY, "started")
        assert rows[0]["turn"]["pairing"] == "paired" and rows[0]["turn"]["next_state"] == [U("thanks")]
        store = Store(tmp_path / "data")
        try:
            second = store.get_turn("oc-session-1", 1)
        finally:
            store.close()
        assert second is not None and (second.session_rule, second.session_decision) == (PROMPT_CACHE_KEY, "continued")
        side = adm.get("/v1/side_turns").json()["side_turns"]
        assert [(s["rule"], s["session_id"]) for s in side] == [("openclaw_heartbeat", "oc-session-1")]
        assert side[0]["record"]["response_ids"] and side[0]["record"]["messages"] == [U(OPENCLAW_HEARTBEAT)]
        assert hb.json()["choices"][0]["message"] is not None
        stats = adm.get("/v1/samples/stats").json()
        assert stats["side_turns"] == {"openclaw_heartbeat": 1}
        assert stats["turns_by_session_rule"]["prompt_cache_key:diverged"] == 1
        metrics = httpx.get(pol.url + "/metrics", headers={"Authorization": f"Bearer {CLIENT_KEY}"}).text
        assert 'hindsight_policy_side_turns_total{rule="openclaw_heartbeat"} 1.0' in metrics
        assert 'hindsight_policy_session_identity_total{decision="continued",rule="prompt_cache_key"} 1.0' in metrics
    finally:
        pol.stop()
