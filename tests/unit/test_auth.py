"""engine.auth: the one bearer-key check of the policy server, the judge and the dev engine.

Contract: ``bearer_token`` reads ``Bearer <token>`` (scheme case-insensitive, whitespace trimmed), nothing
else; ``bearer_problem`` passes everything when no key is set, else says ``missing`` (no bearer token) or
``invalid`` (a wrong one); ``key_matches`` is an exact comparison (hmac.compare_digest underneath).
"""

from __future__ import annotations

import pytest

from engine.auth import bearer_problem, bearer_token, key_matches

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("header", "token"),
    [
        ("Bearer k1", "k1"),
        ("bearer k1", "k1"),
        ("BEARER  k1 ", "k1"),
        (" Bearer k1", "k1"),
        (None, None),
        ("", None),
        ("Bearer", None),
        ("Bearer   ", None),
        ("Basic k1", None),
        ("k1", None),
    ],
)
def test_bearer_token(header: str | None, token: str | None) -> None:
    assert bearer_token(header) == token


@pytest.mark.parametrize(
    ("header", "key", "problem"),
    [
        (None, None, None),
        ("Bearer anything", None, None),
        (None, "", None),  # no key configured: open
        (None, "k", "missing"),
        ("Basic k", "k", "missing"),
        ("Bearer ", "k", "missing"),
        ("Bearer k", "k", None),
        ("bearer k", "k", None),
        ("Bearer K", "k", "invalid"),
        ("Bearer kk", "k", "invalid"),
        ("Bearer k x", "k", "invalid"),
    ],
)
def test_bearer_problem(header: str | None, key: str | None, problem: str | None) -> None:
    assert bearer_problem(header, key) == problem


def test_key_matches_is_exact() -> None:
    assert key_matches("s3cret", "s3cret")
    assert not key_matches("s3cre", "s3cret") and not key_matches("s3cret ", "s3cret")
    assert not key_matches(None, "s3cret") and not key_matches("", "s3cret")
    assert key_matches("ключ", "ключ")  # non-ASCII keys compare as UTF-8 bytes
