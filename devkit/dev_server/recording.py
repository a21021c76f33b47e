"""Request recording for the CPU dev engine: every POST/PUT body it receives, appended to a JSON-lines file.

What it is for: the SGLang conformance test (tests/conformance/) runs the judge and the policy server
against a recording dev engine, then validates each recorded body with SGLang's own request classes, so
whatever the services send the dev engine is also what a real SGLang accepts. The recorder knows no field
or endpoint: a new sampling parameter or control request is recorded as sent, nothing to update here.

Contract: enabled by ``--record-requests PATH`` (``HINDSIGHT_DEV_ENGINE_RECORD_REQUESTS``). One line per
request, written once its body has been read in full (before the route answers, so a request that is
later aborted or cancelled is recorded too): ``{"method", "path", "body"}`` with ``body`` the parsed JSON,
or ``{"_unparsed": text}`` when it is not JSON (the route answers that 400 itself), or null when empty.
Headers and query strings are not recorded (they may carry keys). Pure ASGI: bodies stream through
unbuffered and responses are untouched.
"""

from __future__ import annotations

import json
import threading
from pathlib import Path
from typing import Any

from starlette.types import ASGIApp, Message, Receive, Scope, Send

RECORDED_METHODS = frozenset({"POST", "PUT"})


class RequestRecorder:
    """ASGI middleware appending each POST/PUT body to ``path`` (see the module docstring)."""

    def __init__(self, app: ASGIApp, *, path: str | Path) -> None:
        self.app = app
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # Lines are small and written whole under a lock: concurrent requests never interleave a line.
        self._lock = threading.Lock()

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") not in RECORDED_METHODS:
            await self.app(scope, receive, send)
            return
        chunks: list[bytes] = []
        recorded = False

        async def recording_receive() -> Message:
            nonlocal recorded
            message = await receive()
            if message["type"] == "http.request" and not recorded:
                chunks.append(message.get("body", b""))
                if not message.get("more_body", False):
                    recorded = True
                    self._write(str(scope["method"]), str(scope.get("path", "")), b"".join(chunks))
            return message

        await self.app(scope, recording_receive, send)

    def _write(self, method: str, path: str, raw: bytes) -> None:
        body: Any = None
        if raw.strip():
            try:
                body = json.loads(raw)
            except ValueError:
                body = {"_unparsed": raw.decode("utf-8", errors="replace")}
        line = json.dumps({"method": method, "path": path, "body": body}, ensure_ascii=False) + "\n"
        with self._lock, self.path.open("a", encoding="utf-8") as f:
            f.write(line)
