"""JSON for token-id payloads: the standard library's semantics at orjson's speed where it is safe.

Role: the one encoder/decoder for the JSON that carries whole prompts as token ids (the engine's
``/generate`` body, the stored turn record). A 30k-token prompt is a 30k-int list; ``json.dumps`` spends
about ten times longer on it than orjson, and it did so on every turn of a long session.

Contract: :func:`dumps` returns text that ``json.loads`` reads back to exactly what ``json.dumps(obj)``
would give. Only the large top-level lists of a dict whose orjson encoding holds nothing but integers
(digits, signs, commas, brackets) take orjson's encoding; everything else, non-finite floats included
(``NaN`` stays ``NaN``, never orjson's ``null``), goes through ``json.dumps``. :func:`loads` parses with
orjson and leaves to ``json.loads`` what orjson reads otherwise: ``NaN`` (orjson refuses it) and any run of
19 or more digits (orjson turns integers beyond 64 bits into floats), so both accept the same documents
and return the same values of the same types.
"""

from __future__ import annotations

import json
import uuid
from typing import Any

import orjson

# Below this length the splice costs more than it saves.
_MIN_FAST_LIST = 256
_INT_LIST_BYTES = b"0123456789-,[]"
# Digits to "0", everything else to " ": a run of 19 digits (an integer orjson may read as a float, or a
# long mantissa or string, which then only takes the slower path) is a plain substring search.
_DIGIT_MAP = bytes(0x30 if 0x30 <= b <= 0x39 else 0x20 for b in range(256))
_LONG_RUN = b"0" * 19


def _fast_list(value: Any) -> bytes | None:
    """orjson's encoding of a large list of integers, or None when json.dumps must encode it."""
    if type(value) is not list or len(value) < _MIN_FAST_LIST:
        return None
    try:
        encoded = orjson.dumps(value)
    except orjson.JSONEncodeError:  # integers beyond 64 bits, or values orjson cannot encode
        return None
    return encoded if not encoded.translate(None, _INT_LIST_BYTES) else None


def _spliced(obj: dict[str, Any], fast: dict[str, bytes], ensure_ascii: bool) -> bytes:
    # Each list is replaced by a placeholder string no client value can equal (a fresh uuid), then the
    # placeholder's JSON text by the list's: key order and every other value are json.dumps's own. The
    # splice is done on bytes, so the long lists are never decoded to text and encoded back.
    marks = {k: f"\x00{uuid.uuid4().hex}" for k in fast}
    out = json.dumps({k: marks.get(k, v) for k, v in obj.items()}, ensure_ascii=ensure_ascii).encode()
    for k, mark in marks.items():
        out = out.replace(json.dumps(mark).encode(), fast[k], 1)
    return out


def _fast_lists(obj: Any) -> dict[str, bytes]:
    if type(obj) is not dict:
        return {}
    return {k: enc for k, v in obj.items() if (enc := _fast_list(v)) is not None}


def dumps(obj: Any, *, ensure_ascii: bool = True) -> str:
    """``json.dumps(obj, ensure_ascii=...)`` with the large top-level int lists of a dict encoded by orjson."""
    fast = _fast_lists(obj)
    if not fast:
        return json.dumps(obj, ensure_ascii=ensure_ascii)
    return _spliced(obj, fast, ensure_ascii).decode()


def dumps_bytes(obj: Any) -> bytes:
    """:func:`dumps` as ASCII-safe UTF-8 bytes, for an HTTP body (built as bytes: no text round trip)."""
    fast = _fast_lists(obj)
    if not fast:
        return json.dumps(obj).encode()
    return _spliced(obj, fast, True)


def loads(text: str | bytes) -> Any:
    """``json.loads(text)``, by orjson where it reads the same values."""
    raw = text.encode() if isinstance(text, str) else text
    if _LONG_RUN not in raw.translate(_DIGIT_MAP):
        try:
            return orjson.loads(raw)
        except orjson.JSONDecodeError:
            pass
    return json.loads(raw)
