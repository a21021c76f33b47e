"""Side-turn rules: which requests are served but never trained, for clients that cannot say so.

Role: a request is *side* (answered, recorded as side, never paired or judged) when its ``X-Turn-Type``
says ``side`` (rule ``header``), else when one of these rules matches it. Stock agents send no turn
type, and their housekeeping calls (a scheduled heartbeat, a memory flush before compaction, a title)
would otherwise be trained as if a user had asked for them.

A rule is ``{"name", "pattern", "field"}``: ``pattern`` a regular expression searched (not anchored unless it
says ``^``) in the text of ``field``: ``last_user`` (the last user message that is not ephemeral, see below: a
housekeeping run that calls a tool is still the same run on its next request) or ``system`` (the
system/developer messages). The first matching rule wins. Shipped defaults (:data:`DEFAULT_RULES`) match
what stock OpenClaw (npm ``openclaw`` 2026.9) sends:

- ``openclaw_heartbeat``: its heartbeat prompt, "Follow the heartbeat monitor scratch context when
  provided. ..." (older releases: "Read HEARTBEAT.md if it exists ...");
- ``openclaw_memory_flush``: its pre-compaction flush, a user prompt starting "Pre-compaction memory
  flush." with a system prompt "Pre-compaction memory flush turn. ...";
- ``openclaw_compaction_summary``: the summary call of its compaction, system prompt "You are a context
  summarization assistant. ...";
- ``title``: a request whose last user message asks for a title ("Generate a short title ...").

*Ephemeral* messages are a second list: user messages a client adds to every request and never keeps in its
history (stock OpenClaw's trailing ``<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>`` message); pairing compares
transcripts without them (policy_server.serving.pairing.pair_next_state).

Other agents add rules in a file (``side_rules_file``: JSON or YAML ``{"rules": [...], "ephemeral": [...],
"replace_defaults": false}``); its rules are tried before the defaults, or alone with ``replace_defaults: true``. A malformed
file or pattern stops the server at start with the reason (never a silently empty rule set).
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

HEADER_RULE = "header"


@dataclass(frozen=True)
class SideRule:
    """One rule: ``pattern`` searched in the text of ``field``."""

    name: str
    pattern: re.Pattern[str]
    field: Literal["last_user", "system"] = "last_user"


DEFAULT_RULES: tuple[SideRule, ...] = (
    SideRule(
        "openclaw_heartbeat",
        re.compile(r"Follow the heartbeat monitor scratch context when provided\.|Read HEARTBEAT\.md if it exists"),
    ),
    SideRule("openclaw_memory_flush", re.compile(r"^\s*Pre-compaction memory flush\.")),
    SideRule("openclaw_memory_flush", re.compile(r"^\s*Pre-compaction memory flush turn\."), field="system"),
    SideRule(
        "openclaw_compaction_summary", re.compile(r"^\s*You are a context summarization assistant\."), field="system"
    ),
    SideRule(
        "title",
        re.compile(
            r"^\s*(?:please\s+)?(?:generate|write|create|suggest|give)\s+(?:me\s+)?(?:a\s+)?"
            r"(?:short\s+|concise\s+|brief\s+)?title\b",
            re.IGNORECASE,
        ),
    ),
)


# Messages a client adds to every request and never keeps in its history (stock OpenClaw appends a user message
# with per-request runtime context): pairing compares transcripts without them.
DEFAULT_EPHEMERAL: tuple[SideRule, ...] = (
    SideRule("openclaw_internal_context", re.compile(r"^\s*<<<BEGIN_OPENCLAW_INTERNAL_CONTEXT>>>")),
)


class SideRulesError(ValueError):
    """The side rules file cannot be used (the server refuses to start)."""


def message_text(message: dict[str, object]) -> str:
    """The text of a message: its string content, or its text parts joined."""
    content = message.get("content")
    if isinstance(content, list):
        return "".join(p.get("text", "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return content if isinstance(content, str) else ""


def _system(messages: list[dict[str, object]]) -> str:
    return "\n".join(message_text(m) for m in messages if m.get("role") in ("system", "developer"))


class SideRules:
    """The rule set of one server; :meth:`match` names the first rule a request matches (pure)."""

    def __init__(
        self, rules: tuple[SideRule, ...] = DEFAULT_RULES, ephemeral: tuple[SideRule, ...] = DEFAULT_EPHEMERAL
    ):
        self.rules = rules
        self.ephemeral_rules = ephemeral

    def is_ephemeral(self, message: dict[str, object]) -> bool:
        """Whether a user message is per-request context the client never keeps in its history (pure)."""
        if message.get("role") != "user":
            return False
        text = message_text(message)
        return any(rule.pattern.search(text) for rule in self.ephemeral_rules)

    @classmethod
    def load(cls, path: str | None) -> SideRules:
        """The defaults, with ``path``'s rules first (or alone when it says ``replace_defaults``)."""
        if not path:
            return cls()
        try:
            text = Path(path).read_text(encoding="utf-8")
            if path.endswith((".yaml", ".yml")):
                import yaml

                data = yaml.safe_load(text)
            else:
                data = json.loads(text)
        except (OSError, ValueError) as exc:
            raise SideRulesError(f"side rules file {path}: {exc}") from None
        if not isinstance(data, dict) or not isinstance(data.get("rules"), list):
            raise SideRulesError(f"side rules file {path}: expected an object with a 'rules' list")
        extra = tuple(_parse_rule(r, i, path) for i, r in enumerate(data["rules"]))
        eph = tuple(_parse_rule(r, i, path) for i, r in enumerate(data.get("ephemeral") or []))
        if data.get("replace_defaults"):
            return cls(extra, eph)
        return cls(extra + DEFAULT_RULES, eph + DEFAULT_EPHEMERAL)

    def last_user(self, messages: list[dict[str, object]]) -> str:
        """The text of the last user message the client keeps in its history (ephemeral ones are skipped: stock
        OpenClaw ends every request, its heartbeat too, with a per-request context message)."""
        for m in reversed(messages):
            if m.get("role") == "user" and not self.is_ephemeral(m):
                return message_text(m)
        return ""

    def match(self, messages: list[dict[str, object]]) -> str | None:
        """The name of the first rule the request matches, or None (a main turn)."""
        texts: dict[str, str] = {}
        for rule in self.rules:
            if rule.field not in texts:
                texts[rule.field] = self.last_user(messages) if rule.field == "last_user" else _system(messages)
            if rule.pattern.search(texts[rule.field]):
                return rule.name
        return None


def _parse_rule(raw: object, i: int, path: str) -> SideRule:
    if not isinstance(raw, dict) or not isinstance(raw.get("name"), str) or not isinstance(raw.get("pattern"), str):
        raise SideRulesError(f"side rules file {path}: rule {i} needs a string 'name' and 'pattern'")
    field = raw.get("field", "last_user")
    if field not in ("last_user", "system"):
        raise SideRulesError(f"side rules file {path}: rule {i} 'field' must be last_user or system, got {field!r}")
    unknown = set(raw) - {"name", "pattern", "field"}
    if unknown:
        raise SideRulesError(f"side rules file {path}: rule {i} has unknown key(s) {sorted(unknown)}")
    try:
        pattern = re.compile(raw["pattern"])
    except re.error as exc:
        raise SideRulesError(f"side rules file {path}: rule {i} pattern: {exc}") from None
    if raw["name"] == HEADER_RULE:
        raise SideRulesError(f"side rules file {path}: rule name {HEADER_RULE!r} is reserved")
    return SideRule(raw["name"], pattern, field)
