"""The pairing rule: does a new main request extend the awaiting turn, and with what next state (pure).

Role: compare a session's awaiting turn (its request messages and its recorded reply) with a new main request's
messages and say ``paired`` (with the next state) or ``mismatch`` (with why); nothing here reads or writes the
store. policy_server.serving.sessions applies the outcome, policy_server.serving.identity and
policy_server.serving.session_inference use it to find the session a request belongs to.

Pairing rule. Let the session's awaiting turn T have request messages ``M`` and
sampled assistant reply ``R``; a new *main* request of the same session has messages ``N``:

1. ``N`` extends T when ``N[:len(M)]`` equals ``M`` and ``N[len(M)]`` is an assistant message equal to
   ``R`` (messages are compared by role, text content with surrounding whitespace stripped, tool calls
   by function name and parsed JSON arguments, tool results by ``tool_call_id``; ``reasoning_content``
   is ignored because clients commonly drop it from the history). An assistant message's text is compared
   as its reader sees it: reasoning blocks written inline (``<think>…</think>``, ``<thinking>``,
   ``<thought>``, ``<reasoning>``) removed and whitespace runs collapsed, because agents such as OpenClaw
   hide those blocks and rejoin the pieces around them when they resend the reply. A recorded reply with
   nothing visible (no text and no tool calls: all reasoning) may be missing from ``N`` altogether, since
   clients drop empty assistant messages; then the next state follows ``M`` directly.
2. Then T's next state is ``N[len(M)+1:]``: one user reply, or one or more tool results (each typed by
   role), possibly followed by a user message. It must be non-empty and contain only ``user``/``tool``
   messages; a system/developer message appended by the client is not feedback on R and is dropped from
   the next state (recorded in the note). A side exchange the client kept in the transcript (a user message a side
   rule matches, e.g. an agent's memory flush, with its reply) is left out first (policy_server.serving.side_rules).
3. Across a compaction (:func:`pair_across_compaction`): a client that compacts its context (OpenClaw) replaces
   the early history with a summary and resends only a recent tail, so ``N`` no longer starts with ``M``. ``N``
   still pairs T when its last assistant message is ``R`` (compared as in 1; a reply with nothing visible cannot
   be found this way) and only user/tool feedback follows it (2 applies to it), whatever came before ``R``: a
   summary, a shorter tail, even another system prompt (OpenClaw rebuilds its own after a compaction, and may cut
   right at ``R``, summarising the message it answered as a "split turn"). The recorded reply is the evidence; how
   much more of ``M`` ``N`` kept (the messages right before ``R``, the opening message) ranks the candidates, in
   the session rules (policy_server.serving.identity), which also decide the session the request belongs to.
4. Anything else (history rewritten without the reply, reply edited, no new message) is a **mismatch**.
   Conservative decision: the pair cannot be trusted, so T is resolved as ``mismatch`` and its sample is
   **rejected** with reason ``history_mismatch`` (counted per session and in stats) instead of being
   judged against feedback that may belong to a different reply. The new request is served and recorded
   normally and starts a fresh pairing.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field

from policy_server.serving.side_rules import SideRules

FEEDBACK_ROLES = ("user", "tool")


@dataclass(frozen=True)
class Pairing:
    """Outcome of comparing a new request with the awaiting turn."""

    kind: str  # "paired" | "mismatch"
    next_state: list[dict[str, object]] | None = None
    note: str | None = None
    dropped: list[str] = field(default_factory=list)


def _args(value: object) -> object:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return value.strip()
    return value


def _text(content: object) -> str:
    if isinstance(content, list):
        content = "".join(p.get("text", "") for p in content if isinstance(p, dict) and p.get("type") == "text")
    return content.strip() if isinstance(content, str) else ""


# Inline reasoning blocks a client may hide from a resent reply (a stray closing tag stays: clients keep it).
_INLINE_REASONING = re.compile(r"<(think|thinking|thought|reasoning)\b[^<>]*>.*?</\1\s*>", re.DOTALL | re.IGNORECASE)
_SPACES = re.compile(r"\s+")


def visible_text(text: str) -> str:
    """An assistant text as its reader sees it: inline reasoning blocks removed, whitespace runs collapsed (pure)."""
    if "<" in text:
        text = _INLINE_REASONING.sub(" ", text)
    return _SPACES.sub(" ", text).strip()


def _items(value: object) -> list[object]:
    """A JSON list (tool calls, content parts); ``[]`` when absent or null."""
    return value if isinstance(value, list) else []


def _call_key(call: object) -> tuple[object, str]:
    """A tool call's name and its arguments as canonical JSON (a call off the shape keys as no name, no args)."""
    fn = call.get("function") if isinstance(call, dict) else None
    fn = fn if isinstance(fn, dict) else {}
    return fn.get("name"), json.dumps(_args(fn.get("arguments")), sort_keys=True)


def message_key(msg: dict[str, object]) -> tuple[object, ...]:
    """What must stay equal for two messages to count as the same history entry."""
    calls = tuple(_call_key(tc) for tc in _items(msg.get("tool_calls")))
    text = _text(msg.get("content"))
    return (
        msg.get("role"),
        visible_text(text) if msg.get("role") == "assistant" else text,
        calls,
        msg.get("tool_call_id") if msg.get("role") == "tool" else None,
    )


def drop_side_exchanges(
    tail: list[dict[str, object]], side_rules: SideRules | None
) -> tuple[list[dict[str, object]], list[str]]:
    """``tail`` without the exchanges a side rule claims (a user message the rules match, and the assistant/tool
    messages after it up to the next user message), and the names of the rules that matched (pure).

    A stock agent keeps its housekeeping runs (a memory flush, a heartbeat) in the conversation it resends; they are
    no feedback on the recorded reply and must not turn the next turn into a mismatch.
    """
    if side_rules is None:
        return tail, []
    kept: list[dict[str, object]] = []
    names: list[str] = []
    i = 0
    while i < len(tail):
        name = side_rules.match([tail[i]]) if tail[i].get("role") == "user" else None
        if name is None:
            kept.append(tail[i])
            i += 1
            continue
        names.append(name)
        i += 1
        while i < len(tail) and tail[i].get("role") != "user":
            i += 1
    return kept, names


def pair_next_state(
    prev_messages: list[dict[str, object]],
    prev_response: dict[str, object],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None = None,
) -> Pairing:
    """Apply the pairing rule of the module docstring (pure); with ``side_rules``, side exchanges after the recorded
    reply are left out first (:func:`drop_side_exchanges`), and ephemeral messages are ignored everywhere."""
    expected = message_key({"role": "assistant", **prev_response})
    # A reply with nothing to show (all reasoning, e.g. cut by max_tokens in its think block) is one a client
    # may leave out of the history it resends (OpenClaw does): then the feedback follows the history directly.
    invisible = not expected[1] and not expected[2]
    after = _after_history(prev_messages, new_messages, side_rules, min_after=1 if invisible else 2)
    if isinstance(after, Pairing):
        return after
    omitted = invisible and after[0].get("role") != "assistant"
    if not omitted and message_key(after[0]) != expected:
        n = sum(1 for m in prev_messages if side_rules is None or not side_rules.is_ephemeral(m))
        return Pairing("mismatch", note=f"message {n} is not the recorded assistant reply")
    tail, side = drop_side_exchanges(after if omitted else after[1:], side_rules)
    kept = [dict(m) for m in tail if m.get("role") in FEEDBACK_ROLES]
    dropped = [str(m.get("role")) for m in tail if m.get("role") not in FEEDBACK_ROLES]
    if not kept:
        return Pairing("mismatch", note="no user or tool message after the recorded reply")
    if any(m.get("role") == "assistant" for m in tail):
        return Pairing("mismatch", note="another assistant message follows the recorded reply")
    state = [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")} for m in kept]
    for m in state:
        m["content"] = _text(m.get("content"))
    notes = ["the client left out the recorded reply (nothing visible in it)"] if omitted else []
    notes += [f"dropped non-feedback roles {dropped}"] if dropped else []
    notes += [f"left out side exchanges {side}"] if side else []
    return Pairing("paired", next_state=state, note="; ".join(notes) or None, dropped=dropped)


@dataclass(frozen=True)
class CompactionMatch:
    """How a request pairs an awaiting turn across a compaction: the pairing, how many of the turn's recorded
    messages (from its end: the message the reply answered, then earlier ones) the request kept right before the
    reply, and whether it opens with the turn's opening message."""

    pairing: Pairing
    kept: int
    same_opening: bool


def pair_across_compaction(
    prev_messages: list[dict[str, object]],
    prev_response: dict[str, object],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None = None,
) -> CompactionMatch | None:
    """Rule 3 of the module docstring (pure): the match, or None when ``new_messages`` does not end with the
    recorded reply and feedback. Try :func:`pair_next_state` first: a request that extends the recorded history
    pairs by that rule (this one would also accept it)."""
    expected = message_key({"role": "assistant", **prev_response})
    if not expected[1] and not expected[2]:
        return None  # nothing visible: clients leave such a reply out, so it cannot mark where the history resumes
    if side_rules is not None:
        prev_messages = [m for m in prev_messages if not side_rules.is_ephemeral(m)]
        new_messages = [m for m in new_messages if not side_rules.is_ephemeral(m)]
    # The recorded reply is the request's last assistant message once kept side exchanges are left out.
    at = next((i for i in range(len(new_messages) - 1, -1, -1) if message_key(new_messages[i]) == expected), None)
    if at is None or not prev_messages:
        return None
    tail, side = drop_side_exchanges(new_messages[at + 1 :], side_rules)
    feedback = [m for m in tail if m.get("role") in FEEDBACK_ROLES]
    dropped = [str(m.get("role")) for m in tail if m.get("role") not in FEEDBACK_ROLES]
    if not feedback or "assistant" in dropped:
        return None  # no feedback, or another reply after this one
    kept = 0
    while kept < min(at, len(prev_messages)) and message_key(new_messages[at - 1 - kept]) == message_key(
        prev_messages[-1 - kept]
    ):
        kept += 1
    same_opening = at > 0 and message_key(new_messages[0]) == message_key(prev_messages[0])
    state = [{k: v for k, v in m.items() if k in ("role", "content", "tool_call_id", "name")} for m in feedback]
    for m in state:
        m["content"] = _text(m.get("content"))
    notes = [
        f"paired across a compaction: the history before the reply was rewritten ({kept} recorded message(s) kept)"
    ]
    notes += [f"dropped non-feedback roles {dropped}"] if dropped else []
    notes += [f"left out side exchanges {side}"] if side else []
    return CompactionMatch(
        Pairing("paired", next_state=state, note="; ".join(notes), dropped=dropped), kept, same_opening
    )


def _after_history(
    prev_messages: list[dict[str, object]],
    new_messages: list[dict[str, object]],
    side_rules: SideRules | None,
    min_after: int = 2,
) -> list[dict[str, object]] | Pairing:
    """The (non-ephemeral) messages of ``new_messages`` after the recorded history, at least ``min_after``, or
    the mismatch that says why there are none (pure)."""
    k = len(prev_messages)
    if len(new_messages) >= k + min_after and new_messages[:k] == prev_messages:
        # The history came back exactly as recorded (the usual case, one C-level comparison): only what
        # follows it needs a look. Ephemeral filtering is per message, so it changes neither side's copy of it.
        rest = new_messages[k:]
        if side_rules is not None:
            rest = [m for m in rest if not side_rules.is_ephemeral(m)]
        if len(rest) >= min_after:
            return rest
    if side_rules is not None:
        prev_messages = [m for m in prev_messages if not side_rules.is_ephemeral(m)]
        new_messages = [m for m in new_messages if not side_rules.is_ephemeral(m)]
    n = len(prev_messages)
    if len(new_messages) < n + min_after:
        expected = n + min_after - 1
        return Pairing("mismatch", note=f"new history has {len(new_messages)} messages, expected more than {expected}")
    for i, (old, new) in enumerate(zip(prev_messages, new_messages[:n], strict=True)):
        if message_key(old) != message_key(new):
            return Pairing("mismatch", note=f"message {i} ({old.get('role')}) was rewritten")
    return new_messages[n:]
