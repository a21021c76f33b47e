"""Secrets in conversations: found by detect-secrets plus a patterns file, redacted before anything is stored.

Role: credentials that pass through an agent (an API key in a tool result, a private key the model was shown, a
password a user typed) must never reach the store, the judge or the weights. :class:`SecretScanner` scans every
string of a message list (text, tool call arguments, tool results) and of a reply with

- the maintained detect-secrets plugins that recognise a credential by its own shape (AWS, GitHub, OpenAI, Slack,
  Stripe, JWT, private keys, keyword assignments such as ``password = ...``; the high-entropy plugins are left
  out: on prose they flag ordinary words), and
- the regexes of ``secret_patterns.yaml`` (next to this module) and of the operator's own patterns file, which
  match the WHOLE secret (a plugin may report only its prefix, e.g. ``ghp``).

Contract: :meth:`SecretScanner.redact` returns a copy in which every finding is replaced by
``[REDACTED:<kind>]`` and the sorted kinds found (empty: nothing found, the value is returned as is). A detector
finding is widened to the token around it (the run of non-space characters), so a prefix never leaves the
rest of the secret behind. Redaction is deterministic: the same text redacts the same way, so a redacted stored
transcript still compares equal with the redacted next request (pairing), and a conversation resent with a few
more messages is walked only past the start it shares with one found clean before
(:meth:`SecretScanner.redact_transcript`). A turn whose prompt or reply held a
secret cannot be trained (its token ids encode the secret): its record is stored without token ids and its
sample is rejected with reason ``secret`` (policy_server.store.privacy).
"""

from __future__ import annotations

import collections
import hashlib
import re
import threading
from dataclasses import dataclass
from importlib import resources
from pathlib import Path
from typing import Any

import yaml
from detect_secrets.core.scan import scan_line
from detect_secrets.settings import transient_settings

from engine.records import TurnRecord
from policy_server.serving.clean_transcripts import CleanTranscripts
from policy_server.serving.prompt_size import string_chars

MARK = "[REDACTED:{}]"
CACHE_ENTRIES = 16384  # distinct strings whose scan result is remembered
# Characters of the clean transcripts remembered (SecretScanner.redact_transcript), about one per live session:
# the size of the store's turn cache (1.2M prompt tokens), whose records share these lists.
CLEAN_TRANSCRIPT_CHARS = 5_000_000
_MARK_RE = re.compile(r"\[REDACTED:[a-z0-9_ ]+\]", re.IGNORECASE)

# detect-secrets plugins that recognise a credential by its shape (no entropy guesses on prose).
PLUGINS = (
    "AWSKeyDetector",
    "ArtifactoryDetector",
    "AzureStorageKeyDetector",
    "BasicAuthDetector",
    "CloudantDetector",
    "DiscordBotTokenDetector",
    "GitHubTokenDetector",
    "GitLabTokenDetector",
    "IbmCloudIamDetector",
    "IbmCosHmacDetector",
    "JwtTokenDetector",
    "KeywordDetector",
    "MailchimpDetector",
    "NpmDetector",
    "OpenAIDetector",
    "PrivateKeyDetector",
    "PypiTokenDetector",
    "SendGridDetector",
    "SlackDetector",
    "SoftlayerDetector",
    "SquareOAuthDetector",
    "StripeDetector",
    "TelegramBotTokenDetector",
    "TwilioKeyDetector",
)
_SETTINGS = {"plugins_used": [{"name": name} for name in PLUGINS], "filters_used": []}
_TOKEN = re.compile(r"[^\s\"'`<>()\[\]{},;]+")


def load_patterns(path: str | Path | None = None) -> dict[str, re.Pattern[str]]:
    """The shipped patterns, then those of ``path`` (same YAML shape: ``patterns: {name: regex}``); ValueError
    naming the entry for a file that is not that shape or a regex that does not compile."""
    texts = [resources.files("policy_server.serving").joinpath("secret_patterns.yaml").read_text("utf-8")]
    if path:
        texts.append(Path(path).read_text("utf-8"))
    out: dict[str, re.Pattern[str]] = {}
    for text in texts:
        doc = yaml.safe_load(text) or {}
        entries = doc.get("patterns") if isinstance(doc, dict) else None
        if not isinstance(entries, dict):
            raise ValueError("a secret patterns file must be a mapping with a 'patterns' mapping of name: regex")
        for name, regex in entries.items():
            if not isinstance(name, str) or not re.fullmatch(r"[a-z0-9_]+", name) or not isinstance(regex, str):
                raise ValueError(f"secret pattern {name!r}: names are [a-z0-9_]+ and regexes strings")
            try:
                out[name] = re.compile(regex)
            except re.error as exc:
                raise ValueError(f"secret pattern {name!r} does not compile: {exc}") from None
    return out


def _kind(plugin_type: str) -> str:
    return re.sub(r"[^a-z0-9]+", "_", plugin_type.lower()).strip("_")


@dataclass(frozen=True)
class Redacted:
    """One redaction of ``source`` (the object scanned): ``value`` and ``kinds`` as :meth:`SecretScanner.redact`
    returns them."""

    source: Any
    value: Any
    kinds: list[str]


class SecretScanner:
    """Finds and redacts secrets in strings and in JSON-shaped values (see the module docstring)."""

    def __init__(self, patterns_path: str | Path | None = None) -> None:
        self.patterns = load_patterns(patterns_path)
        # An agent resends its whole history every turn: each distinct string is scanned once, not per request.
        # Keyed by a digest, and a clean text's result holds no copy of it: the cache stays small with long prompts.
        self._cache: collections.OrderedDict[bytes, tuple[str | None, frozenset[str]]] = collections.OrderedDict()
        self._cache_lock = threading.Lock()
        self._clean = CleanTranscripts(CLEAN_TRANSCRIPT_CHARS)

    def redact_text(self, text: str) -> tuple[str, frozenset[str]]:
        """``text`` with every secret replaced by its marker, and the kinds found."""
        key = hashlib.blake2b(text.encode("utf-8", "surrogatepass"), digest_size=20).digest()
        with self._cache_lock:
            hit = self._cache.get(key)
            if hit is not None:
                self._cache.move_to_end(key)
        if hit is None:
            redacted, kinds = self._scan_text(text)
            hit = (redacted if kinds else None, kinds)
            with self._cache_lock:
                self._cache[key] = hit
                while len(self._cache) > CACHE_ENTRIES:
                    self._cache.popitem(last=False)
        return (text if hit[0] is None else hit[0]), hit[1]

    def _scan_text(self, text: str) -> tuple[str, frozenset[str]]:
        kinds: set[str] = set()
        for name, pattern in self.patterns.items():
            text, n = pattern.subn(MARK.format(name), text)
            if n:
                kinds.add(name)
        spans: list[tuple[int, int, str]] = []
        offset = 0
        with transient_settings(_SETTINGS):
            for line in text.splitlines(keepends=True):
                for found in scan_line(line.rstrip("\r\n")):
                    value = found.secret_value or ""
                    if not value or _MARK_RE.fullmatch(value) or "REDACTED" in value:
                        continue
                    for m in re.finditer(re.escape(value), line):
                        token = next((t for t in _TOKEN.finditer(line) if t.start() <= m.start() < t.end()), None)
                        start, end = (token.start(), token.end()) if token else (m.start(), m.end())
                        start, end = min(start, m.start()), max(end, m.end())
                        spans.append((offset + start, offset + end, _kind(found.type)))
                offset += len(line)
        for start, end, kind in sorted(spans, reverse=True):  # right to left: earlier offsets stay valid
            if _MARK_RE.fullmatch(text[start:end]):
                continue
            text = text[:start] + MARK.format(kind) + text[end:]
            kinds.add(kind)
        return text, frozenset(kinds)

    def redact(self, value: Any) -> tuple[Any, list[str]]:
        """A copy of a JSON-shaped value (messages, tools, a reply) with every string redacted, and the sorted
        kinds found; the value itself when nothing was found."""
        kinds: set[str] = set()
        out = self._walk(value, kinds)
        return (out, sorted(kinds)) if kinds else (value, [])

    def redact_transcript(self, messages: list[Any]) -> Redacted:
        """:meth:`redact` of a conversation's messages, which an agent resends every turn with a few more.

        Its longest start equal, value for value, to a transcript this method found clean before is clean without
        being walked again: redaction is deterministic and string by string, so equal strings redact alike (each
        of them would still be hashed to find its cached result). Only the messages after it are redacted; a
        transcript found clean is remembered in place of the one it extends. The caller must not change a
        transcript it handed in (the chat turn keeps the request's messages as they came).

        The value starts with that clean transcript's own message objects, equal to the request's: the turn it
        was recorded with holds the same objects, so the pairing's comparisons with it are identity checks."""
        known, known_chars = self._clean.longest(messages)
        n = len(known) if known is not None else 0
        kinds: set[str] = set()
        tail = [self._walk(m, kinds) for m in messages[n:]]
        if kinds:
            return Redacted(messages, [*(known or []), *tail], sorted(kinds))
        self._clean.remember(messages, known_chars + string_chars(messages[n:]), replaces=known)
        return Redacted(messages, [*known, *messages[n:]] if known is not None else messages, [])

    def _walk(self, value: Any, kinds: set[str]) -> Any:
        if isinstance(value, str):
            text, found = self.redact_text(value)
            kinds |= found
            return text
        if isinstance(value, dict):
            return {k: self._walk(v, kinds) for k, v in value.items()}
        if isinstance(value, list):
            return [self._walk(v, kinds) for v in value]
        return value


def redact_record(
    scanner: SecretScanner | None, record: TurnRecord, messages: Redacted | None = None
) -> tuple[TurnRecord, list[str]]:
    """``record`` as the store may keep it, and the secret kinds found in its messages, tools or reply.

    ``messages``: a redaction made already (a turn redacts its transcript when it arrives, for the pairing);
    used when its ``source`` is ``record.messages`` itself, the same list object, else the messages are
    scanned here. With a secret, the texts are redacted and the token ids and log-probs dropped: the ids
    encode the secret, and a turn without them is never trained (its sample is rejected ``secret``). Without
    one, ``record`` itself and ``[]``."""
    if scanner is None:
        return record, []
    if messages is None or messages.source is not record.messages:
        messages = scanner.redact_transcript(record.messages)
    tools, k2 = scanner.redact(record.tools)
    response, k3 = scanner.redact(record.response)
    kinds = sorted(set(messages.kinds) | set(k2) | set(k3))
    if not kinds:
        return record, []
    update = {"messages": messages.value, "tools": tools, "response": response}
    update |= {"prompt_ids": [], "response_ids": [], "rollout_logprobs": []}
    return record.model_copy(update=update), kinds
