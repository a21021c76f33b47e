"""Mapping of other trainers' remote-reward requests onto judge requests (pure functions).

OpenRLHF ``POST /get_reward`` (``{"query": [...], "prompts"?: [...], "labels"?: [...]}``):
- A query string that is a JSON object with ``response`` and ``next_state`` is taken as a full
  /v1/judge request (context included): the lossless form for Hindsight-aware callers.
- Otherwise ``prompts[i]`` must be given and be a prefix of ``query[i]``: context = one user message
  ``prompts[i]``, response = the rest of the query string, next state = ``labels[i]`` (a string is a user
  message; a message dict or a list of them is used as is). Without a label there is no evidence: 400.
- Only the ``prm`` task runs. ``rewards[i]``/``scores[i]`` are the PRM score as a float, or ``null``
  when that item's status is ``judge_failed`` (OpenRLHF keeps reward None for a failed sample; a made-up
  0 would be a silent neutral reward). ``extra_logs`` carries per-item status and confidence.
slime ``--rm-url`` (``{"prompt", "response", "label"}``): prompt is a string (one user message) or a
message list; label is the next state as above. Answer ``{"reward", "status", "prm", ...}`` (use slime's
``--reward-key reward``); a ``judge_failed`` item is answered 503 so slime's client retries it.
"""

from __future__ import annotations

import json
from typing import Any

from pydantic import ValidationError

from judge_server.errors import InvalidRequest
from judge_server.schemas import JudgeRequest


def label_to_next_state(label: Any) -> list[dict[str, Any]]:
    if isinstance(label, str) and label.strip():
        return [{"role": "user", "content": label}]
    if isinstance(label, dict):
        return [label]
    if isinstance(label, list) and label:
        return [m if isinstance(m, dict) else {"role": "user", "content": str(m)} for m in label]
    raise InvalidRequest("label (the next state: a user reply or tool output) is required and must be non-empty")


def _build(body: dict[str, Any], where: str) -> JudgeRequest:
    try:
        return JudgeRequest.model_validate(body)
    except ValidationError as exc:
        msgs = "; ".join(f"{'.'.join(str(p) for p in e['loc'])}: {e['msg']}" for e in exc.errors())
        raise InvalidRequest(f"{where}: {msgs}", status_code=422) from exc


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
        if prompts is None:
            raise InvalidRequest(f"query[{i}] is not a judge request JSON object and no prompts were given")
        if not q.startswith(prompts[i]):
            raise InvalidRequest(f"query[{i}] does not start with prompts[{i}]")
        if labels is None:
            raise InvalidRequest(f"query[{i}]: labels (the next states) are required")
        body = {"context": [{"role": "user", "content": prompts[i]}],
                "response": {"content": q[len(prompts[i]):]},
                "next_state": label_to_next_state(labels[i]), "tasks": ["prm"]}
        items.append(_build(body, f"query[{i}]"))
    return items


def slime_item(prompt: Any, response: str, label: Any) -> JudgeRequest:
    if isinstance(prompt, str):
        context = [{"role": "user", "content": prompt}] if prompt else []
    else:
        context = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    body = {"context": context, "response": {"content": response},
            "next_state": label_to_next_state(label), "tasks": ["prm"]}
    return _build(body, "slime request")
