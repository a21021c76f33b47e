"""Other trainers' remote-reward requests mapped onto judge requests, and judge results shaped into
the answers their clients accept (pure functions; the routes are in routes.py).

OpenRLHF ``POST /get_reward`` (``{"query": [...], "prompts"?: [...], "labels"?: [...]}``):
- A query string that is a JSON object with ``response`` and ``next_state`` is taken as a full
  /v1/judge request (context included): the lossless form for Hindsight-aware callers.
- Otherwise context = ``prompts[i]`` and response = the rest of ``query[i]`` when the query starts with the
  prompt; a query in chat-template markup that does not (truncated or re-decoded) is split at its last
  assistant turn. Template markup (OpenRLHF decodes with special tokens) is read back into messages and
  the reply's end tokens and ``<think>`` block are separated (judge_server.chat_markup). Next state =
  ``labels[i]`` (a string is a user message; a message dict or a list of them is used as is); a missing or
  malformed label (a number, ``[1, 2]``, an empty string) is a 400, never coerced into text.
- Only the ``prm`` task runs. The answer holds numbers only, because OpenRLHF turns ``rewards``,
  ``scores`` and (since its 2025 versions) every ``extra_logs`` value into a tensor:
  ``{"rewards": [float], "scores": [float], "extra_logs": {name: [float]}}`` with one entry per query;
  ``extra_logs`` = ``judge_ok``/``judge_tie``/``judge_no_valid_votes``/``judge_failed``/``judge_abstained``/
  ``judge_quarantined`` (1.0 for the item's status, else 0.0) and ``judge_confidence`` (share of valid votes
  that agree; 0.0 when failed).
- A guard's verdict without a score (``abstained``, ``quarantined``: judge_server.guards) is answered like
  ``no_valid_votes``: the neutral 0.0, flagged by its one-hot status (never a silent 0; not a 503, since asking
  again cannot change a deterministic rule). A trainer that must not learn from a quarantined reply drops
  the items flagged ``judge_quarantined`` (slime: ``status`` ``quarantined``).
- A ``judge_failed`` item has no score. By default the whole request is answered 503 ``RewardUnavailable``
  so the client's retry path runs (OpenRLHF retries any non-2xx a few times, then raises: an explicit
  failure, never a made-up reward). With ``compat_failed_reward`` set (``--compat-failed-reward F``) a
  failed item is answered ``F`` instead, flagged by ``judge_failed: 1.0``: a documented numeric fallback
  for runs that prefer a neutral reward to a stopped rollout.
slime ``--rm-url`` (``{"prompt", "response", "label"}``): prompt is a string (one user message) or a
message list; label is the next state as above. Answer ``{"reward": float, "status", "confidence", "prm",
"prompt_versions"}``: slime must be run with ``--reward-key reward`` (without it slime takes the whole dict
as the reward). A ``judge_failed`` item is answered 503 (slime retries with backoff, then raises), or
``compat_failed_reward`` as above with ``status: "judge_failed"``.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from engine.records import (
    STATUS_ABSTAINED,
    STATUS_FAILED,
    STATUS_NO_VALID,
    STATUS_OK,
    STATUS_QUARANTINED,
    STATUS_TIE,
    JudgeVerdicts,
    PrmVerdict,
)
from engine.validation import describe_validation_errors
from judge_server.chat_markup import has_markup, prompt_messages, reply_fields, split_query, strip_markup
from judge_server.errors import InvalidRequest, RewardUnavailable
from judge_server.schemas import JudgeRequest, OpenRLHFRewards, SlimeReward

# extra_logs name per PRM status: one-hot floats, so a trainer's tensor conversion and mean() both work.
STATUS_LOG_NAMES = {
    STATUS_OK: "judge_ok",
    STATUS_TIE: "judge_tie",
    STATUS_NO_VALID: "judge_no_valid_votes",
    STATUS_FAILED: "judge_failed",
    STATUS_ABSTAINED: "judge_abstained",
    STATUS_QUARANTINED: "judge_quarantined",
}
# A guard's verdict without a score: these clients need a number per item, and asking again cannot change a
# deterministic rule (a 503 would only loop), so the item gets the neutral 0.0, flagged by its status.
GUARDED_NO_SCORE = (STATUS_ABSTAINED, STATUS_QUARANTINED)


def label_to_next_state(label: Any, where: str = "label") -> list[dict[str, Any]]:
    """The next state a label names: a non-empty string (one user message), a message object, or a non-empty
    list of them (strings are user messages). Anything else (a number, ``[1, 2]``, an empty string, a dict
    without ``role`` and ``content``) is a 400: a reward label that is not a next state (e.g. a math answer)
    cannot be judged, and must never be coerced into text."""
    if isinstance(label, list):
        if not label:
            raise InvalidRequest(f"{where}: the next state must not be an empty list")
        return [_message(m, f"{where}[{i}]") for i, m in enumerate(label)]
    if label is None:
        raise InvalidRequest(f"{where} (the next state: a user reply or tool output) is required")
    return [_message(label, where)]


def _message(value: Any, where: str) -> dict[str, Any]:
    if isinstance(value, str):
        if not value.strip():
            raise InvalidRequest(f"{where}: the next state must not be empty")
        return {"role": "user", "content": strip_markup(value) or value}
    if isinstance(value, dict):
        role, content = value.get("role"), value.get("content")
        if not isinstance(role, str) or not isinstance(content, str | list):
            raise InvalidRequest(f"{where}: a next-state message needs a string role and a string or list content")
        return value
    raise InvalidRequest(
        f"{where}: the next state must be text, a message object or a list of them, not {type(value).__name__}"
    )


def _build(body: dict[str, Any], where: str) -> JudgeRequest:
    try:
        return JudgeRequest.model_validate(body)
    except ValidationError as exc:
        raise InvalidRequest(
            f"{where}: {describe_validation_errors(exc.errors(), limit=None)}", status_code=422
        ) from exc


def openrlhf_items(query: list[str], prompts: list[str] | None, labels: list[Any] | None) -> list[JudgeRequest]:
    if prompts is not None and len(prompts) != len(query):
        raise InvalidRequest(f"prompts has {len(prompts)} entries but query has {len(query)}")
    if labels is not None and len(labels) != len(query):
        raise InvalidRequest(f"labels has {len(labels)} entries but query has {len(query)}")
    items = []
    for i, q in enumerate(query):
        obj = None
        if q.lstrip().startswith("{"):
            try:
                obj = json.loads(q)
            except ValueError:
                obj = None
        if isinstance(obj, dict) and "response" in obj and "next_state" in obj:
            items.append(_build({**obj, "tasks": ["prm"]}, f"query[{i}]"))
            continue
        context, response = _openrlhf_turn(q, None if prompts is None else prompts[i], i)
        if labels is None:
            raise InvalidRequest(f"query[{i}]: labels (the next states) are required")
        next_state = label_to_next_state(labels[i], f"labels[{i}]")
        body = {"context": context, "response": response, "next_state": next_state, "tasks": ["prm"]}
        items.append(_build(body, f"query[{i}]"))
    return items


def _openrlhf_turn(query: str, prompt: str | None, i: int) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """(context, response) of one OpenRLHF query: the prompt's messages and the rest of the query when the
    query starts with the prompt; else, for a query in chat-template markup (a prompt truncated or decoded
    differently), the template's turns, the last assistant turn being the reply."""
    if prompt is not None and query.startswith(prompt):
        return prompt_messages(prompt), reply_fields(query[len(prompt) :])
    split = split_query(query) if has_markup(query) else None
    if split is not None:
        return split
    if prompt is None:
        raise InvalidRequest(f"query[{i}] is not a judge request JSON object and no prompts were given")
    raise InvalidRequest(f"query[{i}] does not start with prompts[{i}] and has no chat-template turns to split")


def slime_item(prompt: Any, response: str, label: Any) -> JudgeRequest:
    if isinstance(prompt, str):
        context = prompt_messages(prompt)  # a rendered prompt is read back into its turns
    else:
        context = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    body = {
        "context": context,
        "response": reply_fields(response),
        "next_state": label_to_next_state(label),
        "tasks": ["prm"],
    }
    return _build(body, "slime request")


def _prm_of(result: JudgeVerdicts) -> PrmVerdict:
    if result.prm is None:  # the compat items always ask for the prm task
        raise RuntimeError("a compat judge result without its prm verdict")
    return result.prm


def _reward_of(prm: PrmVerdict, failed_reward: float | None) -> float:
    if prm.status in GUARDED_NO_SCORE:
        return 0.0
    if prm.status != STATUS_FAILED and prm.score is not None:
        return float(prm.score)
    if failed_reward is None:
        raise RewardUnavailable(f"judge failed: {prm.reason or 'no verdict'}; retry the request")
    return float(failed_reward)


def openrlhf_reply(results: list[JudgeVerdicts], failed_reward: float | None) -> OpenRLHFRewards:
    """The /get_reward answer for judge results (one per query): numbers only, see the module docstring.

    Raises RewardUnavailable (503) when an item failed and no ``failed_reward`` fallback is configured.
    """
    prms = [_prm_of(r) for r in results]
    rewards = [_reward_of(prm, failed_reward) for prm in prms]
    extra_logs = {
        name: [1.0 if prm.status == status else 0.0 for prm in prms] for status, name in STATUS_LOG_NAMES.items()
    }
    extra_logs["judge_confidence"] = [0.0 if prm.status == STATUS_FAILED else float(prm.confidence) for prm in prms]
    return OpenRLHFRewards(rewards=rewards, scores=list(rewards), extra_logs=extra_logs)


def slime_reply(result: JudgeVerdicts, failed_reward: float | None) -> SlimeReward:
    """The /slime/reward answer (read by slime with ``--reward-key reward``); RewardUnavailable as above. ``prm``
    travels as its JSON (the route answers without unset fields)."""
    prm = _prm_of(result)
    return SlimeReward(
        reward=_reward_of(prm, failed_reward),
        status=prm.status,
        confidence=0.0 if prm.status == STATUS_FAILED else float(prm.confidence),
        prm=prm,
        prompt_versions=result.prompt_versions,
    )
