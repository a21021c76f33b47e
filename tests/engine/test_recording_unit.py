"""devkit.dev_server.recording.RequestRecorder (ASGI, in-process): what the conformance test relies on.

Contract: one JSON line per POST/PUT, written once the body is read in full (chunked bodies joined), with
``body`` the parsed JSON, ``{"_unparsed": text}`` for non-JSON, null for an empty body; GET requests and
bodies the app never reads are not recorded; the app's responses pass through unchanged.
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

from devkit.dev_server.recording import RequestRecorder

pytestmark = pytest.mark.unit


async def echo(request: Request) -> JSONResponse:
    raw = await request.body()
    return JSONResponse({"n": len(raw)}, status_code=201)


async def refuse(request: Request) -> JSONResponse:  # answers without reading the body (like a 401)
    return JSONResponse({"error": "no"}, status_code=401)


def app(path: Path) -> RequestRecorder:
    inner = Starlette(
        routes=[Route("/generate", echo, methods=["POST", "PUT", "GET"]), Route("/refuse", refuse, methods=["POST"])]
    )
    return RequestRecorder(inner, path=path)


async def test_records_bodies_in_order_and_passes_responses_through(tmp_path: Path) -> None:
    log = tmp_path / "sub" / "requests.jsonl"
    transport = httpx.ASGITransport(app(log))
    async with httpx.AsyncClient(transport=transport, base_url="http://engine") as c:
        r = await c.post("/generate", json={"input_ids": [1, 2], "sampling_params": {"n": 3}})
        assert r.status_code == 201 and r.json() == {"n": len(r.request.content)}  # the app read it all

        async def chunks():
            for part in (b'{"rid": ', b'"a"}'):
                yield part

        await c.put("/generate", content=chunks())
        await c.post("/generate", content=b"not json")
        await c.post("/generate", content=b"")
        await c.get("/generate")
        assert (await c.post("/refuse", json={"secret": 1})).status_code == 401
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert lines == [
        {"method": "POST", "path": "/generate", "body": {"input_ids": [1, 2], "sampling_params": {"n": 3}}},
        {"method": "PUT", "path": "/generate", "body": {"rid": "a"}},
        {"method": "POST", "path": "/generate", "body": {"_unparsed": "not json"}},
        {"method": "POST", "path": "/generate", "body": None},
    ]
