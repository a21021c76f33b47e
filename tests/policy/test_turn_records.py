"""Turn records stored as what each turn adds (policy_server.store.turn_records), on both backends.

Contract: a turn that continues the turn it answers stores only its tails (``record_base`` names that turn)
and every reader (the writing store, a second replica, a reopened store) gets back the whole record, equal
to what was recorded; a turn whose history was rewritten is stored whole; the cache can miss but never
serves a record another row holds; a row off the schema fails every reader loudly (a record is validated as it
is read from the database, not again on each read from the cache). Also: the pairing's exact-history fast path
decides as the full check.
"""

from __future__ import annotations

import json

import pytest
from pydantic import ValidationError

from engine.records import Turn, TurnRecord
from policy_server.serving.pairing import pair_next_state
from policy_server.serving.side_rules import SideRules
from policy_server.store import Resolution
from policy_server.store.turn_records import TurnCache, pack, unpack

pytestmark = pytest.mark.unit

SYSTEM = {"role": "system", "content": "You manage files. " * 50}


def _record(messages: list[dict], prompt_ids: list[int], response_ids: list[int], rid: str) -> dict:
    return {
        "chat_template_kwargs": None,
        "messages": messages,
        "tools": None,
        "prompt_ids": prompt_ids,
        "response_ids": response_ids,
        "rollout_logprobs": [-0.25] * len(response_ids),
        "response": {"content": f"reply {rid}", "reasoning_content": None, "tool_calls": None},
        "weight_version": "v0",
        "weight_versions": ["v0"],
        "sampling_params": {"temperature": 1.0},
        "constrained": False,
        "response_id": rid,
        "session_rule": "header",
        "session_decision": "continued",
    }


def _session(n_turns: int) -> list[dict]:
    """Whole records of a session whose every turn continues the previous one exactly."""
    messages = [SYSTEM, {"role": "user", "content": "list the files"}]
    prompt = list(range(100, 400))
    out = []
    for t in range(n_turns):
        reply = [1000 + t, 1001 + t, 7]
        out.append(_record(list(messages), list(prompt), reply, f"chatcmpl-{t}"))
        messages = [*messages, {"role": "assistant", "content": f"reply {t}"}, {"role": "user", "content": f"go {t}"}]
        prompt = [*prompt, *reply, 50 + t, 51]
    return out


def _record_session(store, sid: str, records: list[dict]) -> None:
    for t, rec in enumerate(records):
        resolve = None
        if t:
            store.awaiting_turn(sid)  # what serving does before recording: the awaiting turn is read
            resolve = Resolution(t - 1, "paired", [{"role": "user", "content": f"go {t - 1}"}])
        assert store.record_turn(sid, TurnRecord.model_validate(rec), session_done=False, resolve=resolve) == t


def _raw(store, sid: str) -> list[tuple[str, str | None]]:
    with store._read() as db:
        rows = db.execute(
            "SELECT record, record_base FROM turns WHERE session_id=? ORDER BY turn_index", (sid,)
        ).fetchall()
    return [(r["record"], r["record_base"]) for r in rows]


def _whole(turn: Turn | None) -> dict:
    """The record fields of a stored turn."""
    assert turn is not None
    recorded = turn.to_json()
    return {k: recorded[k] for k in _record([], [], [], "x")}


def test_continuing_turns_store_their_tails_and_every_reader_gets_whole_records(store_factory):
    records = _session(4)
    writer = store_factory()
    _record_session(writer, "s", records)
    raw = _raw(writer, "s")
    assert raw[0][1] is None  # the first turn has nothing to continue: whole
    assert all(base is not None for _, base in raw[1:])
    assert max(len(r) for r, _ in raw[1:]) < len(raw[0][0])  # a tail, not the growing history
    replica = store_factory()  # a second replica (and a restart): nothing cached
    for st in (writer, replica):
        assert [_whole(st.get_turn("s", t)) for t in range(4)] == records
        assert _whole(st.awaiting_turn("s")) == records[3]
        [open_turn] = [t for t in st.awaiting_open_turns() if t.session_id == "s"]
        assert _whole(open_turn) == records[3]
    cold = store_factory()
    assert [_whole(t.turn) for t in cold.session_trajectory("s")] == records


def test_a_rewritten_history_is_stored_whole(store_factory):
    first, second = _session(2)
    second = dict(second, messages=[{"role": "system", "content": "rewritten"}, *second["messages"][1:]])
    second["prompt_ids"] = [9, *second["prompt_ids"][1:]]
    st = store_factory()
    _record_session(st, "w", [first, second])
    assert _raw(st, "w")[1][1] is None
    assert _whole(store_factory().get_turn("w", 1)) == second


def test_turns_recorded_at_alternating_replicas_read_back_whole_everywhere(store_factory):
    records = _session(5)
    a, b = store_factory(), store_factory()
    for t, rec in enumerate(records):
        st = (a, b)[t % 2]
        resolve = None
        if t:
            st.awaiting_turn("r")
            resolve = Resolution(t - 1, "paired", [{"role": "user", "content": "go"}])
        st.record_turn("r", TurnRecord.model_validate(rec), session_done=False, resolve=resolve)
    for st in (a, b, store_factory()):
        assert [_whole(st.get_turn("r", t)) for t in range(5)] == records


def test_a_row_off_the_schema_fails_loudly_when_read_and_cached_records_are_validated_once(store_factory):
    records = _session(2)
    writer = store_factory()
    _record_session(writer, "v", records)
    # A row written off the schema (a token id that is no int) by anything but this store: every reader fails
    # loudly, whether the row is read alone, as the base of a later turn or with its whole session.
    bad = dict(records[0], prompt_ids=["7", *records[0]["prompt_ids"][1:]])
    with writer._tx() as db:
        db.execute("UPDATE turns SET record=? WHERE session_id=? AND turn_index=0", (json.dumps(bad), "v"))
    cold = store_factory()
    with pytest.raises(ValidationError):
        cold.get_turn("v", 0)
    with pytest.raises(ValidationError):
        store_factory().get_turn("v", 1)  # rebuilt along its base: the base's bad id is in its prompt
    with pytest.raises(ValidationError):
        store_factory().session_trajectory("v")
    # The writer's cache holds what it recorded (validated as a TurnRecord when built): its reads share the
    # cached lists instead of walking 30k-token histories again, and equal what was recorded.
    turn = writer.get_turn("v", 1)
    assert _whole(turn) == records[1]
    assert turn is not None and turn.prompt_ids is writer.get_turn("v", 1).prompt_ids


def test_a_record_json_with_shared_lists_equals_the_dumped_one():
    record = TurnRecord.model_validate(_session(2)[1])
    shared = record.to_json(share=("messages", "prompt_ids"))
    assert shared == record.to_json() and list(shared) == list(record.to_json())  # same keys, same order
    assert shared["prompt_ids"] is record.prompt_ids and shared["messages"] is record.messages
    partial = TurnRecord(response_ids=[1]).to_json(share=("messages", "prompt_ids"))
    assert partial == {"response_ids": [1]}  # a field never set stays absent


def test_pack_and_unpack_round_trip_partial_prefixes():
    base = _record([SYSTEM, {"role": "user", "content": "u"}], [1, 2, 3], [4, 5], "b")
    whole = _record([*base["messages"], {"role": "assistant", "content": "a"}], [1, 2, 3, 4, 5, 6], [7], "n")
    stored, ref = pack(whole, 0, base)
    assert stored["messages"] == [{"role": "assistant", "content": "a"}] and stored["prompt_ids"] == [6]
    assert unpack(stored, ref, base) == whole
    only_prompt = dict(whole, prompt_ids=[1, 2, 3, 9])  # the reply was re-rendered: only the prompt continues
    stored, ref = pack(only_prompt, 0, base)
    assert stored["prompt_ids"] == [9] and unpack(stored, ref, base) == only_prompt
    unrelated = dict(whole, messages=[{"role": "user", "content": "x"}], prompt_ids=[8])
    assert pack(unrelated, 0, base) == (unrelated, None)
    assert pack(whole, 0, None) == (whole, None)
    with pytest.raises(ValueError):
        unpack(stored, ref, None)


def test_turn_cache_checks_the_row_and_stays_within_its_token_budget():
    cache = TurnCache(max_tokens=10)
    cache.put("s", 0, {"prompt_ids": [1, 2, 3], "response_ids": [4], "response_id": "r0"})
    assert cache.get("s", 0, "r0") is not None
    assert cache.get("s", 0, "another") is None  # a different row under the same key is no hit
    cache.put("s", 1, {"prompt_ids": [1, 2, 3, 4], "response_ids": [5], "response_id": "r1"})
    assert cache.get("s", 0, "r0") is None and cache.get("s", 1, "r1") is not None  # oldest out
    cache.put("s", 2, {"prompt_ids": list(range(20)), "response_ids": [], "response_id": "r2"})
    assert cache.get("s", 2, "r2") is None  # larger than the whole budget: never cached


EPH = {"role": "user", "content": "<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>> time is 12:00"}


@pytest.mark.parametrize("rules", [None, SideRules()])
def test_exact_history_fast_path_decides_as_the_full_comparison(rules):
    prev = [SYSTEM, {"role": "user", "content": "hi"}]
    reply = {"content": "hello"}
    same = [*prev, {"role": "assistant", "content": "hello"}, {"role": "user", "content": "next"}]
    respaced = [SYSTEM, {"role": "user", "content": " hi\n"}, *same[2:]]  # equal by the pairing rule only
    with_eph = [*prev, EPH, {"role": "assistant", "content": "hello"}, EPH, {"role": "user", "content": "next"}]
    for new in (same, respaced):
        p = pair_next_state(prev, reply, new, rules)
        assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "next"}]
    p = pair_next_state(prev, reply, with_eph, rules)
    if rules is None:  # without rules the context message is history like any other
        assert p.kind == "mismatch" and "message 2 is not the recorded assistant reply" in p.note
    else:
        assert p.kind == "paired" and p.next_state == [{"role": "user", "content": "next"}]
    wrong = [*prev, {"role": "assistant", "content": "other"}, {"role": "user", "content": "next"}]
    assert "message 2 is not the recorded assistant reply" in pair_next_state(prev, reply, wrong, rules).note
    short = [*prev, {"role": "assistant", "content": "hello"}]
    assert "expected more than 3" in pair_next_state(prev, reply, short, rules).note
