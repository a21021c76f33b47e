"""engine.validation: the one wording of pydantic validation errors for clients.

Contract: ``loc: msg`` per error, dotted location without FastAPI's ``body`` prefix, ``Value error, `` dropped,
joined with ``; `` up to ``limit``; ``most_specific_error`` shows the deepest error and names it as param.
"""

from __future__ import annotations

from typing import Literal

import pytest
from pydantic import BaseModel, ValidationError, field_validator

from engine.validation import describe_validation_errors, most_specific_error

pytestmark = pytest.mark.unit


class Msg(BaseModel):
    role: Literal["user", "assistant"]
    content: str | list[str]

    @field_validator("content")
    @classmethod
    def _not_blank(cls, v: str | list[str]) -> str | list[str]:
        if v == "":
            raise ValueError("content must not be empty")
        return v


class Req(BaseModel):
    messages: list[Msg]
    n: int = 1


def errors_of(body: dict) -> list[dict]:
    with pytest.raises(ValidationError) as info:
        Req.model_validate(body)
    return info.value.errors()


def test_fastapi_body_prefix_and_value_error_prefix_are_dropped() -> None:
    errors = [
        {"loc": ("body", "messages", 0, "content"), "msg": "Value error, content must not be empty"},
        {"loc": ("body",), "msg": "Field required"},
    ]
    assert describe_validation_errors(errors) == "messages.0.content: content must not be empty; Field required"


def test_limit_and_empty() -> None:
    errors = [{"loc": ("a",), "msg": "x"}, {"loc": ("b",), "msg": "y"}, {"loc": ("c",), "msg": "z"}]
    assert describe_validation_errors(errors, limit=2) == "a: x; b: y"
    assert describe_validation_errors(errors, limit=None) == "a: x; b: y; c: z"
    assert describe_validation_errors([]) == "invalid request"
    assert most_specific_error([]) == ("invalid request", None)


def test_real_pydantic_errors() -> None:
    errors = errors_of({"messages": [{"role": "user", "content": ""}], "n": "many"})
    assert describe_validation_errors(errors) == (
        "messages.0.content: content must not be empty; n: Input should be a valid integer, unable to parse "
        "string as an integer"
    )


def test_most_specific_error_picks_the_deepest_union_branch() -> None:
    # content fails both union branches: str (wrong type) and list[str] (item 1 wrong): the list item is deeper.
    errors = errors_of({"messages": [{"role": "user", "content": ["ok", 3]}]})
    assert len(errors) == 2
    assert most_specific_error(errors) == (
        "messages.0.content.list[str].1: Input should be a valid string",
        "messages.0.content.list[str].1",
    )
    assert most_specific_error([{"loc": (), "msg": "bad root"}]) == ("bad root", None)
