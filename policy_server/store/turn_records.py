"""Turn records stored as what each turn adds, and an in-process cache of whole records.

Role: keeps the cost of recording and reading a continuing turn independent of its history length, while
the database stays the one source of truth.

Storage. A turn that continues an earlier turn K of its session (its request messages start with K's
messages, its prompt ids with K's prompt + sampled ids, both exactly) stores in ``turns.record`` only its
own tails, and in ``turns.record_base`` the JSON ``{"turn_index": K, "messages": n, "prompt_ids": m}``:

    messages   = whole(K).messages[:n] + record.messages
    prompt_ids = (whole(K).prompt_ids + whole(K).response_ids)[:m] + record.prompt_ids

A turn with no such base (the first of a session, a rewritten history) stores its whole record and a NULL
base. Every other field of the record is stored as it is. Readers always get the whole record
(:meth:`TurnRecords.whole`), never a tail.

Cache. ``(session_id, turn_index) -> whole record``, filled when this process records a turn (after the
commit) and when it rebuilds one from the database. A turn's row is written once and its record never
changes (only its pairing columns do), and rows are never deleted, so a cached record is the row's record
at every replica: a cache can miss, never be stale. The row's ``response_id`` is checked against the
cached one on every hit anyway. Bounded by a token budget (prompt ids held), least recently used first out.
Cached records are shared: callers must not change them in place (readers get a shallow copy whose lists are
the cache's).

Validation. Every record :class:`TurnRecords` hands out has passed :class:`~engine.records.TurnRecord`'s
validation once: a recorded turn's when it was built (the store is given a ``TurnRecord``), a record read
from the database when it is read, before it is cached. Readers (policy_server.store.rows.turn_of) therefore
need not walk its messages and prompt ids again on every read; a row that breaks the schema fails loudly
when it is read, never half-read.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from collections.abc import Sequence

from engine import fastjson
from engine.records import TurnRecord
from policy_server.store.connection import DB, DBRow

# The cache holds at most this many prompt tokens' worth of whole records (about 40 turns of 30k tokens).
DEFAULT_CACHE_TOKENS = 1_200_000
DEFAULT_CACHE_TURNS = 4096


class TurnCache:
    """Thread-safe LRU of whole turn records keyed by (session_id, turn_index); see the module docstring."""

    def __init__(self, max_tokens: int = DEFAULT_CACHE_TOKENS, max_turns: int = DEFAULT_CACHE_TURNS) -> None:
        self.max_tokens, self.max_turns = max_tokens, max_turns
        self._items: OrderedDict[tuple[str, int], dict[str, object]] = OrderedDict()
        self._tokens = 0
        self._lock = threading.Lock()
        self.hits = 0
        self.misses = 0

    @staticmethod
    def _size(record: dict[str, object]) -> int:
        return len(_seq(record, "prompt_ids")) + len(_seq(record, "response_ids")) + 1

    def get(self, session_id: str, turn_index: int, response_id: str | None = None) -> dict[str, object] | None:
        """The cached whole record, or None; a record whose ``response_id`` differs from the row's is no hit."""
        key = (session_id, turn_index)
        with self._lock:
            rec = self._items.get(key)
            if rec is None or rec.get("response_id") != response_id:
                self.misses += 1
                return None
            self._items.move_to_end(key)
            self.hits += 1
            return rec

    def peek(self, session_id: str, turn_index: int) -> dict[str, object] | None:
        """The cached whole record without a row to check it against (the writer's own base turn)."""
        with self._lock:
            return self._items.get((session_id, turn_index))

    def put(self, session_id: str, turn_index: int, record: dict[str, object]) -> None:
        size = self._size(record)
        if size > self.max_tokens:
            return
        key = (session_id, turn_index)
        with self._lock:
            old = self._items.pop(key, None)
            if old is not None:
                self._tokens -= self._size(old)
            self._items[key] = record
            self._tokens += size
            while self._items and (self._tokens > self.max_tokens or len(self._items) > self.max_turns):
                _, dropped = self._items.popitem(last=False)
                self._tokens -= self._size(dropped)

    def clear(self) -> None:
        with self._lock:
            self._items.clear()
            self._tokens = 0


def pack(
    record: dict[str, object], base_index: int, base: dict[str, object] | None
) -> tuple[dict[str, object], str | None]:
    """(what to store in ``turns.record``, ``turns.record_base`` JSON or None) for a whole ``record`` whose
    session's turn ``base_index`` has the whole record ``base`` (None: unknown here, store it whole)."""
    if base is None:
        return record, None
    messages, prompt_ids = _seq(record, "messages"), _seq(record, "prompt_ids")
    bm, bp, br = _seq(base, "messages"), _seq(base, "prompt_ids"), _seq(base, "response_ids")
    # Exact equality (not the pairing's looser message comparison): the rebuilt record is the recorded one.
    n = len(bm) if len(messages) >= len(bm) and messages[: len(bm)] == bm else 0
    m = 0
    if len(prompt_ids) >= len(bp) and prompt_ids[: len(bp)] == bp:
        m = len(bp)
        if prompt_ids[m : m + len(br)] == br:
            m += len(br)
    if n == 0 and m == 0:
        return record, None
    stored = dict(record, messages=messages[n:], prompt_ids=prompt_ids[m:])
    return stored, json.dumps({"turn_index": base_index, "messages": n, "prompt_ids": m})


def unpack(stored: dict[str, object], base_json: str | None, whole_base: dict[str, object] | None) -> dict[str, object]:
    """The whole record from its stored form and (when it has a base) its base turn's whole record."""
    if not base_json:
        return stored
    if whole_base is None:
        raise ValueError("a turn record stored as a continuation needs its base turn's record")
    ref = json.loads(base_json)
    n, m = int(ref["messages"]), int(ref["prompt_ids"])
    bp = _seq(whole_base, "prompt_ids")
    head = bp[:m] if m <= len(bp) else bp + _seq(whole_base, "response_ids")[: m - len(bp)]
    return dict(
        stored,
        messages=_seq(whole_base, "messages")[:n] + _seq(stored, "messages"),
        prompt_ids=head + _seq(stored, "prompt_ids"),
    )


def _seq(record: dict[str, object], key: str) -> list[object]:
    """A list field of a record's JSON (messages, ids); ``[]`` when absent or null."""
    value = record.get(key)
    return value if isinstance(value, list) else []


def base_index(base_json: str | None) -> int | None:
    return int(json.loads(base_json)["turn_index"]) if base_json else None


class TurnRecords:
    """Whole records of stored turns, through ``cache``; the row-reading half of the module docstring."""

    def __init__(self, cache: TurnCache) -> None:
        self.cache = cache

    def whole(self, db: DB, row: DBRow) -> dict[str, object]:
        """The whole record of a ``turns`` row (a cached copy, else rebuilt from the database and validated).

        ``row`` needs ``session_id``, ``turn_index`` and ``response_id``; its ``record`` and ``record_base``
        are used when present (a row read without them costs one more query on a cache miss)."""
        sid, idx, rid = row["session_id"], row["turn_index"], row["response_id"]
        hit = self.cache.get(sid, idx, rid)
        if hit is not None:
            return hit
        keys = row.keys()
        if "record" in keys and not ("record_base" in keys and row["record_base"]):
            rec: dict[str, object] = fastjson.loads(row["record"])  # stored whole: no chain to follow
        else:
            rec = self._rebuild(db, sid, idx)
        TurnRecord.model_validate(rec)  # read from the database: validated once, before it is cached
        self.cache.put(sid, idx, rec)
        return rec

    def _rebuild(self, db: DB, session_id: str, turn_index: int) -> dict[str, object]:
        """Follow the base chain of one turn back to a whole or cached record, then apply the tails. One query:
        the session's rows up to the turn (tails, and the whole records the chain starts from)."""
        rows = {
            r["turn_index"]: r
            for r in db.execute(
                "SELECT turn_index, record, record_base, response_id FROM turns WHERE session_id=? AND turn_index<=?",
                (session_id, turn_index),
            ).fetchall()
        }
        chain: list[tuple[dict[str, object], str | None]] = []
        idx: int | None = turn_index
        whole: dict[str, object] | None = None
        while idx is not None:
            r = rows.get(idx)
            if r is None:
                raise LookupError(f"turn {idx} of session {session_id!r} is missing (a record's base)")
            if chain:  # the requested turn itself was a miss already
                whole = self.cache.get(session_id, idx, r["response_id"])
                if whole is not None:
                    break
            chain.append((fastjson.loads(r["record"]), r["record_base"]))
            idx = base_index(r["record_base"])
        for stored, base_json in reversed(chain):
            whole = unpack(stored, base_json, whole)
        assert whole is not None
        return whole

    def session(self, db: DB, rows: Sequence[DBRow]) -> list[dict[str, object]]:
        """Whole records of every row of one session, ``rows`` in turn order with ``record`` and
        ``record_base``: each base is an earlier row, so one pass rebuilds them all."""
        done: dict[int, dict[str, object]] = {}
        out = []
        for row in rows:
            idx = row["turn_index"]
            rec = self.cache.get(row["session_id"], idx, row["response_id"])
            if rec is None:
                stored = fastjson.loads(row["record"])
                b = base_index(row["record_base"])
                if b is not None and b not in done:
                    done[b] = self._rebuild(db, row["session_id"], b)
                rec = unpack(stored, row["record_base"], done.get(b) if b is not None else None)
                TurnRecord.model_validate(rec)  # read from the database: validated as it is handed out
            done[idx] = rec
            out.append(rec)
        return out
