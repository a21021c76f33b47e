"""Pairing across a client's compaction (rule 3 of policy_server.serving.pairing; policy_server.serving.identity
and session_inference decide the session): the turn before a compaction gets its next state when the request after
it holds the recorded reply after the message it answered, then feedback; the request starts the conversation's next
session (decision ``compacted``), found whatever rule named the session: OpenClaw's ``prompt_cache_key`` (a new
``:n`` suffix per compaction), a static header, none (inferred). A reply without what it answered, another reply
after it or no feedback is no match, and a turn being continued is never claimed.

The transcripts have the shape stock OpenClaw 2026.9 sends after its compaction (its dist/: ``convertToLlm`` turns
the ``compactionSummary`` entry into a user message ``COMPACTION_SUMMARY_PREFIX + summary + SUFFIX``; the recent tail
is kept as recorded; the new user message and the per-request runtime-context message follow):
``[system, user(summary), ...kept tail, assistant(reply), user(new), user(context)]``. ``SPLIT_TURN`` is the request
the real OpenClaw sent in tests/agents/test_openclaw_e2e.py (its small-window session), reduced: its system prompt
rebuilt (shorter than the recorded one), the compaction cut at the reply and summarised the message it answered
("Turn Context (split turn)"), so of the recorded turn only the reply is left.
"""

from __future__ import annotations

import httpx
import pytest

from engine.records import Turn, TurnRecord
from policy_server.metrics import Metrics
from policy_server.serving.identity import HEADER, INFERRED, PROMPT_CACHE_KEY, SessionHint, SessionResolver
from policy_server.serving.pairing import pair_across_compaction, pair_next_state
from policy_server.serving.session_inference import INFERRED_PREFIX, find_compacted
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.side_rules import SideRules
from policy_server.store import Store
from tests.policy.test_session_identity import OPENCLAW_CONTEXT, OPENCLAW_FLUSH
from tests.testkit.servers import CLIENT_KEY, admin, client, start_policy

SYSTEM = {"role": "system", "content": "You are a personal assistant running inside OpenClaw."}
SUMMARY = (
    "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
    "## Goal\nThe user is planning a trip.\n## Progress\nFlights compared.\n</summary>"
)


def U(text: str) -> dict:
    return {"role": "user", "content": text}


def A(text: str) -> dict:
    return {"role": "assistant", "content": text}


def CTX() -> dict:
    return U([{"type": "text", "text": OPENCLAW_CONTEXT}])


def TOOL_CALL(path: str) -> dict:
    call = {"id": "call1", "type": "function", "function": {"name": "read", "arguments": f'{{"path": "{path}"}}'}}
    return {"role": "assistant", "content": "", "tool_calls": [call]}


RECORDED = [SYSTEM, U("Plan a trip to Lisbon."), A("Sure: when?"), U("In May. Compare flights."), CTX()]
REPLY = {"content": "TAP is cheapest at 210 EUR.", "tool_calls": None}
AFTER = [SYSTEM, U(SUMMARY), U("In May. Compare flights."), A("TAP is cheapest at 210 EUR."), U("Book it."), CTX()]
SPLIT_SUMMARY = (
    "The conversation history before this point was compacted into the following summary:\n\n<summary>\n"
    "No prior history.\n\n---\n\n**Turn Context (split turn):**\n\n The user asked for flights in May.\n</summary>"
)
RUNTIME = "Runtime: agent=small | session=agent:small:explicit:trip | sessionId=trip | host=vm | shell=bash"
SPLIT_TURN = [
    {"role": "system", "content": "You are a personal assistant running inside OpenClaw. (Rebuilt, shorter.)"},
    U([{"type": "text", "text": SPLIT_SUMMARY}, {"type": "text", "text": RUNTIME}]),
    A("TAP is cheapest at 210 EUR."),
    U("[Fri 2026-12-04 23:20 UTC] Book it."),
    CTX(),
]


# --- the rule -----------------------------------------------------------------------------------------


@pytest.mark.unit
def test_the_turn_before_a_compaction_pairs_with_the_messages_after_its_reply():
    rules = SideRules.load(None)
    assert pair_next_state(RECORDED, REPLY, AFTER, rules).kind == "mismatch"  # the history was rewritten
    match = pair_across_compaction(RECORDED, REPLY, AFTER, rules)
    assert match is not None and match.kept == 1  # the message the reply answered, then the reply
    assert match.pairing.kind == "paired" and match.pairing.next_state == [U("Book it.")]
    assert "compaction" in (match.pairing.note or "")
    # a longer kept tail counts every recorded message kept before the reply
    longer = [SYSTEM, U(SUMMARY), A("Sure: when?"), U("In May. Compare flights."), A(REPLY["content"]), U("ok")]
    assert pair_across_compaction(RECORDED, REPLY, longer, rules).kept == 2  # type: ignore[union-attr]
    # OpenClaw's split turn: a new system prompt, the message the reply answered summarised; the reply is left
    match = pair_across_compaction(RECORDED, REPLY, SPLIT_TURN, rules)
    assert match is not None and (match.kept, match.same_opening) == (0, False)
    assert match.pairing.next_state == [U("[Fri 2026-12-04 23:20 UTC] Book it.")]


@pytest.mark.unit
def test_tool_results_and_kept_side_exchanges_after_the_reply():
    rules = SideRules.load(None)
    call = TOOL_CALL("notes.md")
    reply = {"content": "", "tool_calls": call["tool_calls"]}
    result = {"role": "tool", "tool_call_id": "call1", "content": "file text"}
    after = [SYSTEM, U(SUMMARY), U("Read my notes."), call, result, CTX()]
    match = pair_across_compaction([SYSTEM, U("Read my notes."), CTX()], reply, after, rules)
    assert match is not None and match.pairing.next_state == [result]
    # OpenClaw's memory flush kept after the reply is a side exchange: no feedback, left out
    flushed = [*AFTER[:4], U(OPENCLAW_FLUSH), A("NO_REPLY"), U("Book it."), CTX()]
    match = pair_across_compaction(RECORDED, REPLY, flushed, rules)
    assert match is not None and match.pairing.next_state == [U("Book it.")]
    assert "openclaw_memory_flush" in (match.pairing.note or "")


@pytest.mark.unit
@pytest.mark.parametrize(
    ("after", "reply"),
    [
        ([SYSTEM, U(SUMMARY), U("Book it.")], REPLY),  # the reply was summarised away: nothing marks the turn
        ([*AFTER[:4], A("Booked."), U("thanks")], REPLY),  # another reply after it
        (AFTER[:4], REPLY),  # no feedback after it
        ([*AFTER[:3], A("TAP is cheapest at 199 EUR."), U("Book it.")], REPLY),  # the reply was edited
        ([SYSTEM, U(SUMMARY), U("In May. Compare flights."), U("Book it.")], {"content": "", "tool_calls": None}),
    ],
    ids=["reply-summarised", "another-reply", "no-feedback", "edited", "invisible"],
)
def test_no_pairing_across_a_compaction(after, reply):
    assert pair_across_compaction(RECORDED, reply, after, SideRules.load(None)) is None


@pytest.mark.unit
def test_the_turn_whose_messages_were_kept_most_wins():
    def turn(sid: str, messages: list[dict]) -> Turn:
        return Turn(session_id=sid, turn_index=0, created_at=0.0, messages=messages, response=REPLY)

    # the same agent's other conversation whose reply reads the same: it pairs too (the reply is the evidence), but
    # a turn whose recorded messages were kept, or whose opening was, ranks above it
    opening = turn("opening", [SYSTEM, U("Other task.")])
    stranger = turn("stranger", [U("Other agent."), U("Other task.")])
    weak = turn("weak", [SYSTEM, U("In May. Compare flights.")])
    strong = turn("strong", [SYSTEM, A("Sure: when?"), U("In May. Compare flights.")])
    after = [SYSTEM, U(SUMMARY), A("Sure: when?"), U("In May. Compare flights."), A(REPLY["content"]), U("ok")]
    found = find_compacted([stranger, opening, weak, strong], after)
    assert found is not None and found[0].session_id == "strong" and found[1].kept == 2 and not found[2]
    found = find_compacted([stranger, opening], after)
    assert found is not None and found[0].session_id == "opening" and found[1].same_opening and not found[2]
    twin = turn("twin", [SYSTEM, A("Sure: when?"), U("In May. Compare flights.")])
    found = find_compacted([strong, twin], after)
    assert found is not None and found[0].session_id == "strong" and found[2]  # a tie: the oldest
    found = find_compacted([weak, opening], SPLIT_TURN)  # nothing but the reply left: a tie, the oldest
    assert found is not None and found[0].session_id == "weak" and found[1].kept == 0 and found[2]
    # two OpenClaw sessions of one agent awaiting replies that read the same: the key's predecessor wins the tie
    other, mine = turn("task-a:0", weak.messages), turn("task-b:0", weak.messages)
    found = find_compacted([other, mine], SPLIT_TURN, key="task-b:1")
    assert found is not None and found[0].session_id == "task-b:0" and not found[2]
    assert find_compacted([weak], [U("In May. Compare flights.")]) is None


# --- the session rules, against a store ---------------------------------------------------------------


def _record(messages: list[dict], reply: str) -> TurnRecord:
    return TurnRecord(
        messages=messages,
        prompt_ids=[1, 2],
        response_ids=[3, 4],
        rollout_logprobs=[-0.1, -0.2],
        response={"content": reply, "tool_calls": None},
        weight_version="v0",
    )


@pytest.mark.unit
@pytest.mark.parametrize(
    ("before", "after", "decision_sid"),
    [
        # OpenClaw's prompt_cache_key: "<session>:<compactions>", a new key after the compaction
        (SessionHint("oc:0", PROMPT_CACHE_KEY), SessionHint("oc:1", PROMPT_CACHE_KEY), "oc:1"),
        # a static header: the conversation's next session is a new member of the key's family
        (SessionHint("static", HEADER), SessionHint("static", HEADER), "static~"),
        (SessionHint(None, INFERRED), SessionHint(None, INFERRED), INFERRED_PREFIX),
    ],
    ids=["prompt-cache-key", "header", "inferred"],
)
async def test_a_compaction_pairs_the_turn_before_and_starts_the_next_session(tmp_path, before, after, decision_sid):
    store = Store(tmp_path / "data")
    try:
        tracker = SessionTracker(store, idle_timeout_s=600)
        tracker.side_rules = SideRules.load(None)
        resolver = SessionResolver(store, tracker, Metrics(), infer=True)

        async def turn(hint: SessionHint, messages: list[dict], reply: str):
            ident = await resolver.resolve(hint, messages, main=True, done=False)
            await tracker.on_main_turn(ident.sid, _record(messages, reply), done=False, arrival=ident.arrival)
            return ident

        # another conversation awaits a reply that reads the same: the turn the request kept more of wins
        stranger = await turn(SessionHint(None, INFERRED), [SYSTEM, U("Other task."), CTX()], REPLY["content"])
        first = await turn(before, RECORDED[:2] + [CTX()], "Sure: when?")
        second = await turn(before, RECORDED, REPLY["content"])
        assert second.sid == first.sid and second.decision == "continued"
        nxt = await turn(after, AFTER, "Booked.")
        assert nxt.decision == "compacted" and nxt.sid.startswith(decision_sid) and nxt.sid != first.sid
        assert nxt.arrival is None or nxt.arrival.prior is None  # a full render: the summary broke token continuity
        await tracker.drain_settles()
        paired = store.get_turn(first.sid, 1)
        assert paired.pairing == "paired" and paired.next_state == [U("Book it.")]
        assert nxt.sid in paired.pairing_note and not tracker.in_flight(first.sid)
        assert store.get_turn(stranger.sid, 0).pairing == "awaiting"
        assert tracker.compactions == 1
        # the conversation goes on in its new session, by the ordinary rule
        more = await turn(after, [*AFTER[:-1], A("Booked."), U("Thanks!"), CTX()], "You're welcome.")
        assert (more.sid, more.decision) == (nxt.sid, "continued")
    finally:
        store.close()


@pytest.mark.unit
async def test_a_turn_being_continued_is_not_claimed_across_a_compaction(tmp_path):
    store = Store(tmp_path / "data")
    try:
        tracker = SessionTracker(store, idle_timeout_s=600)
        tracker.side_rules = SideRules.load(None)
        resolver = SessionResolver(store, tracker, Metrics(), infer=True)
        store.record_turn("oc:0", _record(RECORDED, REPLY["content"]), session_done=False)
        extending = [*RECORDED[:-1], A(REPLY["content"]), U("Book it."), CTX()]
        claim = await resolver.resolve(SessionHint("oc:0", PROMPT_CACHE_KEY), extending, main=True, done=False)
        assert claim.sid == "oc:0" and claim.decision == "continued"
        # in flight: the compacted request finds nothing to pair and starts its own session
        late = await resolver.resolve(SessionHint("oc:1", PROMPT_CACHE_KEY), AFTER, main=True, done=False)
        assert (late.sid, late.decision) == ("oc:1", "started")
        tracker.settle_later(claim.arrival)
        await tracker.drain_settles()
        assert store.get_turn("oc:0", 0).next_state == [U("Book it.")]
        assert tracker.compactions == 0
    finally:
        store.close()


# --- over HTTP ------------------------------------------------------------------------------------------


@pytest.mark.e2e
def test_openclaw_shaped_compaction_over_http(engine, tiny_model_dir, tmp_path):
    """The real policy server and engine, a client that sends what OpenClaw sends around a compaction: two turns
    under ``prompt_cache_key`` ``oc-task:0``, its compaction's summary call (side), then the compacted request under
    ``oc-task:1``. The turn before the compaction is paired (its sample goes to the judge); the request after it is a
    full render in the new session; stats and metrics count the decision."""
    pol = start_policy(tiny_model_dir, engine.url, tmp_path / "data", tmp_path, name="policy-compaction")
    try:
        with client(pol.url) as c:

            def ask(messages: list[dict], key: str) -> httpx.Response:
                body = {"messages": messages, "max_tokens": 8, "seed": 1, "prompt_cache_key": key}
                r = c.post("/v1/chat/completions", json=body)
                assert r.status_code == 200, r.text
                return r

            history = [SYSTEM, U("Plan a trip to Lisbon.")]
            r1 = ask([*history, CTX()], "oc-task:0")
            history += [A(r1.json()["choices"][0]["message"]["content"]), U("In May. Compare flights.")]
            r2 = ask([*history, CTX()], "oc-task:0")
            reply = r2.json()["choices"][0]["message"]["content"]
            summary_call = [
                {"role": "system", "content": "You are a context summarization assistant. Your task is ..."},
                U("<conversation>...</conversation>"),
            ]
            ask(summary_call, "oc-task:0")
            compacted = [SYSTEM, U(SUMMARY), U("In May. Compare flights."), A(reply), U("Book it."), CTX()]
            r3 = ask(compacted, "oc-task:1")
            assert r3.headers["x-hindsight-session-id"] == "oc-task:1"
        adm = admin(pol.url)
        rows = adm.get("/v1/samples", params={"session_id": "oc-task:0"}).json()["samples"]
        assert len(rows) == 2  # both turns have a sample: the one before the compaction is no longer stranded
        store = Store(tmp_path / "data")
        try:
            before, after = store.get_turn("oc-task:0", 1), store.get_turn("oc-task:1", 0)
        finally:
            store.close()
        assert before.pairing == "paired", before.pairing_note
        assert before.next_state == [U("Book it.")] and "oc-task:1" in before.pairing_note
        assert (after.session_rule, after.session_decision) == (PROMPT_CACHE_KEY, "compacted")
        stats = adm.get("/v1/samples/stats").json()
        assert stats["turns_by_session_rule"]["prompt_cache_key:compacted"] == 1
        assert stats["side_turns"] == {"openclaw_compaction_summary": 1}
        metrics = httpx.get(pol.url + "/metrics", headers={"Authorization": f"Bearer {CLIENT_KEY}"}).text
        assert 'hindsight_policy_session_identity_total{decision="compacted",rule="prompt_cache_key"} 1.0' in metrics
        # a full render with no prior turn, like the conversation's and the summary call's first requests: the
        # summary broke the token continuity with the turn it pairs
        assert 'hindsight_policy_prompt_renders_total{reason="no_prior_turn"} 3.0' in metrics, [
            line for line in metrics.splitlines() if line.startswith("hindsight_policy_prompt_renders_total")
        ]
    finally:
        pol.stop()
