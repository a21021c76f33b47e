"""``POST /v1/chat/completions`` of the dev engine in SGLang 0.5.23's OpenAI shape.

Contract (SGLang's OpenAI-compatible chat route):

- Rendering uses the model's own chat template via ``engine.chat.render_prompt_ids`` (``tools`` and
  ``chat_template_kwargs`` reach the template); parsing of ``<think>`` reasoning and ``<tool_call>`` blocks
  uses ``engine.chat.parse_assistant_output`` (tools are parsed only when tools are given and
  ``tool_choice != "none"``). A stop finish with parsed calls becomes ``"tool_calls"``, ``matched_stop: null``.
- ``max_completion_tokens`` (what sglang-router rewrites ``max_tokens`` to) or ``max_tokens``; none means
  up to the context length. The extra fields the router adds are accepted and ignored.
- Forced ``tool_choice`` (``required`` or a named function) is constrained as the policy server does it
  (engine.tool_grammar: one Hermes call, typed by the function's schema; no stop sequences inside it); a
  client grammar (``regex``/``ebnf``/``response_format``) next to it is a 400.
- Rejected as SGLang rejects them: a role other than system/developer/user/assistant/tool/function,
  ``max_tokens``/``max_completion_tokens`` below 1, a forced ``tool_choice`` without tools (or naming a
  function not in them), ``top_logprobs`` without ``logprobs``.
- ``model`` must be the served name (or absent / the router's ``"unknown"`` placeholder); anything else -> 400.
- Streaming order: a role chunk per index, content/reasoning deltas, a finish chunk per index, the usage
  chunk (``choices: []``) when ``stream_options.include_usage``, then ``data: [DONE]``. When tools are
  given the content is buffered and sent with the parsed tool calls in the finish chunk (the dev engine
  does not parse tool calls incrementally).
- Errors: ``{"object": "error", "message", "type": "BadRequestError", "param": null, "code": 400}``.
"""

from __future__ import annotations

import time
import uuid
from typing import TYPE_CHECKING, Any

from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, ValidationError

from devkit.dev_server.protocol import NEG_INF_LOGPROB, ProtocolError, build_meta, triples
from devkit.dev_server.service import sse
from engine.chat import parse_assistant_output, prompt_opens_think, render_prompt_ids
from engine.template_inputs import TemplateRefused
from engine.tool_grammar import GRAMMAR_KEYS, GrammarRefused, forced_tool_grammar
from engine.validation import bounded_message, clip, most_specific_error

if TYPE_CHECKING:
    from devkit.dev_server.model_runner import RunResult, SequenceOutput
    from devkit.dev_server.service import DevEngine, Prepared

CHAT_ROLES = ("system", "developer", "user", "assistant", "tool", "function")  # SGLang's message types
ROUTER_MODEL_PLACEHOLDER = "unknown"  # sglang-router forwards a request without "model" with this name


class ChatError(Exception):
    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.message = message
        self.status_code = status_code

    def body(self) -> dict[str, Any]:
        return {
            "object": "error",
            "message": bounded_message(self.message),
            "type": "BadRequestError",
            "param": None,
            "code": self.status_code,
        }


class ChatRequest(BaseModel):
    """The fields the dev engine honours; unknown fields (router extras) are ignored as SGLang does."""

    model_config = ConfigDict(extra="ignore")

    messages: list[dict[str, Any]]
    model: str | None = None
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    n: int = 1
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    seed: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    stream: bool = False
    stream_options: dict[str, Any] | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    chat_template_kwargs: dict[str, Any] | None = None
    response_format: dict[str, Any] | None = None
    regex: str | None = None
    ebnf: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    min_tokens: int | None = None
    ignore_eos: bool = False
    no_stop_trim: bool = False
    skip_special_tokens: bool = True
    separate_reasoning: bool = True
    return_token_ids: bool = False
    return_meta_info: bool = False
    rid: str | None = None


def _sampling_params(req: ChatRequest) -> dict[str, Any]:
    params: dict[str, Any] = {
        "max_new_tokens": req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens,
        "temperature": req.temperature,
        "top_p": req.top_p,
        "top_k": req.top_k,
        "min_p": req.min_p,
        "n": req.n,
        "stop": req.stop,
        "stop_token_ids": req.stop_token_ids,
        "sampling_seed": req.seed,
        "presence_penalty": req.presence_penalty,
        "frequency_penalty": req.frequency_penalty,
        "repetition_penalty": req.repetition_penalty,
        "logit_bias": req.logit_bias,
        "min_new_tokens": req.min_tokens,
        "ignore_eos": req.ignore_eos,
        "no_stop_trim": req.no_stop_trim,
        "skip_special_tokens": req.skip_special_tokens,
        "regex": req.regex,
        "ebnf": req.ebnf,
    }
    fmt = req.response_format or {}
    if fmt.get("type") == "json_schema":
        import json

        schema = (fmt.get("json_schema") or {}).get("schema")
        if schema is None:
            raise ChatError("response_format.json_schema.schema is required")
        params["json_schema"] = json.dumps(schema)
    elif fmt.get("type") == "json_object":
        params["json_schema"] = '{"type": "object"}'
    return {k: v for k, v in params.items() if v is not None or k == "max_new_tokens"}


def _validate(engine: DevEngine, body: Any) -> ChatRequest:
    if not isinstance(body, dict):
        raise ChatError("the request body must be a JSON object")
    try:
        req = ChatRequest.model_validate(body)
    except ValidationError as exc:
        raise ChatError(most_specific_error(exc.errors())[0]) from None
    if not req.messages:
        raise ChatError("messages must not be empty")
    if req.model not in (None, engine.served_model_name, ROUTER_MODEL_PLACEHOLDER):
        raise ChatError(f"The model '{req.model}' does not exist; this engine serves '{engine.served_model_name}'")
    if req.stream_options is not None and not req.stream:
        raise ChatError("stream_options can only be set when stream is true")
    if req.stream and (req.return_token_ids or req.return_meta_info):
        raise ChatError("return_token_ids / return_meta_info are not supported with stream")
    if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
        raise ChatError("top_logprobs must be between 0 and 20")
    if req.n < 1:
        raise ChatError("n must be at least 1")
    for i, msg in enumerate(req.messages):
        if not isinstance(msg, dict) or msg.get("role") not in CHAT_ROLES:
            role = msg.get("role") if isinstance(msg, dict) else None
            raise ChatError(f"messages[{i}].role {clip(role)} must be one of {', '.join(CHAT_ROLES)}")
    for name in ("max_tokens", "max_completion_tokens"):
        value = getattr(req, name)
        if value is not None and value < 1:
            raise ChatError(f"{name} must be at least 1, got {value}")
    if req.top_logprobs and not req.logprobs:
        raise ChatError("top_logprobs requires logprobs to be true")
    if req.tool_choice not in (None, "auto", "none") and not req.tools:
        raise ChatError("Tools cannot be empty if tool choice is set to required or to a function.")
    return req


def _forced_call_params(req: ChatRequest, params: dict[str, Any]) -> bool:
    """Constrain a forced ``tool_choice`` to one typed call (in place); True when a call is forced."""
    try:
        grammar = forced_tool_grammar(req.tools, req.tool_choice)
    except GrammarRefused as exc:
        raise ChatError(exc.message) from None
    if grammar is None:
        return False
    if any(k in params for k in GRAMMAR_KEYS):
        raise ChatError("a forced tool_choice cannot be combined with regex, ebnf or response_format")
    params["ebnf"] = grammar
    params.pop("stop", None)  # the grammar ends with the call; a stop could only cut its markup
    return True


def _finish(sample: SequenceOutput, has_calls: bool) -> tuple[str | None, Any]:
    fr = sample.finish_reason or {}
    kind = fr.get("type")
    if kind == "stop" and has_calls:
        return "tool_calls", None
    if kind == "stop":
        return "stop", fr.get("matched")
    return kind, None


def _logprob_entries(engine: DevEngine, sample: SequenceOutput, lo: int, hi: int) -> list[dict[str, Any]]:
    out = []
    for i in range(lo, hi):
        text = engine.token_text(sample.output_ids[i])
        entry: dict[str, Any] = {
            "token": text,
            "bytes": list(text.encode()),
            "logprob": max(sample.output_logprobs[i], NEG_INF_LOGPROB),
            "top_logprobs": [],
        }
        if sample.output_top:
            entry["top_logprobs"] = [
                {
                    "token": engine.token_text(t),
                    "bytes": list(engine.token_text(t).encode()),
                    "logprob": max(lp, NEG_INF_LOGPROB),
                }
                for lp, t in sample.output_top[i]
            ]
        out.append(entry)
    return out


async def chat_completions(engine: DevEngine, body: Any) -> Any:
    req = _validate(engine, body)
    use_tools = bool(req.tools) and req.tool_choice != "none"
    try:
        prompt_ids = render_prompt_ids(
            engine.runner.tokenizer,
            req.messages,
            req.tools if use_tools else None,
            chat_template_kwargs=req.chat_template_kwargs,
        )
    except TemplateRefused as exc:  # the template's own complaint about these messages
        raise ChatError(exc.message) from exc
    params = _sampling_params(req)
    forced = _forced_call_params(req, params)
    try:
        prepared = engine.prepare(
            prompt_ids,
            params,
            rid=req.rid,
            return_logprob=req.logprobs,
            logprob_start_len=-1,
            top_logprobs_num=req.top_logprobs or 0,
        )
    except ProtocolError as exc:
        raise ChatError(exc.message, exc.status_code) from None
    chat_id = uuid.uuid4().hex
    created = int(time.time())
    model = req.model if req.model not in (None, ROUTER_MODEL_PLACEHOLDER) else engine.served_model_name

    # SGLang's force_reasoning, read from the prompt: a template that opens the block starts the reply in it.
    opened = prompt_opens_think(engine.runner.tokenizer, prompt_ids)

    def parse(text: str) -> Any:
        return parse_assistant_output(
            text,
            opened=opened,
            reasoning_parser=None
            if forced or not (req.separate_reasoning and engine.settings.reasoning_parser)
            else _default_reasoning(),
            tool_parser=_default_tools() if use_tools and engine.settings.tool_call_parser else None,
        )

    if req.stream:
        return StreamingResponse(
            sse(_stream(engine, req, prepared, parse, chat_id, created, model)), media_type="text/event-stream"
        )
    result = await engine.run(prepared)
    choices = []
    for k, sample in enumerate(result.samples):
        parsed = parse(engine.runner.final_text(sample, prepared.job.sampling))
        finish, matched = _finish(sample, bool(parsed.tool_calls))
        message: dict[str, Any] = {
            "role": "assistant",
            "content": parsed.content,
            "reasoning_content": parsed.reasoning_content,
        }
        if parsed.tool_calls:
            message["tool_calls"] = parsed.tool_calls
        choice: dict[str, Any] = {
            "index": k,
            "message": message,
            "finish_reason": finish,
            "matched_stop": matched,
            "logprobs": {"content": _logprob_entries(engine, sample, 0, len(sample.output_ids))}
            if req.logprobs
            else None,
        }
        if req.return_token_ids:
            choice["prompt_token_ids"] = list(prompt_ids)
            choice["response_token_ids"] = list(sample.output_ids)
        if req.return_meta_info:
            meta = build_meta(
                rid=prepared.sample_rids[k],
                finish_reason=sample.finish_reason,
                prompt_ids=prompt_ids,
                output_ids=sample.output_ids,
                weight_version=result.weight_version,
                started_at=result.started_at,
                cached_tokens=result.cached_tokens,
            )
            meta["output_token_logprobs"] = triples(sample.output_logprobs, sample.output_ids, None)
            choice["meta_info"] = meta
        choices.append(choice)
    completion = sum(len(s.output_ids) for s in result.samples)
    return {
        "id": chat_id,
        "object": "chat.completion",
        "created": created,
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": len(prompt_ids),
            "completion_tokens": completion,
            "total_tokens": len(prompt_ids) + completion,
            "prompt_tokens_details": None,
            "reasoning_tokens": 0,
            "completion_tokens_details": None,
        },
        "metadata": {"weight_version": result.weight_version},
    }


def _default_reasoning() -> Any:
    from engine.chat import DEFAULT_REASONING_PARSER

    return DEFAULT_REASONING_PARSER


def _default_tools() -> Any:
    from engine.chat import DEFAULT_TOOL_PARSER

    return DEFAULT_TOOL_PARSER


async def _stream(
    engine: DevEngine, req: ChatRequest, prepared: Prepared, parse: Any, chat_id: str, created: int, model: str
) -> Any:
    n = prepared.job.sampling.n
    buffer_content = bool(req.tools) and req.tool_choice != "none"
    sent_content = [""] * n
    sent_reasoning = [""] * n
    sent_tokens = [0] * n
    usage = {"completion": 0}

    def chunk(
        k: int, delta: dict[str, Any], finish: str | None = None, matched: Any = None, logprobs: Any = None
    ) -> dict[str, Any]:
        return {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [
                {"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": finish, "matched_stop": matched}
            ],
        }

    def make(p: Prepared, result: RunResult, k: int) -> list[dict[str, Any]]:
        sample = result.samples[k]
        final = sample.finish_reason is not None
        text = (
            engine.runner.final_text(sample, p.job.sampling)
            if final
            else engine.runner.partial_text(sample.output_ids, p.job.sampling.skip_special_tokens)
        )
        parsed = parse(text) if final or not buffer_content else None
        out: list[dict[str, Any]] = []
        delta: dict[str, Any] = {}
        if parsed is not None:
            reasoning = parsed.reasoning_content or ""
            if reasoning.startswith(sent_reasoning[k]) and len(reasoning) > len(sent_reasoning[k]):
                delta["reasoning_content"] = reasoning[len(sent_reasoning[k]) :]
                sent_reasoning[k] = reasoning
            if parsed.content.startswith(sent_content[k]) and len(parsed.content) > len(sent_content[k]):
                delta["content"] = parsed.content[len(sent_content[k]) :]
                sent_content[k] = parsed.content
            if final and parsed.tool_calls:
                delta["tool_calls"] = parsed.tool_calls
        hi = len(sample.output_ids)
        lps = {"content": _logprob_entries(engine, sample, sent_tokens[k], hi)} if req.logprobs else None
        if delta or (lps and hi > sent_tokens[k]):
            out.append(chunk(k, delta, logprobs=lps))
        sent_tokens[k] = hi
        if final:
            usage["completion"] += hi
            finish, matched = _finish(sample, bool(parsed and parsed.tool_calls))
            out.append(chunk(k, {}, finish, matched))
        return out

    for k in range(n):
        yield chunk(k, {"role": "assistant", "content": ""})
    async for item in engine.iter_chunks([prepared], make):
        yield item
    if (req.stream_options or {}).get("include_usage"):
        plen = len(prepared.job.prompt_ids)
        yield {
            "id": chat_id,
            "object": "chat.completion.chunk",
            "created": created,
            "model": model,
            "choices": [],
            "usage": {
                "prompt_tokens": plen,
                "completion_tokens": usage["completion"],
                "total_tokens": plen + usage["completion"],
            },
        }
