"""Unit tests of the one yes/no reading (engine.validation.bool_word) and the places that use it.

Contract: ``1 true yes on`` are true and ``0 false no off`` false, in any case with spaces around; anything
else is no answer: a command-line flag value is an argparse error, a session header or body fallback
(``X-Session-Done`` / ``session_done``) a 400 naming the header. An empty header is a 400 like any other
unreadable value (an absent header means the default, false).
"""

from __future__ import annotations

import argparse

import pytest
from starlette.requests import Request

from engine.cli_settings import parse_bool
from engine.validation import bool_word
from policy_server.api.chat.routes import session_info
from policy_server.errors import InvalidRequest

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("text", "expected"),
    [("1", True), ("TRUE", True), (" yes ", True), ("On", True), ("0", False), ("false", False), ("No", False)],
)
def test_yes_no_words(text: str, expected: bool) -> None:
    assert bool_word(text) is expected
    assert parse_bool(text) is expected


@pytest.mark.parametrize("text", ["", " ", "maybe", "2", "truee"])
def test_anything_else_is_no_answer(text: str) -> None:
    assert bool_word(text) is None
    with pytest.raises(argparse.ArgumentTypeError):
        parse_bool(text)


def _request(headers: dict[str, str]) -> Request:
    raw = [(k.lower().encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/", "headers": raw, "query_string": b""})


@pytest.mark.parametrize(("value", "expected"), [("true", True), (" 1", True), ("off", False)])
def test_session_done_header(value: str, expected: bool) -> None:
    assert session_info(_request({"X-Session-Done": value}), {}, "main")[2] is expected


def test_absent_session_done_is_false() -> None:
    assert session_info(_request({}), {}, "main")[2] is False


@pytest.mark.parametrize("value", ["", "maybe"])
def test_empty_or_unknown_session_done_header_is_a_400(value: str) -> None:
    with pytest.raises(InvalidRequest) as info:
        session_info(_request({"X-Session-Done": value}), {}, "main")
    assert info.value.status_code == 400 and info.value.param == "X-Session-Done"


@pytest.mark.parametrize(("value", "expected"), [(True, True), ("yes", True), (0, False)])
def test_session_done_body_fallback(value: object, expected: bool) -> None:
    assert session_info(_request({}), {"session_done": value}, "main")[2] is expected


def test_empty_session_done_body_fallback_is_a_400() -> None:
    with pytest.raises(InvalidRequest):
        session_info(_request({}), {"session_done": ""}, "main")
