"""Reward-client requests in the shapes today's OpenRLHF (v0.11) and slime send, and their failure paths.

Contract (judge_server/compat.py, judge_server/chat_markup.py, docs/REWARD_CLIENTS.md):
- OpenRLHF v0.11 sends ONE query per request: the policy tokenizer's decode of prompt + generated ids WITH
  special tokens, its ``prompts`` already rendered by the chat template. The judge reads the turns back
  into messages (no ``<|im_start|>`` reaches the judged text), the reply without its end token and with
  any ``<think>`` block as reasoning; also when the prompt was truncated and the query no longer starts
  with it. slime's rendered prompt string is read the same way.
- A label that is not a next state (``[1, 2]``, a number, ``""``, a dict without role/content) is a 400 on
  both routes: never judged as text, never a reward of 0.0.
- OpenRLHF v0.11 turns a failed reward call into ``None`` after its retries (which later crashes the
  rollout); ``?failed_reward=F`` in the reward URL makes a failed item the number F (flagged
  ``judge_failed``) per deployment, with no judge restart; slime gets the same.

The clients below reproduce in our own words the request building and reply handling of OpenRLHF's
``SingleTurnAgentExecutor`` and slime's ``remote_rm`` (read from their public sources).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from engine.chat import load_tokenizer
from judge_server.chat_markup import parse_turns, prompt_messages, reply_fields, split_query
from judge_server.compat import label_to_next_state, openrlhf_items, slime_item
from judge_server.errors import InvalidRequest
from tests.testkit.procs import ManagedProcess
from tests.testkit.servers import start_failing_judge, start_judge

ISSUE_PROMPT = "<|im_start|>user\nWhat's 17*3?<|im_end|>\n<|im_start|>assistant\n"


# ------------------------------------------------------------------------ the clients, in our own words
def openrlhf_v011_reward(url: str, tokenizer: Any, prompt: str, action_ids: list[int], label: Any) -> Any:
    """One sample's reward as OpenRLHF v0.11 gets it: query = decode(prompt ids + action ids) with special
    tokens, one query per request, a few tries, then the reward stays None (logged, not raised)."""
    prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
    query = tokenizer.decode(prompt_ids + action_ids, skip_special_tokens=False)
    payload = {"query": [query], "prompts": [prompt], "labels": [label]}
    for _ in range(3):
        try:
            r = httpx.post(url, json=payload, timeout=60, trust_env=False)
            r.raise_for_status()
            return r.json().get("rewards")
        except httpx.HTTPError:
            time.sleep(0.05)
    return None


def slime_remote_rm(url: str, sample: dict[str, Any], reward_key: str = "reward", tries: int = 3) -> Any:
    """slime's remote rm: POST prompt/response/label, retry any failure with backoff, then raise."""
    for attempt in range(tries):
        try:
            r = httpx.post(url, json=sample, timeout=60, trust_env=False)
            r.raise_for_status()
            return r.json()[reward_key]
        except httpx.HTTPError:
            if attempt + 1 >= tries:
                raise
            time.sleep(0.05 * 2**attempt)
    raise AssertionError("unreachable")


# ------------------------------------------------------------------------ markup (pure)
@pytest.mark.unit
def test_issue_example_is_read_back_into_messages() -> None:
    assert prompt_messages(ISSUE_PROMPT) == [{"role": "user", "content": "What's 17*3?"}]
    context, response = split_query(ISSUE_PROMPT + "51<|im_end|>")
    assert context == [{"role": "user", "content": "What's 17*3?"}] and response == {"content": "51"}
    assert reply_fields("<think>\n3*17\n</think>\n\n51<|im_end|>") == {"content": "51", "reasoning_content": "3*17"}
    assert prompt_messages("plain question</s>") == [{"role": "user", "content": "plain question"}]


@pytest.mark.unit
def test_llama3_and_gemma_turns() -> None:
    llama = (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nHi<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    assert prompt_messages(llama) == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    gemma = "<bos><start_of_turn>user\nHi<end_of_turn>\n<start_of_turn>model\nHello!<end_of_turn>"
    assert split_query(gemma) == ([{"role": "user", "content": "Hi"}], {"content": "Hello!"})
    assert parse_turns("no markup") is None


@pytest.mark.unit
def test_openrlhf_v011_query_from_the_real_tokenizer(tiny_model_dir: Path) -> None:
    tok = load_tokenizer(str(tiny_model_dir))
    messages = [{"role": "system", "content": "You do arithmetic."}, {"role": "user", "content": "What's 17*3?"}]
    prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    prompt_ids = tok(prompt, add_special_tokens=False)["input_ids"]
    action = tok("51<|im_end|>", add_special_tokens=False)["input_ids"]
    query = tok.decode(prompt_ids + action, skip_special_tokens=False)
    [item] = openrlhf_items([query], [prompt], ["thanks"])
    judged = item.model_dump(exclude_none=True)
    assert [(m["role"], m["content"]) for m in judged["context"]] == [(m["role"], m["content"]) for m in messages]
    assert judged["response"]["content"] == "51"
    assert "<|im_" not in str(judged)
    # a left-truncated prompt: the query no longer starts with the prompt string; its turns still split
    truncated = tok.decode(prompt_ids[3:] + action, skip_special_tokens=False)
    [item] = openrlhf_items([truncated], [prompt], ["thanks"])
    assert item.response.content == "51" and item.context[-1].content == "What's 17*3?"


@pytest.mark.unit
def test_slime_rendered_prompt_string() -> None:
    item = slime_item(ISSUE_PROMPT, "51<|im_end|>", "thanks, right")
    assert [(m.role, m.content) for m in item.context] == [("user", "What's 17*3?")]
    assert item.response.content == "51"


@pytest.mark.unit
@pytest.mark.parametrize("label", [[1, 2], 51, 0.5, "", "   ", [], {"x": 1}, None, True, [{"role": "user"}]])
def test_malformed_labels_are_refused(label: Any) -> None:
    with pytest.raises(InvalidRequest) as err:
        label_to_next_state(label)
    assert err.value.status_code == 400


@pytest.mark.unit
def test_wellformed_labels() -> None:
    assert label_to_next_state("thanks") == [{"role": "user", "content": "thanks"}]
    tool = {"role": "tool", "content": "ok"}
    assert label_to_next_state([tool, "and thanks"]) == [tool, {"role": "user", "content": "and thanks"}]


# ------------------------------------------------------------------------ end to end
@pytest.fixture(scope="module")
def judges(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[ManagedProcess, ManagedProcess]]:
    """A rules judge, and an llm judge whose engine is down (every item judge_failed)."""
    log_dir = tmp_path_factory.mktemp("judge-shapes")
    with (
        start_judge(log_dir, "judge-shapes-rules") as rules,
        start_failing_judge(log_dir, "judge-shapes-dead") as failing,
    ):
        yield rules, failing


@pytest.mark.e2e
def test_both_clients_get_rewards_for_templated_text(judges, tiny_model_dir: Path) -> None:
    rules, _ = judges
    tok = load_tokenizer(str(tiny_model_dir))
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "What's 17*3?"}], tokenize=False, add_generation_prompt=True
    )
    action = tok("51<|im_end|>", add_special_tokens=False)["input_ids"]
    assert openrlhf_v011_reward(rules.url + "/get_reward", tok, prompt, action, "thanks, correct") == [1.0]
    assert openrlhf_v011_reward(rules.url + "/get_reward", tok, prompt, action, "No, that is wrong.") == [-1.0]
    sample = {"prompt": ISSUE_PROMPT, "response": "51<|im_end|>", "label": "Thanks!"}
    assert slime_remote_rm(rules.url + "/slime/reward", sample) == 1.0


@pytest.mark.e2e
def test_malformed_label_is_a_400_on_both_routes(judges) -> None:
    rules, _ = judges
    r = httpx.post(rules.url + "/slime/reward", json={"prompt": "q", "response": "a", "label": [1, 2]})
    assert r.status_code == 400 and "label[0]" in r.json()["error"]["message"], r.text
    r = httpx.post(rules.url + "/get_reward", json={"query": ["q a"], "prompts": ["q"], "labels": [51]})
    assert r.status_code == 400 and "labels[0]" in r.json()["error"]["message"], r.text


@pytest.mark.e2e
def test_failed_reward_in_the_url_replaces_none_and_the_503(judges, tiny_model_dir: Path) -> None:
    _, failing = judges
    tok = load_tokenizer(str(tiny_model_dir))
    action = tok("51<|im_end|>", add_special_tokens=False)["input_ids"]
    # default: 503 on every try, and OpenRLHF v0.11 is left with None (what crashes its rollout later)
    assert openrlhf_v011_reward(failing.url + "/get_reward", tok, ISSUE_PROMPT, action, "thanks") is None
    url = failing.url + "/get_reward?failed_reward=0"
    assert openrlhf_v011_reward(url, tok, ISSUE_PROMPT, action, "thanks") == [0.0]
    body = {"query": [ISSUE_PROMPT + "51"], "prompts": [ISSUE_PROMPT], "labels": ["thanks"]}
    logs = httpx.post(url, json=body, timeout=60).json()["extra_logs"]
    assert logs["judge_failed"] == [1.0] and logs["judge_confidence"] == [0.0]
    sample = {"prompt": ISSUE_PROMPT, "response": "51", "label": "thanks"}
    with pytest.raises(httpx.HTTPStatusError):
        slime_remote_rm(failing.url + "/slime/reward", sample)
    r = httpx.post(failing.url + "/slime/reward?failed_reward=-0.5", json=sample, timeout=60)
    assert (r.json()["reward"], r.json()["status"]) == (-0.5, "judge_failed")
    assert httpx.post(failing.url + "/slime/reward?failed_reward=nan", json=sample, timeout=60).status_code in (
        400,
        422,
    )
