"""Deterministic guards the judge runs beside the votes: named rules over one (turn, next_state) pair.

Role: the part of a verdict that needs no model. Each guard is a pure check of the judged step; when it
fires, its configured action decides what happens to the PRM verdict, and the verdict lists every guard
that fired (:class:`~engine.records.GuardHit`), so an audit can tell a voted score from a ruled one.

Rules (:data:`GUARD_RULES`; the detail string of a hit says what was seen):

- ``tool_error``: a tool result in the next state is an error: the message carries ``is_error: true`` or
  ``status: "error"``, or its text is a JSON object with a non-empty top-level ``error`` key, or it starts
  with the word ``Error`` / ``Exception`` (any case) or ``Traceback (most recent call last)``.
- ``repeated_tool_call``: a tool call of the response repeats an earlier assistant tool call of the
  context exactly (same name, same arguments as parsed JSON; call ids ignored).
- ``truncated``: the reply was cut by its length limit (``finish_reason`` ``length``, or Anthropic's
  ``max_tokens``).
- ``degenerate``: an empty reply (no text, no reasoning, no tool call), or a text at least
  ``DEGENERATE_MIN_CHARS`` long that is one short unit (1..``DEGENERATE_MAX_UNIT`` characters) repeated
  back to back at least ``DEGENERATE_MIN_REPEATS`` times over at least ``DEGENERATE_COVER`` of it (``"!!!!…"``, ``"the the the …"``).
- ``malformed_tool_call``: a tool call with an empty name, a name the request's tools do not offer (when
  tools are given), or arguments that are not a JSON object.

Actions (:data:`GUARD_ACTIONS`): ``override`` sets the PRM score to -1 whatever the votes said;
``abstain`` withholds the score (status ``abstained``: no verdict to train on); ``quarantine`` marks the
step degenerate (status ``quarantined``): its sample never becomes leasable. ``off`` disables a rule.
When several fire, the strongest action decides: quarantine > abstain > override.

Configuration: :func:`parse_guard_actions` reads ``rule=action`` items (the judge's ``--guards`` setting)
over the defaults; :func:`guards_version` names the rule set and configuration (``guards@<sha256-12>``).

Defaults (:data:`DEFAULT_GUARD_ACTIONS`) are chosen by measurement on AgentProcessBench's labelled steps
(``hindsight-judge-eval``, docs/JUDGE_QUALITY.md): a rule that sets a score is on only where its -1
precision there is at least :data:`MIN_DEFAULT_PRECISION`; a quarantine rule is on only where the labelled
steps hold what it reads (:func:`decidable`) and it never fires on a step labelled +1 or 0 there. So
``degenerate`` is on (it read all 597 replies and fired on no good one) and ``truncated`` is off: the labelled
steps carry no finish reason, so nothing measured it (switch it on with ``--guards truncated`` to keep replies
cut by ``max_tokens`` out of training, as overlong filtering does).
"""

from __future__ import annotations

import hashlib
import json
import re
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, get_args

from engine.records import GuardAction, GuardHit

GUARD_ACTIONS: tuple[str, ...] = get_args(GuardAction)
GuardSetting = Literal["override", "abstain", "quarantine", "off"]
GUARD_RULES: tuple[str, ...] = ("tool_error", "repeated_tool_call", "truncated", "degenerate", "malformed_tool_call")
# The action strength order when several rules fire on one step.
ACTION_RANK: dict[str, int] = {"override": 1, "abstain": 2, "quarantine": 3}
MIN_DEFAULT_PRECISION = 0.8

DEGENERATE_MIN_CHARS = 16
DEGENERATE_MAX_UNIT = 16
DEGENERATE_COVER = 0.8
DEGENERATE_MIN_REPEATS = 8
# Whole words only: "Exceptional results" or "Errors are rare in ..." are not error reports.
_ERROR_START = re.compile(r"(error\b|exception\b|traceback \(most recent call last\))", re.IGNORECASE)
_LENGTH_REASONS = frozenset({"length", "max_tokens"})


@dataclass(frozen=True)
class GuardedStep:
    """The judged step as the guards read it: plain chat-message dicts (``context`` before the response,
    the ``response`` itself, the ``next_state`` after it) and the tools the request offered (None: unknown)."""

    context: Sequence[Mapping[str, Any]]
    response: Mapping[str, Any]
    next_state: Sequence[Mapping[str, Any]]
    tools: Sequence[Mapping[str, Any]] | None = None


def text_of(content: Any) -> str:
    """A message content as text: a string as is, the text parts of a part list joined, else empty."""
    if isinstance(content, list):
        return "".join(str(p.get("text", "")) for p in content if isinstance(p, dict))
    return content if isinstance(content, str) else ""


def _function(call: Mapping[str, Any]) -> Mapping[str, Any]:
    fn = call.get("function")
    return fn if isinstance(fn, Mapping) else call


def _call_key(call: Mapping[str, Any]) -> tuple[str, str]:
    """A tool call's identity for repeats: its name and its arguments as canonical JSON (raw text if unparsable)."""
    fn = _function(call)
    args = fn.get("arguments")
    if isinstance(args, str):
        try:
            args = json.loads(args)
        except ValueError:
            return str(fn.get("name") or ""), args.strip()
    return str(fn.get("name") or ""), json.dumps(args, sort_keys=True, ensure_ascii=False)


def _calls(message: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    calls = message.get("tool_calls")
    return [c for c in calls if isinstance(c, Mapping)] if isinstance(calls, list) else []


def tool_error(step: GuardedStep) -> str | None:
    for msg in step.next_state:
        if msg.get("role") != "tool":
            continue
        if msg.get("is_error") is True or msg.get("status") == "error":
            return "tool result marked as an error"
        text = text_of(msg.get("content")).strip()
        if text.startswith("{"):
            try:
                body = json.loads(text)
            except ValueError:
                body = None
            if isinstance(body, dict) and body.get("error"):
                return f"tool result error: {str(body['error'])[:120]}"
        if _ERROR_START.match(text):
            return f"tool result starts with an error: {text[:120]}"
    return None


def repeated_tool_call(step: GuardedStep) -> str | None:
    earlier = {_call_key(c) for m in step.context if m.get("role") == "assistant" for c in _calls(m)}
    for call in _calls(step.response):
        key = _call_key(call)
        if key in earlier:
            return f"repeats the earlier call {key[0]}({key[1][:120]})"
    return None


def truncated(step: GuardedStep) -> str | None:
    reason = step.response.get("finish_reason") or step.response.get("stop_reason")
    if reason in _LENGTH_REASONS:
        return f"cut by its length limit (finish_reason={reason})"
    return None


def repeated_unit(text: str) -> tuple[str, int] | None:
    """The shortest unit whose back-to-back repeats cover at least DEGENERATE_COVER of ``text``, with the count."""
    if len(text) < DEGENERATE_MIN_CHARS:
        return None
    for size in range(1, DEGENERATE_MAX_UNIT + 1):
        # A unit repeated back to back is a run of positions where text[i] == text[i + size]; a run long
        # enough must start by ``latest_start``, so a text that has none by then is left early (this runs
        # on every judge request, in the event loop).
        needed = DEGENERATE_COVER * len(text) - size
        latest_start = len(text) - needed
        best = best_start = run = 0
        for i in range(len(text) - size):
            run = run + 1 if text[i] == text[i + size] else 0
            if run > best:
                best, best_start = run, i - run + 1
            if run == 0 and i > latest_start:
                break
        count = (best + size) // size
        if count >= DEGENERATE_MIN_REPEATS and best + size >= DEGENERATE_COVER * len(text):
            return text[best_start : best_start + size], count
    return None


def degenerate(step: GuardedStep) -> str | None:
    text = text_of(step.response.get("content"))
    reasoning = text_of(step.response.get("reasoning_content"))
    if not text.strip() and not reasoning.strip() and not _calls(step.response):
        return "empty reply"
    for part in (text, reasoning):
        found = repeated_unit(part.strip())
        if found is not None:
            unit, count = found
            return f"one unit repeated {count} times: {unit!r}"
    return None


def malformed_tool_call(step: GuardedStep) -> str | None:
    offered = None
    if step.tools is not None:
        offered = {str(_function(t).get("name")) for t in step.tools if isinstance(t, Mapping)}
    for call in _calls(step.response):
        fn = _function(call)
        name = fn.get("name")
        if not isinstance(name, str) or not name.strip():
            return "tool call without a name"
        if offered is not None and name not in offered:
            return f"tool {name!r} is not among the offered tools"
        args = fn.get("arguments")
        if isinstance(args, str):
            try:
                args = json.loads(args) if args.strip() else {}
            except ValueError:
                return f"arguments of {name!r} are not JSON: {args[:120]}"
        if not isinstance(args, dict):
            return f"arguments of {name!r} are not a JSON object"
    return None


CHECKS = {
    "tool_error": tool_error,
    "repeated_tool_call": repeated_tool_call,
    "truncated": truncated,
    "degenerate": degenerate,
    "malformed_tool_call": malformed_tool_call,
}
assert tuple(CHECKS) == GUARD_RULES

# Chosen by hindsight-judge-eval on the 597 labelled AgentProcessBench steps (docs/JUDGE_QUALITY.md);
# tests/judge/test_guard_defaults.py re-measures them and fails when a default no longer follows its figures.
DEFAULT_GUARD_ACTIONS: dict[str, GuardSetting] = {
    "tool_error": "off",
    "repeated_tool_call": "off",
    "truncated": "off",
    "degenerate": "quarantine",
    "malformed_tool_call": "off",
}
# The action each rule takes when switched on without one named (what the rule means).
NATURAL_ACTIONS: dict[str, GuardAction] = {
    "tool_error": "override",
    "repeated_tool_call": "override",
    "truncated": "quarantine",
    "degenerate": "quarantine",
    "malformed_tool_call": "override",
}


def decidable(rule: str, step: GuardedStep) -> bool:
    """Whether ``step`` holds what ``rule`` reads (a finish reason for ``truncated``; every step for the others)."""
    if rule == "truncated":
        return step.response.get("finish_reason") is not None or step.response.get("stop_reason") is not None
    return True


def fired_rules(step: GuardedStep, rules: Iterable[str] = GUARD_RULES) -> dict[str, str]:
    """Every rule of ``rules`` that fires on ``step``, with its detail, whatever its configured action."""
    out: dict[str, str] = {}
    for rule in rules:
        detail = CHECKS[rule](step)
        if detail is not None:
            out[rule] = detail
    return out


class Guards:
    """The configured guard set: which rules run and with which action (``off`` rules never run)."""

    def __init__(self, actions: Mapping[str, str] | None = None):
        merged: dict[str, str] = {**DEFAULT_GUARD_ACTIONS, **(actions or {})}
        for rule, action in merged.items():
            if rule not in CHECKS:
                raise ValueError(f"unknown guard {rule!r}; known: {', '.join(GUARD_RULES)}")
            if action not in (*GUARD_ACTIONS, "off"):
                raise ValueError(
                    f"guard {rule}: action must be one of {', '.join(GUARD_ACTIONS)} or off, got {action!r}"
                )
        self.actions: dict[str, GuardAction] = {r: a for r, a in merged.items() if a != "off"}  # type: ignore[misc]

    def run(self, step: GuardedStep) -> list[GuardHit]:
        """The hits of the enabled rules on ``step``, in rule order."""
        return [
            GuardHit(rule=rule, action=self.actions[rule], detail=detail)
            for rule, detail in fired_rules(step, self.actions).items()
        ]


def parse_guard_actions(spec: str | Mapping[str, str] | None) -> dict[str, GuardSetting]:
    """Every rule's setting: ``spec`` (``rule=action`` items, comma-separated, or a mapping; a bare ``rule``
    takes its :data:`NATURAL_ACTIONS` one) merged over :data:`DEFAULT_GUARD_ACTIONS`, in rule order.

    Raises ValueError naming the item for an unknown rule or action, an item without a rule, or a rule set twice.
    """
    given: dict[str, str] = {}
    if isinstance(spec, Mapping):
        given = {str(k).strip(): str(v).strip() for k, v in spec.items()}
    elif spec is not None:
        for item in (part.strip() for part in spec.split(",")):
            if not item:
                continue
            rule, sep, action = (x.strip() for x in item.partition("="))
            if not rule:
                raise ValueError(f"guards: {item!r} names no rule (use rule=action)")
            if rule in given:
                raise ValueError(f"guards: {rule} is set twice")
            given[rule] = action if sep else NATURAL_ACTIONS.get(rule, "")
    for rule, action in given.items():
        if rule not in CHECKS:
            raise ValueError(f"guards: unknown rule {rule!r}; known: {', '.join(GUARD_RULES)}")
        if action not in (*GUARD_ACTIONS, "off"):
            raise ValueError(f"guards: {rule}: action must be one of {', '.join(GUARD_ACTIONS)} or off, got {action!r}")
    merged: dict[str, GuardSetting] = {**DEFAULT_GUARD_ACTIONS, **given}  # type: ignore[dict-item]
    return {rule: merged[rule] for rule in GUARD_RULES}


def guards_version(actions: Mapping[str, str]) -> str:
    """``guards@<sha256-12>`` of this module's text (the rules and their thresholds) and the resolved
    actions: any change to either changes the version, so verdicts recorded under other guards are told apart."""
    digest = hashlib.sha256(Path(__file__).read_bytes())
    digest.update(json.dumps({r: actions.get(r, "off") for r in GUARD_RULES}, sort_keys=True).encode())
    return f"guards@{digest.hexdigest()[:12]}"


def decisive(hits: Sequence[GuardHit]) -> GuardHit | None:
    """The hit whose action decides the verdict (the strongest; the first of equals), or None."""
    return max(hits, key=lambda h: ACTION_RANK[h.action], default=None)
