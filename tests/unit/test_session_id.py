"""engine.observability.valid_session_id: the one session-id rule (middleware and policy server alike).

Rule: surrounding whitespace trimmed, then 1-256 printable characters (Unicode letters allowed, control
characters not); ``header_text`` reads a latin-1-decoded ASGI header as UTF-8; only ASCII ids go upstream.
"""

from __future__ import annotations

import pytest

from engine.observability import bind_ids, header_text, request_id_headers, valid_session_id

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("s1", "s1"),
        ("sess 1", "sess 1"),
        ("  s2 ", "s2"),
        ("café", "café"),
        ("x" * 256, "x" * 256),
        ("x" * 257, None),
        ("", None),
        ("   ", None),
        (None, None),
        ("bad\x7f", None),
        ("a\nb", None),
        ("a\x00", None),
    ],
)
def test_valid_session_id(value: str | None, expected: str | None) -> None:
    assert valid_session_id(value) == expected


def test_header_text_decodes_utf8_and_refuses_other_bytes() -> None:
    assert header_text("café".encode().decode("latin-1")) == "café"
    assert header_text(b"\xff\xfe".decode("latin-1")) is None
    assert header_text(None) is None


def test_only_ascii_session_ids_are_forwarded_upstream() -> None:
    with bind_ids(request_id="r1", session_id="café"):
        assert request_id_headers() == {"X-Request-ID": "r1"}
    with bind_ids(request_id="r1", session_id="s-1"):
        assert request_id_headers() == {"X-Request-ID": "r1", "X-Session-Id": "s-1"}
