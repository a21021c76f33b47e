"""The OpenAI chat fields beyond the basic sampling ones: what each does here, and unknown-field rejection.

Role: validate and apply ``logprobs``/``top_logprobs``, ``response_format``, ``logit_bias``,
``parallel_tool_calls``, ``reasoning_effort`` and the pass-through ``user``/``store``/``metadata``, and
reject every other field the server does not implement (HTTP 400 naming them) instead of dropping it.
Kept apart from ``policy_server.api.openai_schemas`` (the basic request model and message/tool validation).

Contract (CONTRACTS.md "OpenAI fields"):

- ``logprobs: true`` returns ``choices[0].logprobs.content``: one entry per sampled token (the stop
  token included, as the engine reports it) ``{token, bytes, logprob, top_logprobs}``, with the rollout
  log-probs the server records anyway; ``top_logprobs`` (0-20, needs ``logprobs``) adds the engine's
  top-k alternatives. Streaming chunks carry the entries of the tokens sampled since the previous chunk.
- ``response_format``: ``json_object``/``json_schema`` are constrained decoding (policy_server.serving.tool_choice);
  ``text`` is the default. Cannot be combined with a forced ``tool_choice`` (one grammar per request).
- ``logit_bias``: token-id -> bias in [-100, 100], forwarded to the engine as is when the policy server
  talks to its engine directly. sglang-router 0.3.2 drops ``logit_bias`` from ``/generate`` (its typed
  sampling struct lacks it), so behind a router (``engine_url`` not among ``engine_worker_urls``) the
  field is a 400 rather than silently ignored.
- ``stop`` with a forced ``tool_choice``: not sent to the engine; the forced reply is exactly one call and
  stops apply to text after it (policy_server.serving.tool_choice).
- ``parallel_tool_calls: false``: a forced call is always exactly one; with ``tool_choice: auto`` the
  engine stops at the first ``</tool_call>`` (kept in the text), so at most one call is returned.
- ``reasoning_effort``: one of ``none minimal low medium high xhigh``, mapped onto the variable the policy's chat
  template switches its reasoning with (engine.chat_families.reasoning_template_kwargs): Qwen3's
  ``enable_thinking`` and DeepSeek-V3.1's ``thinking`` are off for ``none``/``minimal`` and on otherwise;
  gpt-oss's ``reasoning_effort`` takes the level (``xhigh`` -> ``high``; ``none``/``minimal`` -> ``low``, the
  least it has); a template without such a variable renders the same whatever the field says. Without the
  field the template's own default applies.
- ``stream_options`` (``include_usage``, ``continuous_usage_stats``: every chunk then carries the usage so
  far) only together with ``stream: true``; otherwise a 400, as vLLM answers.
- ``prompt_cache_key`` is accepted (the engine's prefix cache needs no key) and read as a session hint
  (policy_server.serving.identity).
- ``user``, ``store``, ``metadata`` (a string map) are accepted and have no effect on generation; the
  response's ``metadata`` echoes the request's (Hindsight's own values are headers and the ``hindsight``
  field, see :func:`hindsight_extension`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, TypeAdapter, ValidationError, field_validator

from engine.chat_families import reasoning_template_kwargs
from engine.validation import clip, clip_name, most_specific_error
from policy_server.api.openai_schemas import ChatRequest, ChatRequestDoc
from policy_server.api.route_docs import inline_schema
from policy_server.errors import InvalidRequest
from policy_server.serving.tool_choice import (
    forced_tool_grammar,
    response_format_grammar,
)

REASONING_EFFORTS = ("none", "minimal", "low", "medium", "high", "xhigh")
PARALLEL_STOP = "</tool_call>"


class ChatExtras(BaseModel):
    """The fields of this module; validated next to (not inside) ``ChatRequest``."""

    model_config = ConfigDict(extra="ignore", strict=True)  # wrong JSON types are 400s, never coerced

    logprobs: bool | None = Field(None, strict=True)  # "yes" is a 400, not True
    top_logprobs: int | None = Field(None, ge=0, le=20)
    response_format: dict[str, Any] | None = None
    logit_bias: dict[str, float] | None = None
    parallel_tool_calls: bool | None = Field(None, strict=True)
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high", "xhigh"] | None = None
    user: str | None = None
    store: bool | None = Field(None, strict=True)
    metadata: dict[str, str] | None = None
    prompt_cache_key: str | None = None  # no cache effect here; a session hint (policy_server.serving.identity)

    @field_validator("logit_bias")
    @classmethod
    def _bias(cls, v: dict[str, float] | None) -> dict[str, float] | None:
        for key, bias in (v or {}).items():
            if not key.isdigit():
                raise ValueError(f"keys must be token ids, got {clip(key)}")
            if not -100.0 <= bias <= 100.0:
                raise ValueError(f"bias of token {key} must be in [-100, 100], got {bias}")
        return v

    @field_validator("metadata")
    @classmethod
    def _metadata(cls, v: dict[str, str] | None) -> dict[str, str] | None:
        if v is not None and len(v) > 16:
            raise ValueError("at most 16 keys")
        return v


def known_fields() -> frozenset[str]:
    return frozenset(ChatRequest.model_fields) | frozenset(ChatExtras.model_fields)


def parse_extras(body: dict[str, Any]) -> ChatExtras:
    """Reject unknown fields (400 naming them), then validate this module's fields."""
    unknown = sorted(set(body) - known_fields())
    if unknown:
        raise InvalidRequest(
            f"unsupported field(s): {', '.join(clip_name(u) for u in unknown[:5])}"
            f"{f' and {len(unknown) - 5} more' if len(unknown) > 5 else ''}; Hindsight rejects fields it does not "
            "implement instead of ignoring them",
            param=unknown[0],
        )
    try:
        extras = ChatExtras.model_validate(body)
    except ValidationError as exc:
        message, param = most_specific_error(exc.errors())
        raise InvalidRequest(message, param=param) from None
    if extras.top_logprobs and not extras.logprobs:
        raise InvalidRequest("top_logprobs needs logprobs: true", param="top_logprobs")
    return extras


STREAM_OPTIONS = ("include_usage", "continuous_usage_stats")


def check_stream_options(req: ChatRequest) -> None:
    """``stream_options`` only with ``stream: true`` (as vLLM answers), and only its known boolean keys."""
    if req.stream_options is None:
        return
    if not req.stream:
        raise InvalidRequest("stream_options is only allowed together with stream: true", param="stream_options")
    for key, value in req.stream_options.items():
        if key not in STREAM_OPTIONS:
            raise InvalidRequest(
                f"stream_options.{key} is not supported (only {', '.join(STREAM_OPTIONS)})",
                param=f"stream_options.{key}",
            )
        if not isinstance(value, bool):
            raise InvalidRequest(f"stream_options.{key} must be true or false", param=f"stream_options.{key}")


def apply_constraints(
    extras: ChatExtras,
    sp: dict[str, Any],
    tools: list[dict[str, Any]] | None,
    tool_choice: Any,
    tool_call_parser: str = "qwen25",
) -> bool:
    """Set the engine grammar for a forced tool call (in ``tool_call_parser``'s markup) or a JSON response
    format; True when a call is forced."""
    forced = forced_tool_grammar(tools, tool_choice, tool_call_parser)
    json_grammar = response_format_grammar(extras.response_format)
    if forced and json_grammar:
        raise InvalidRequest(
            "response_format json_object/json_schema cannot be combined with a forced tool_choice",
            param="response_format",
        )
    if forced:
        sp["ebnf"] = forced
        # The grammar ends with the call; a stop could only cut the call's own markup (tool_choice's docstring).
        sp.pop("stop", None)
    elif json_grammar:
        sp["ebnf"] = json_grammar
    return forced is not None


def apply_extras(
    extras: ChatExtras,
    sp: dict[str, Any],
    *,
    vocab_size: int,
    forced_tools: bool,
    tools: bool,
    behind_router: bool,
    keep_special_tokens: bool,
) -> None:
    """Add this module's engine sampling parameters to ``sp`` (in place); ``keep_special_tokens``: the family's
    markup in the reply may be special tokens (engine.chat_families.ChatFamily.keeps_special_tokens)."""
    if keep_special_tokens:
        sp["skip_special_tokens"] = False
    if extras.logit_bias:
        if behind_router:
            raise InvalidRequest(
                "logit_bias is not available behind sglang-router, which drops it on the way to "
                "the engine; point the policy server at the engine directly to use it",
                param="logit_bias",
            )
        bad = [k for k in extras.logit_bias if int(k) >= vocab_size]
        if bad:
            raise InvalidRequest(
                f"logit_bias token id {bad[0]} is outside the vocabulary ({vocab_size} tokens)", param="logit_bias"
            )
        sp["logit_bias"] = dict(extras.logit_bias)
    if extras.parallel_tool_calls is False and tools and not forced_tools:
        sp["stop"] = [*sp.get("stop", []), PARALLEL_STOP]
        sp["no_stop_trim"] = True  # the closing tag must stay in the text for the call to parse


def chat_template_kwargs(extras: ChatExtras, reasoning_switch: str | None) -> dict[str, Any] | None:
    """The chat template's arguments for the request: ``reasoning_effort`` through the template's own
    ``reasoning_switch`` (engine.chat_families)."""
    return reasoning_template_kwargs(reasoning_switch, extras.reasoning_effort)


def token_logprobs(
    tokenizer: Any, ids: list[int], logprobs: list[float], top: list[list[tuple[float, int]]] | None
) -> list[dict[str, Any]]:
    """OpenAI ``logprobs.content`` entries for sampled ids (``top``: per position (logprob, id) by rank)."""
    out = []
    for i, (tid, lp) in enumerate(zip(ids, logprobs, strict=True)):
        text = tokenizer.decode([tid])
        entry: dict[str, Any] = {"token": text, "bytes": list(text.encode()), "logprob": lp, "top_logprobs": []}
        if top is not None and i < len(top):
            for alt_lp, alt_id in top[i]:
                alt = tokenizer.decode([alt_id])
                entry["top_logprobs"].append({"token": alt, "bytes": list(alt.encode()), "logprob": alt_lp})
        out.append(entry)
    return out


def hindsight_extension(weight_version: str | None, session_id: str | None) -> dict[str, Any]:
    """Hindsight's own response values, in a clearly named extension field (also sent as headers)."""
    return {"weight_version": weight_version, "session_id": session_id}


def hindsight_headers(
    weight_version: str | None, session_id: str | None, deletion_token: str | None = None
) -> dict[str, str]:
    """The ``X-Hindsight-*`` answer headers: weight version, session id and the session's deletion token
    (policy_server.serving.deletion_tokens)."""
    headers = {}
    if deletion_token is not None:
        headers["X-Hindsight-Deletion-Token"] = deletion_token
    if weight_version is not None:
        headers["X-Hindsight-Weight-Version"] = str(weight_version)
    if session_id is not None and session_id.isascii():  # HTTP headers are latin-1; the body field has it all
        headers["X-Hindsight-Session-Id"] = session_id
    return headers


def chat_request_schema() -> dict[str, Any]:
    """The OpenAPI request-body schema of ``/v1/chat/completions`` (the route reads the body itself): every
    field the route accepts, the basic ones of ``openai_schemas.ChatRequestDoc`` and this module's extras; any
    other field is a 400, so the schema allows no additional properties."""
    schema = inline_schema(TypeAdapter(ChatRequestDoc))
    schema["properties"].update(inline_schema(TypeAdapter(ChatExtras))["properties"])
    schema["additionalProperties"] = False
    return schema
