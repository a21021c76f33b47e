"""Unit tests of the dev engine's pure parts: /generate validation, sampling, auth rule, control state.

Contract under test: devkit/dev_server/protocol.py (SGLang 0.5.23 error shapes and ranges),
sampling.py (greedy normalisation, truncation), app.decide_auth (which key each endpoint needs), control.py (pause/abort).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from devkit.dev_server.app import decide_auth
from devkit.dev_server.control import EngineControl, RequestHandle
from devkit.dev_server.protocol import ProtocolError, check_prompt, parse_generate, resolve_sampling, triples
from devkit.dev_server.sampling import SamplingConfig, sample_tokens, scaled_logprobs

pytestmark = pytest.mark.unit


def test_single_and_batch_shapes():
    spec = parse_generate({"input_ids": [1, 2, 3], "sampling_params": {"max_new_tokens": 2}})
    assert not spec.is_batch and spec.prompts == [[1, 2, 3]]
    spec = parse_generate({"input_ids": [[1], [2, 3]], "rid": "r", "return_logprob": True})
    assert spec.is_batch and spec.rids == ["r_0", "r_1"] and spec.return_logprob == [True, True]
    spec = parse_generate({"text": ["a", "b"], "logprob_start_len": [0, 1], "return_logprob": [True, False]})
    assert spec.logprob_start_len == [0, 1] and spec.return_logprob == [True, False]


@pytest.mark.parametrize(
    ("body", "contract", "needle"),
    [
        ({"input_ids": [1], "sampling_params": {"max_tokens": 5}}, True, "unknown field `max_tokens`"),
        ({"input_ids": [1], "return_text_in_logprobs": 1}, True, "Expected `bool`"),
        ({"input_ids": [1], "stream": "yes"}, True, "Expected `bool`"),
        ({"input_ids": [1], "return_logprob": 1}, True, "Expected `bool`"),
        ({"input_ids": [1, "a"]}, True, "Expected `int`"),
        ({"input_ids": [1], "sampling_params": {"max_new_tokens": "5"}}, True, "Expected `int`"),
        ({"input_ids": [1], "sampling_params": {"temperature": True}}, True, "Expected `float`"),
        ({"input_ids": [1], "sampling_params": []}, False, "entries"),
        ({"sampling_params": {}}, False, "Either text, input_ids"),
        ([1, 2], True, "Expected `object`"),
        ({"input_ids": [[1], [2]], "sampling_params": [{"n": 1}, {"n": 2}]}, False, "same for all prompts"),
        ({"input_ids": [1], "sampling_params": {"n": 2}, "return_logprob": [True]}, False, "n > 1"),
        ({"input_ids": [[1], [2]], "rid": ["a", "a"]}, False, "Duplicate"),
    ],
)
def test_parse_generate_rejects(body, contract, needle):
    with pytest.raises(ProtocolError) as info:
        parse_generate(body)
    assert info.value.contract is contract
    assert needle in info.value.message
    shape = info.value.body()["error"]
    assert isinstance(shape, str) if contract else isinstance(shape["message"], str)


@pytest.mark.parametrize(
    ("params", "needle"),
    [
        ({"top_p": 0.0}, "top_p must be in (0, 1]"),
        ({"top_p": 1.5}, "top_p"),
        ({"temperature": -1}, "temperature"),
        ({"top_k": 0}, "top_k"),
        ({"max_new_tokens": -1}, "max_new_tokens"),
        ({"min_p": 2}, "min_p"),
        ({"regex": "a", "ebnf": "b"}, "Only one of"),
        ({"max_new_tokens": 4090}, "maximum context length"),
        ({"stop": [1]}, "stop must be"),
        ({"stop_regex": "x"}, "not supported"),
        ({"min_new_tokens": 50, "max_new_tokens": 10}, "min_new_tokens"),
    ],
)
def test_resolve_sampling_rejects(params, needle):
    with pytest.raises(ProtocolError) as info:
        resolve_sampling(params, prompt_len=10, context_length=4096)
    assert needle in info.value.message and not info.value.contract


def test_resolve_sampling_defaults_and_greedy():
    cfg = resolve_sampling({}, prompt_len=10, context_length=4096)
    assert cfg.max_new_tokens == 128 and cfg.temperature == 1.0 and not cfg.greedy
    cfg = resolve_sampling({"max_new_tokens": None}, prompt_len=10, context_length=64)
    assert cfg.max_new_tokens == 54  # null = up to the context limit
    assert resolve_sampling({}, prompt_len=60, context_length=64).max_new_tokens == 4  # default is clamped
    greedy = resolve_sampling({"temperature": 0.0}, prompt_len=1, context_length=64)
    assert greedy.greedy and greedy.temperature == 1.0  # SGLang: greedy is top_k=1 at temperature 1
    with pytest.raises(ProtocolError, match="longer than the model's context length"):
        resolve_sampling({"max_new_tokens": 0}, prompt_len=64, context_length=64)


def test_check_prompt():
    check_prompt([1, 2], vocab_size=10, logprob_start_len=2, top_logprobs_num=0)  # == len is allowed
    for ids, start, needle in [
        ([], -1, "cannot be empty"),
        ([1, 99], -1, "out of the vocabulary"),
        ([1, 2], 3, "logprob_start_len"),
        ([1], -2, "logprob_start_len"),
    ]:
        with pytest.raises(ProtocolError, match=needle):
            check_prompt(ids, vocab_size=10, logprob_start_len=start, top_logprobs_num=0)


def test_triples_sanitise_infinity():
    assert triples([None, float("-inf"), -1.5], [1, 2, 3], None) == [
        [None, 1, None],
        [-9999.0, 2, None],
        [-1.5, 3, None],
    ]


def test_sampling_truncation_and_seed():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    lps = scaled_logprobs(logits, 1.0)
    greedy = SamplingConfig(max_new_tokens=1, temperature=0.0)
    assert sample_tokens(lps, greedy, torch.Generator()).item() == 0
    top_p = SamplingConfig(max_new_tokens=1, top_p=0.6)  # keeps tokens 0 and 1 only
    top_k = SamplingConfig(max_new_tokens=1, top_k=1)
    seen_p = {sample_tokens(lps, top_p, torch.Generator().manual_seed(s)).item() for s in range(200)}
    seen_k = {sample_tokens(lps, top_k, torch.Generator().manual_seed(s)).item() for s in range(20)}
    assert seen_p == {0, 1} and seen_k == {0}
    full = SamplingConfig(max_new_tokens=1)
    a = [sample_tokens(lps, full, torch.Generator().manual_seed(7)).item() for _ in range(5)]
    assert len(set(a)) == 1  # same seed, same draw
    # temperature scales the reported distribution (SGLang reports temperature-adjusted log-probs)
    hot = scaled_logprobs(logits, 2.0)
    assert torch.allclose(hot, torch.log_softmax(logits / 2.0, -1)) and not torch.allclose(hot, lps)


@pytest.mark.parametrize(
    ("path", "header", "api", "admin", "ok"),
    [
        ("/generate", None, None, None, True),
        ("/generate", None, "k", None, False),
        ("/generate", "Bearer k", "k", None, True),
        ("/generate", "Bearer a", "k", "a", False),  # normal endpoints want the api key
        ("/health", None, "k", "a", True),
        ("/health_generate", None, "k", "a", True),
        ("/update_weights_from_disk", "Bearer k", "k", "a", False),  # api key not accepted for admin
        ("/update_weights_from_disk", "Bearer a", "k", "a", True),
        ("/pause_generation", "Bearer k", "k", None, True),
        ("/pause_generation", None, None, "a", False),
        ("/generate", None, None, "a", True),  # admin key only: normal endpoints stay open
    ],
)
def test_decide_auth(path, header, api, admin, ok):
    assert decide_auth(path, header, api, admin) is ok


def test_control_pause_abort_and_prefix_abort():
    control = EngineControl()
    running, waiting = RequestHandle("req-1"), RequestHandle("other")
    for h in (running, waiting):
        control.register(h)
    assert control.admit(running)
    assert control.abort("req", abort_all=False) == 1
    assert running.aborted and not waiting.aborted and not control.checkpoint(running)
    control.pause("abort")
    assert waiting.aborted and waiting.abort_message == "Abort before prefill"
    late = RequestHandle("late")
    control.register(late)
    admitted: list[bool] = []
    t = threading.Thread(target=lambda: admitted.append(control.admit(late)))
    t.start()
    time.sleep(0.1)  # a window in which admission must NOT happen: a negative check has no event to wait on
    assert not admitted  # new requests wait while paused
    control.resume()
    t.join(2)
    assert admitted == [True]


def test_control_in_place_hold_and_update_gate():
    control = EngineControl()
    h = RequestHandle("r")
    control.register(h)
    assert control.admit(h)
    with pytest.raises(TimeoutError):
        control.begin_update(abort_all=False, deadline_s=0.05)  # a running request blocks the update
    control.pause("in_place")
    passed: list[bool] = []
    t = threading.Thread(target=lambda: passed.append(control.checkpoint(h)))
    t.start()
    assert control.begin_update(abort_all=False, deadline_s=2) == 1  # held requests count as paused
    control.end_update()
    assert not passed
    control.resume()
    t.join(2)
    assert passed == [True] and not h.retracted
