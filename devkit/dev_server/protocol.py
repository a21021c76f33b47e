"""SGLang 0.5.23 ``/generate`` wire protocol: request validation and response shaping (pure functions).

Contract (SGLang 0.5.23 ``/generate``):

- Contract errors (unknown ``sampling_params`` key, wrong JSON type, non-bool flag) -> HTTP 400
  ``{"error": "<string>"}`` in msgspec's wording, as 0.5.23's ``GenerateRequest`` decoder answers.
- Semantic errors (empty ``input_ids``, ``logprob_start_len`` out of range, prompt over the context
  length, bad ``top_p`` ...) -> HTTP 400 ``{"error": {"message": ...}}`` (SGLang's abort-with-status shape).
- Single prompt -> one object; batch (``text`` list / ``input_ids`` list of lists) or ``n > 1`` -> a
  list in prompt-major order. A string ``rid`` on a batch becomes ``{rid}_{i}``; ``n > 1`` samples get
  fresh uuid ids (the caller's rid stays a prefix for ``/abort_request`` via the request handle).
- Logprob entries are ``[logprob, token_id, text|null]``; top-k rows are lists of those or null.
"""

from __future__ import annotations

import math
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from devkit.dev_server.sampling import SamplingConfig
from engine.validation import bounded_message

# Every key of SGLang 0.5.23's SamplingParams contract; anything else is rejected like msgspec does.
SAMPLING_PARAM_KEYS = (
    "max_new_tokens",
    "stop",
    "stop_token_ids",
    "stop_regex",
    "temperature",
    "top_p",
    "top_k",
    "min_p",
    "frequency_penalty",
    "presence_penalty",
    "repetition_penalty",
    "min_new_tokens",
    "n",
    "json_schema",
    "regex",
    "ebnf",
    "structural_tag",
    "ignore_eos",
    "skip_special_tokens",
    "spaces_between_special_tokens",
    "no_stop_trim",
    "custom_params",
    "stream_interval",
    "logit_bias",
    "sampling_seed",
)
# Keys the contract knows but the dev engine cannot honour: a clear 400 instead of silently ignoring them.
UNSUPPORTED_SAMPLING_KEYS = ("stop_regex", "structural_tag")
# Types per sampling key; float keys accept ints (msgspec does too).
_INT, _FLOAT, _BOOL, _STR = (int,), (int, float), (bool,), (str,)
_SAMPLING_TYPES: dict[str, tuple[type, ...]] = {
    "max_new_tokens": _INT,
    "temperature": _FLOAT,
    "top_p": _FLOAT,
    "top_k": _INT,
    "min_p": _FLOAT,
    "frequency_penalty": _FLOAT,
    "presence_penalty": _FLOAT,
    "repetition_penalty": _FLOAT,
    "min_new_tokens": _INT,
    "n": _INT,
    "regex": _STR,
    "json_schema": _STR,
    "ebnf": _STR,
    "ignore_eos": _BOOL,
    "skip_special_tokens": _BOOL,
    "spaces_between_special_tokens": _BOOL,
    "no_stop_trim": _BOOL,
    "sampling_seed": _INT,
    "stream_interval": _INT,
}
_TYPE_NAMES: dict[tuple[type, ...], str] = {_INT: "int", _FLOAT: "float", _BOOL: "bool", _STR: "str"}
NEG_INF_LOGPROB = -9999.0  # JSON has no -inf; a grammar-masked token reports this floor


class ProtocolError(Exception):
    """A request the engine refuses; ``contract`` errors use the plain-string shape."""

    def __init__(self, message: str, *, contract: bool = False, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.contract = contract
        self.status_code = status_code

    def body(self) -> dict[str, Any]:
        message = bounded_message(self.message)
        if self.contract:
            return {"error": message}
        return {"error": {"message": message, "type": "BadRequestError", "code": self.status_code}}


@dataclass
class GenerateSpec:
    """A validated ``/generate`` body, one entry per prompt in the per-item lists."""

    prompts: list[str | list[int]]
    is_batch: bool
    sampling_params: list[dict[str, Any]]
    rids: list[str | None]
    return_logprob: list[bool]
    logprob_start_len: list[int]
    top_logprobs_num: list[int]
    return_text_in_logprobs: bool
    stream: bool
    return_prompt_token_ids: bool


def _type_error(expected: str, value: Any, path: str) -> ProtocolError:
    got = (
        "null"
        if value is None
        else {bool: "bool", int: "int", float: "float", str: "str", list: "array", dict: "object"}.get(
            type(value), type(value).__name__
        )
    )
    return ProtocolError(f"Expected `{expected}`, got `{got}` - at `{path}`", contract=True)


def _check(value: Any, types: tuple[type, ...], path: str) -> None:
    ok = isinstance(value, types) and not (isinstance(value, bool) and bool not in types)
    if not ok:
        raise _type_error(_TYPE_NAMES.get(types, types[0].__name__), value, path)


def _per_item(body: dict[str, Any], key: str, default: Any, types: tuple[type, ...], batch: int, n: int) -> list[Any]:
    value = body.get(key, default)
    if value is None:
        value = default
    if isinstance(value, list):
        if n > 1:
            raise ProtocolError(f"list-valued {key} is not supported with n > 1")
        if len(value) != batch:
            raise ProtocolError(f"{key} has {len(value)} entries for {batch} prompts")
        for i, v in enumerate(value):
            _check(v, types, f"$.{key}[{i}]")
        return list(value)
    _check(value, types, f"$.{key}")
    return [value] * batch


def check_sampling_keys(params: Any, path: str) -> dict[str, Any]:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise _type_error("object", params, path)
    for key, value in params.items():
        if key not in SAMPLING_PARAM_KEYS:
            expected = ", ".join(f"`{k}`" for k in SAMPLING_PARAM_KEYS)
            raise ProtocolError(f"unknown field `{key}`, expected one of {expected} - at `{path}`", contract=True)
        if value is not None and key in _SAMPLING_TYPES:
            _check(value, _SAMPLING_TYPES[key], f"{path}.{key}")
    return params


def parse_generate(body: Any) -> GenerateSpec:
    """Validate the JSON body of ``POST /generate`` (types and shapes only)."""
    if not isinstance(body, dict):
        raise _type_error("object", body, "$")
    text, input_ids = body.get("text"), body.get("input_ids")
    if body.get("input_embeds") is not None:
        raise ProtocolError("input_embeds is not supported by the dev engine")
    if text is not None:
        if isinstance(text, str):
            prompts: list[Any] = [text]
            is_batch = False
        elif isinstance(text, list) and text and all(isinstance(t, str) for t in text):
            prompts, is_batch = list(text), True
        else:
            raise _type_error("str | array[str]", text, "$.text")
    elif input_ids is not None:
        if not isinstance(input_ids, list):
            raise _type_error("array", input_ids, "$.input_ids")
        if input_ids and all(isinstance(x, list) for x in input_ids):
            prompts, is_batch = [list(x) for x in input_ids], True
        else:
            prompts, is_batch = [list(input_ids)], False
        for i, ids in enumerate(prompts):
            for j, t in enumerate(ids):
                if not isinstance(t, int) or isinstance(t, bool):
                    raise _type_error("int", t, f"$.input_ids[{i}][{j}]" if is_batch else f"$.input_ids[{j}]")
    else:
        raise ProtocolError("Either text, input_ids or input_embeds should be provided.")
    batch = len(prompts)
    raw_sp = body.get("sampling_params")
    if isinstance(raw_sp, list):
        if len(raw_sp) != batch:
            raise ProtocolError(f"sampling_params has {len(raw_sp)} entries for {batch} prompts")
        sps = [check_sampling_keys(p, f"$.sampling_params[{i}]") for i, p in enumerate(raw_sp)]
    else:
        sps = [check_sampling_keys(raw_sp, "$.sampling_params")] * batch
    ns = {int(p.get("n") or 1) for p in sps}
    if len(ns) > 1:
        raise ProtocolError("The n parameter must be the same for all prompts in a batch.")
    n = ns.pop()
    for flag in ("return_text_in_logprobs", "stream", "return_prompt_token_ids"):
        if flag in body and body[flag] is not None:
            _check(body[flag], _BOOL, f"$.{flag}")
    if body.get("token_ids_logprob") is not None:
        raise ProtocolError("token_ids_logprob is not supported by the dev engine")
    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * batch
    elif isinstance(rid, str):
        rids = [rid] if not is_batch else [f"{rid}_{i}" for i in range(batch)]
    elif isinstance(rid, list) and all(isinstance(r, str) for r in rid):
        if len(rid) != batch:
            raise ProtocolError("The rid list must have the same length as the batch.")
        if len(set(rid)) != len(rid):
            raise ProtocolError("Duplicate rids in one batch are not allowed.")
        rids = list(rid)
    else:
        raise _type_error("str | array[str]", rid, "$.rid")
    return GenerateSpec(
        prompts=prompts,
        is_batch=is_batch,
        sampling_params=sps,
        rids=rids,
        return_logprob=_per_item(body, "return_logprob", False, _BOOL, batch, n),
        logprob_start_len=_per_item(body, "logprob_start_len", -1, _INT, batch, n),
        top_logprobs_num=_per_item(body, "top_logprobs_num", 0, _INT, batch, n),
        return_text_in_logprobs=bool(body.get("return_text_in_logprobs") or False),
        stream=bool(body.get("stream") or False),
        return_prompt_token_ids=bool(body.get("return_prompt_token_ids") or False),
    )


def resolve_sampling(params: dict[str, Any], prompt_len: int, context_length: int) -> SamplingConfig:
    """Range checks (SGLang's ``SamplingParams.verify``) and the context-length budget."""
    p = {k: v for k, v in params.items() if v is not None}
    for key in UNSUPPORTED_SAMPLING_KEYS:
        if key in p:
            raise ProtocolError(f"sampling_params.{key} is not supported by the dev engine")
    explicit = params.get("max_new_tokens")
    # An explicit budget over the context is an error; the default (128) and null are clamped, as in SGLang.
    max_new = (
        explicit
        if explicit is not None
        else min(128 if "max_new_tokens" not in params else context_length, max(context_length - prompt_len, 0))
    )
    if max_new < 0:
        raise ProtocolError(f"max_new_tokens must be at least 0, got {max_new}.")
    if prompt_len >= context_length:
        raise ProtocolError(
            f"The input ({prompt_len} tokens) is longer than the model's context length ({context_length} tokens)."
        )
    if explicit is not None and prompt_len + max_new > context_length:
        raise ProtocolError(
            f"Requested token count exceeds the model's maximum context length of {context_length} tokens. "
            f"You requested a total of {prompt_len + max_new} tokens: {prompt_len} tokens from the input "
            f"messages and {max_new} tokens for the completion. Please reduce the number of tokens in the "
            "input messages or the completion to fit within the limit."
        )
    temperature = float(p.get("temperature", 1.0))
    top_p = float(p.get("top_p", 1.0))
    top_k = int(p.get("top_k", -1))
    min_p = float(p.get("min_p", 0.0))
    n = int(p.get("n", 1))
    checks = [
        (temperature >= 0.0, f"temperature must be non-negative, got {temperature}."),
        (0.0 < top_p <= 1.0, f"top_p must be in (0, 1], got {top_p}."),
        (0.0 <= min_p <= 1.0, f"min_p must be in [0, 1], got {min_p}."),
        (top_k >= 1 or top_k == -1, f"top_k must be -1 (disable), or at least 1, got {top_k}."),
        (n >= 1, f"n must be at least 1, got {n}."),
        (-2.0 <= p.get("frequency_penalty", 0.0) <= 2.0, "frequency_penalty must be in [-2, 2]."),
        (-2.0 <= p.get("presence_penalty", 0.0) <= 2.0, "presence_penalty must be in [-2, 2]."),
        (0.0 < p.get("repetition_penalty", 1.0) <= 2.0, "repetition_penalty must be in (0, 2]."),
        (0 <= p.get("min_new_tokens", 0) <= max_new, f"min_new_tokens must be in [0, max_new_tokens({max_new})]."),
        (
            sum(k in p for k in ("regex", "json_schema", "ebnf")) <= 1,
            "Only one of regex, json_schema, or ebnf can be set.",
        ),
    ]
    for ok, message in checks:
        if not ok:
            raise ProtocolError(message)
    stop = p.get("stop") or []
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not all(isinstance(s, str) for s in stop) or len(stop) > 32:
        raise ProtocolError("stop must be a string or a list of at most 32 strings.")
    stop_ids = p.get("stop_token_ids") or []
    if not isinstance(stop_ids, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in stop_ids):
        raise ProtocolError("stop_token_ids must be a list of ints.")
    bias = p.get("logit_bias") or {}
    try:
        logit_bias = {int(k): float(v) for k, v in bias.items()}
    except (AttributeError, TypeError, ValueError):
        raise ProtocolError("logit_bias must map token ids to numbers.") from None
    grammar = next(((k, p[k]) for k in ("regex", "json_schema", "ebnf") if k in p), None)
    return SamplingConfig(
        max_new_tokens=int(max_new),
        temperature=temperature,
        top_p=top_p,
        top_k=top_k,
        min_p=min_p,
        n=n,
        min_new_tokens=int(p.get("min_new_tokens", 0)),
        frequency_penalty=float(p.get("frequency_penalty", 0.0)),
        presence_penalty=float(p.get("presence_penalty", 0.0)),
        repetition_penalty=float(p.get("repetition_penalty", 1.0)),
        stop=list(stop),
        stop_token_ids=list(stop_ids),
        ignore_eos=bool(p.get("ignore_eos", False)),
        skip_special_tokens=bool(p.get("skip_special_tokens", True)),
        spaces_between_special_tokens=bool(p.get("spaces_between_special_tokens", True)),
        no_stop_trim=bool(p.get("no_stop_trim", False)),
        sampling_seed=p.get("sampling_seed"),
        logit_bias=logit_bias,
        grammar=grammar,
    )


def check_prompt(ids: list[int], vocab_size: int, logprob_start_len: int, top_logprobs_num: int) -> None:
    if not ids:
        raise ProtocolError("The input_ids cannot be empty.")
    bad = next((t for t in ids if not 0 <= t < vocab_size), None)
    if bad is not None:
        raise ProtocolError(f"Token id {bad} is out of the vocabulary range [0, {vocab_size}).")
    if logprob_start_len < -1 or logprob_start_len > len(ids):
        raise ProtocolError(
            f"logprob_start_len ({logprob_start_len}) is out of range for an input of {len(ids)} tokens."
        )
    if top_logprobs_num < 0:
        raise ProtocolError(f"top_logprobs_num must be non-negative, got {top_logprobs_num}.")


def new_rid() -> str:
    return uuid.uuid4().hex


def _lp(value: float | None) -> float | None:
    if value is None:
        return None
    return NEG_INF_LOGPROB if math.isinf(value) or math.isnan(value) else value


def triples(values: Sequence[float | None], ids: list[int], texts: list[str] | None) -> list[list[Any]]:
    return [[_lp(v), t, texts[i] if texts else None] for i, (v, t) in enumerate(zip(values, ids, strict=True))]


def top_rows(rows: Sequence[list[tuple[float, int]] | None], token_text: Any) -> list[Any]:
    out: list[Any] = []
    for row in rows:
        if not row:
            out.append(None)
        else:
            out.append([[_lp(lp), tid, token_text(tid) if token_text else None] for lp, tid in row])
    return out


def build_meta(
    *,
    rid: str,
    finish_reason: dict[str, Any] | None,
    prompt_ids: list[int],
    output_ids: list[int],
    weight_version: str,
    started_at: float,
    aborted_before_prefill: bool = False,
    cached_tokens: int = 0,
) -> dict[str, Any]:
    meta: dict[str, Any] = {"id": rid, "finish_reason": finish_reason}
    if aborted_before_prefill:  # SGLang sends only these keys for a request aborted in the waiting queue
        meta.update(weight_version=weight_version, e2e_latency=time.monotonic() - started_at, completion_tokens=0)
        return meta
    meta.update(
        prompt_tokens=len(prompt_ids),
        weight_version=weight_version,
        completion_tokens=len(output_ids),
        cached_tokens=cached_tokens,
        reasoning_tokens=0,
        num_retractions=0,
        e2e_latency=time.monotonic() - started_at,
        response_sent_to_client_ts=time.time(),
    )
    return meta
