"""The dev engine's hostile-input guards (engine.http_guard, devkit/dev_server/app.py), on a real process.

Contract: a body over ``max_body_bytes`` is a 413 while it is read, before the key is checked (declared or
chunked); JSON nested beyond ``max_json_depth`` is a 400; a missing or wrong key is a 401 (compared in constant
time); none of these stops the engine from serving the next request.
"""

from __future__ import annotations

import json
import select
import socket
from collections.abc import Iterator
from pathlib import Path
from urllib.parse import urlparse

import httpx
import pytest

from tests.testkit.procs import ManagedProcess, start_dev_engine
from tests.testkit.servers import ENGINE_KEY as KEY

pytestmark = pytest.mark.e2e
LIMIT = 4096
GOOD = {"text": "hi", "sampling_params": {"max_new_tokens": 2}}


@pytest.fixture(scope="module")
def guarded(
    tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory, monkeypatch_module: pytest.MonkeyPatch
) -> Iterator[ManagedProcess]:
    monkeypatch_module.setenv("HINDSIGHT_DEV_ENGINE_MAX_BODY_BYTES", str(LIMIT))
    monkeypatch_module.setenv("HINDSIGHT_DEV_ENGINE_MAX_JSON_DEPTH", "8")
    mp = start_dev_engine(tiny_model_dir, log_dir=tmp_path_factory.mktemp("guarded-engine"), api_key=KEY)
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def monkeypatch_module() -> Iterator[pytest.MonkeyPatch]:
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _status_of_raw_post(url: str, head: str, body_chunks: Iterator[bytes]) -> int:
    """Send ``head`` then body chunks until the server answers; the HTTP status it answered."""
    u = urlparse(url)
    with socket.create_connection((u.hostname, u.port), timeout=30) as s:
        s.sendall(head.encode())
        for chunk in body_chunks:
            if select.select([s], [], [], 0)[0]:
                break  # answered before the whole body was sent
            try:
                s.sendall(chunk)
            except (BrokenPipeError, ConnectionResetError):
                break
        return int(s.recv(4096).decode("latin-1").split()[1])


def _post(engine: ManagedProcess, content: str | bytes, key: str | None = KEY) -> httpx.Response:
    headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
    return httpx.post(engine.url + "/generate", content=content, headers=headers, timeout=60, trust_env=False)


def test_oversized_bodies_are_413_before_auth(guarded):
    declared = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
        f"Content-Length: {200 * 1024 * 1024}\r\n\r\n"
    )
    assert _status_of_raw_post(guarded.url, declared, iter([b" " * 1024])) == 413  # no key, never read
    chunked = (
        f"POST /generate HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {KEY}\r\n"
        "Content-Type: application/json\r\nTransfer-Encoding: chunked\r\n\r\n"
    )
    chunk = f"{1024:x}\r\n".encode() + b" " * 1024 + b"\r\n"
    assert _status_of_raw_post(guarded.url, chunked, iter([chunk] * 64)) == 413
    assert _post(guarded, json.dumps(GOOD)).status_code == 200


def test_deep_json_is_400_and_keys_are_checked(guarded):
    nested: object = 1
    for _ in range(20):
        nested = [nested]
    r = _post(guarded, json.dumps({**GOOD, "x": nested}))
    assert r.status_code == 400, r.text
    assert _post(guarded, "[" * 2000).status_code == 400
    assert _post(guarded, json.dumps(GOOD), key=None).status_code == 401
    assert _post(guarded, json.dumps(GOOD), key=KEY[:-1] + "x").status_code == 401
    assert _post(guarded, json.dumps(GOOD)).status_code == 200  # and it serves on
