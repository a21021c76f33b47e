"""A minimal OpenAI-compatible chat endpoint WITHOUT ``n`` and WITHOUT output constraints, for judge tests, and
:func:`start_openai_stub`, which starts it as a process the way the test kit starts every server.

``python -m tests.testkit.openai_stub --port N --calls FILE``: ``POST /v1/chat/completions`` answers ONE choice
whatever ``n`` asks; a body with ``regex``, ``structured_outputs`` or ``guided_regex`` is refused 400 the way
OpenAI refuses an unknown argument. The first answer to a judge prompt has no verdict; an answer to a re-ask
(the conversation's last message comes after an assistant message) carries ``\\boxed{1}`` and, for a hint
prompt, a hint. The bearer key must be ``stub-key``. Every request body is appended to FILE as a JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from tests.testkit.procs import ManagedProcess, free_port, start_process

HINT = "Check which folder the user means before renaming."


def create_app(calls_path: str) -> FastAPI:
    app = FastAPI()

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/models")
    async def models() -> dict[str, object]:
        return {"object": "list", "data": [{"id": "stub-judge", "object": "model"}]}

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        body = await request.json()
        with open(calls_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(body) + "\n")
        if request.headers.get("authorization") != "Bearer stub-key":
            return JSONResponse({"error": {"message": "Incorrect API key provided", "type": "auth"}}, status_code=401)
        for field in ("regex", "structured_outputs", "guided_regex"):
            if field in body:
                message = f"Unrecognized request argument supplied: {field}"
                return JSONResponse({"error": {"message": message, "type": "invalid_request_error"}}, 400)
        messages = body["messages"]
        reask = len(messages) > 2 and messages[-2]["role"] == "assistant"
        is_hint = "HINT_START" in messages[-3 if reask else -1]["content"]
        if not reask:
            text = "The step looks reasonable to me."
        elif is_hint:
            text = f"\\boxed{{1}} [HINT_START]{HINT}[HINT_END]"
        else:
            text = "The user confirmed it. \\boxed{1}"
        return JSONResponse(
            {
                "id": "chatcmpl-stub",
                "object": "chat.completion",
                "model": body.get("model"),
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": "stop"}],
                "usage": {
                    "prompt_tokens": 100,
                    "completion_tokens": 10,
                    "total_tokens": 110,
                    "prompt_tokens_details": {"cached_tokens": 40},
                },
            }
        )

    return app


def start_openai_stub(log_dir: Path, calls_path: Path, name: str = "openai-stub") -> ManagedProcess:
    """The stub on a 127.0.0.1 ephemeral port, ready; every request body it gets is a JSON line of ``calls_path``
    (also ``extra["calls"]``)."""
    port = free_port()
    cmd = [sys.executable, "-m", "tests.testkit.openai_stub", "--port", str(port), "--calls", str(calls_path)]
    mp = start_process(name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    mp.extra["calls"] = calls_path
    return mp


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--calls", required=True)
    args = parser.parse_args()
    uvicorn.run(create_app(args.calls), host="127.0.0.1", port=args.port, log_level="warning")
