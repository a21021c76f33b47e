"""engine.fastjson: json's semantics (NaN kept, key order kept, any value) with token-id lists at orjson's speed."""

from __future__ import annotations

import json
import math

import pytest

from engine import fastjson

pytestmark = pytest.mark.unit

IDS = list(range(1000, 1600))


@pytest.mark.parametrize(
    "obj",
    [
        {"prompt_ids": IDS, "response_ids": [1, 2], "rollout_logprobs": [-0.5, -1.25], "text": 'é \u0000 "q"'},
        {"a": 1, "input_ids": IDS, "sampling_params": {"temperature": 0.7}, "z": [True, None]},
        {"input_ids": IDS},  # only the fast list
        {"mixed": [*IDS, 1.5], "bools": [True] * 300, "big": [2**70] * 300},  # not int lists: json's path
        {"nan_list": [float("nan")] * 300, "ids": IDS, "inf": float("inf")},
        [IDS, {"x": IDS}],  # not a dict: json's path
        "plain",
    ],
)
def test_dumps_reads_back_as_json_dumps_does(obj):
    for ensure_ascii in (True, False):
        mine, theirs = fastjson.dumps(obj, ensure_ascii=ensure_ascii), json.dumps(obj, ensure_ascii=ensure_ascii)
        a, b = json.loads(mine), json.loads(theirs)
        assert json.dumps(a, sort_keys=False) == json.dumps(b, sort_keys=False)  # NaN compares by its text
        if isinstance(obj, dict):
            assert list(a) == list(obj)  # key order kept
    assert json.dumps(fastjson.loads(fastjson.dumps(obj))) == json.dumps(json.loads(json.dumps(obj)))
    body = fastjson.dumps_bytes(obj)  # an HTTP body: the same document, ASCII-safe bytes
    assert body.isascii() and body.decode() == fastjson.dumps(obj)


def test_nan_stays_nan_and_loads_falls_back_for_it():
    text = fastjson.dumps({"ids": IDS, "lp": [float("nan"), -1.0]})
    assert "NaN" in text and "null" not in text
    back = fastjson.loads(text)
    assert back["ids"] == IDS and math.isnan(back["lp"][0]) and back["lp"][1] == -1.0


def test_a_client_string_equal_to_no_placeholder_is_left_alone():
    obj = {"content": "\u0000" + "0" * 32, "prompt_ids": IDS}
    assert json.loads(fastjson.dumps(obj)) == obj


def test_loads_takes_bytes_and_big_ints():
    assert fastjson.loads(b'{"a": [1, 2]}') == {"a": [1, 2]}
    big = fastjson.loads(json.dumps({"big": 2**70, "ids": IDS}))
    assert big == {"big": 2**70, "ids": IDS} and type(big["big"]) is int  # orjson would give a float
