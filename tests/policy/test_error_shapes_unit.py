"""The error shape per route (policy_server.errors.ErrorShapeMiddleware): on ``/v1/messages`` and every path under
it, each error answer is Anthropic's envelope ``{"type": "error", "error": {"type", "message"}}`` with the status,
message and headers it had, whichever layer wrote it (an exception handler, a request guard, the top-level 500);
every other path keeps OpenAI's envelope, and a success is never touched. A tiny app with the policy server's own
handlers and guards, driven in-process through httpx.ASGITransport.
"""

from __future__ import annotations

import logging

import httpx
import pytest
from fastapi import FastAPI

from engine.http_guard import AdmissionMiddleware, BodyLimitMiddleware, UnexpectedErrorMiddleware
from policy_server.api.messages.shapes import error_body as anthropic_body
from policy_server.errors import (
    ErrorShapeMiddleware,
    ServiceUnavailable,
    UpstreamFailed,
    error_body,
    install_error_handlers,
)

pytestmark = pytest.mark.unit


def _app() -> FastAPI:
    app = FastAPI()

    def guard_body(status: int, message: str) -> dict[str, object]:
        return error_body(status, message, "invalid_request_error")

    app.add_middleware(BodyLimitMiddleware, max_body_bytes=64, error_body=guard_body, require_json=True)
    app.add_middleware(AdmissionMiddleware, max_in_flight=8, error_body=guard_body, retry_after_s=2)
    app.add_middleware(
        UnexpectedErrorMiddleware,
        logger=logging.getLogger("test"),
        error_body=lambda status, msg: error_body(status, msg, "internal_error"),
    )
    app.add_middleware(ErrorShapeMiddleware, shapes={"/v1/messages": anthropic_body})
    install_error_handlers(app)

    for path in ("/v1/messages", "/v1/messages/count_tokens", "/v1/chat/completions"):

        @app.post(path)
        async def answer(kind: str = "ok") -> dict[str, str]:
            if kind == "upstream":
                raise UpstreamFailed("policy engine: gone")
            if kind == "busy":
                raise ServiceUnavailable("weights are syncing")
            if kind == "bug":
                raise RuntimeError("a bug, never shown")
            return {"ok": "yes"}

    return app


async def _post(path: str, **kw: object) -> httpx.Response:
    transport = httpx.ASGITransport(app=_app())
    async with httpx.AsyncClient(transport=transport, base_url="http://test") as c:
        return await c.post(path, **kw)  # type: ignore[arg-type]


@pytest.mark.parametrize("path", ["/v1/messages", "/v1/messages/count_tokens"])
@pytest.mark.parametrize(
    "kw, status, kind, text",
    [
        ({"params": {"kind": "upstream"}, "json": {}}, 502, "api_error", "policy engine: gone"),
        ({"params": {"kind": "busy"}, "json": {}}, 503, "overloaded_error", "weights are syncing"),
        ({"params": {"kind": "bug"}, "json": {}}, 500, "api_error", "internal error (RuntimeError)"),
        ({"json": {"x": "y" * 100}}, 413, "request_too_large", "64"),
        ({"content": b"x", "headers": {"content-type": "text/plain"}}, 415, "invalid_request_error", "Content-Type"),
    ],
    ids=["upstream_502", "busy_503", "bug_500", "body_limit_413", "media_type_415"],
)
async def test_messages_paths_answer_errors_in_anthropics_shape(path, kw, status, kind, text):
    r = await _post(path, **kw)
    assert r.status_code == status
    body = r.json()
    assert body == {"type": "error", "error": {"type": kind, "message": body["error"]["message"]}}
    assert text in body["error"]["message"]
    assert int(r.headers["content-length"]) == len(r.content)
    if status == 503:
        assert r.headers["retry-after"] == "2"  # the headers the error had are kept


async def test_unknown_messages_path_is_an_anthropic_404_and_other_paths_stay_openai():
    unknown = await _post("/v1/messages/batches", json={})
    assert unknown.status_code == 404 and unknown.json()["error"]["type"] == "not_found_error"
    assert unknown.json()["type"] == "error"
    near = await _post("/v1/messagesx", json={})  # not under /v1/messages: OpenAI's shape
    assert near.status_code == 404 and set(near.json()) == {"error"}
    chat = await _post("/v1/chat/completions", params={"kind": "upstream"}, json={})
    assert chat.status_code == 502 and chat.json()["error"]["type"] == "upstream_error"
    ok = await _post("/v1/messages", json={})
    assert ok.status_code == 200 and ok.json() == {"ok": "yes"}
