"""Transcripts the secret scanner found clean, found again as the start of the next request's (pure memory).

Role: an agent resends its whole conversation every turn with a few messages more. Redaction is deterministic and
string by string (policy_server.serving.secrets), so a list of messages equal, value for value, to one found clean
before is clean: :class:`CleanTranscripts` finds the longest such start of a new transcript with one list
comparison (C-level) instead of the per-string digests and cache lookups a walk costs (about 0.6 ms for a
30k-token conversation).

Contract: :meth:`CleanTranscripts.longest` returns the length of the longest remembered list the given one starts
with, compared by value (``==``), so a hit can never be wrong; the lookup key (a list's length and its last
message) only narrows the search, and lists that share it (agents in lockstep resend the same tool results and user
prompts at the same positions) share a bucket of :data:`BUCKET` candidates. A new request is looked for as the
extension of a list at most :data:`PROBES` messages shorter. The lists are kept, not copied: whoever hands one in
must not change it afterwards. Bounded by the characters of the lists' strings, least recently used out.
"""

from __future__ import annotations

import collections
import threading
from typing import Any

# Messages a turn may add to the transcript it resends and still have that transcript found.
PROBES = 32
# Lists remembered under one key (same length, same last message) before the oldest is dropped.
BUCKET = 16

_Entry = tuple[list[Any], int]  # (the list, characters of its strings)


def _key(messages: list[Any], n: int) -> tuple[int, int]:
    last = messages[n - 1]
    role = last.get("role") if isinstance(last, dict) else None
    content = last.get("content") if isinstance(last, dict) else None
    return n, hash((role if isinstance(role, str) else None, content if isinstance(content, str) else None))


class CleanTranscripts:
    """Message lists found clean (see the module docstring). Thread-safe."""

    def __init__(self, max_chars: int) -> None:
        self.max_chars = max_chars
        self._buckets: collections.OrderedDict[tuple[int, int], list[_Entry]] = collections.OrderedDict()
        self._chars = 0
        self._lock = threading.Lock()

    def longest(self, messages: list[Any]) -> tuple[list[Any] | None, int]:
        """The longest remembered list ``messages`` starts with and the characters of its strings; (None, 0): none."""
        for n in range(len(messages), max(0, len(messages) - PROBES), -1):
            key = _key(messages, n)
            with self._lock:
                bucket = self._buckets.get(key)
                if bucket is None:
                    continue
                self._buckets.move_to_end(key)
                candidates = list(bucket)
            head = messages[:n]
            for known, chars in candidates:
                if len(known) == n and head == known:
                    return known, chars
        return None, 0

    def remember(self, messages: list[Any], chars: int, replaces: list[Any] | None = None) -> None:
        """Keep ``messages`` (its strings ``chars`` characters long) in place of ``replaces``, the remembered list it
        extends (superseded: the next request extends this one)."""
        if not messages or chars > self.max_chars:
            return
        key = _key(messages, len(messages))
        with self._lock:
            if replaces:
                self._drop(_key(replaces, len(replaces)), replaces)
            bucket = self._buckets.setdefault(key, [])
            self._buckets.move_to_end(key)
            bucket.insert(0, (messages, chars))
            self._chars += chars
            while len(bucket) > BUCKET:
                self._chars -= bucket.pop()[1]
            while self._chars > self.max_chars:
                _, oldest = self._buckets.popitem(last=False)
                self._chars -= sum(c for _, c in oldest)

    def _drop(self, key: tuple[int, int], known: list[Any]) -> None:
        bucket = self._buckets.get(key)
        if bucket is None:
            return
        for i, (entry, chars) in enumerate(bucket):
            if entry is known:
                del bucket[i]
                self._chars -= chars
                break
        if not bucket:
            del self._buckets[key]
