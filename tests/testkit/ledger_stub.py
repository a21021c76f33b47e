"""The policy server's trainer-facing admin API without engines, over the real weight-version ledger, with
scripted promotions and rollbacks: for trainer tests that need the server's answer to a push at a chosen step.

    python -m tests.testkit.ledger_stub --port N --samples FILE --data-dir DIR --base-checkpoint DIR \
        --calls FILE [--safe-updates] [--promote-before VERSION[,VERSION...]] \
        [--roll-back-before VERSION:TO[,VERSION:TO...]]

- ``GET /v1/samples/lease?max=N``: the next N samples of the JSONL file (never re-served: every lease is acked
  in these tests), ``POST /v1/samples/ack``: recorded. No waiting: an exhausted file answers an empty lease.
- ``POST /admin/weights/update`` and ``GET /admin/weights``: what the policy server does
  (policy_server/serving/versions.py ``push``), minus loading weights: a push is recorded by the store's own
  ledger (policy_server.store ``StoreVersions``: ``add_version`` then ``finish_push`` live, or canary with
  ``--safe-updates``), so its refusals (409 ``weights_rolled_back`` / ``parent_required``, and
  ``canary_in_progress`` while a canary is on trial) are the server's rule, not a copy of it. The answer names
  the version's state, as the server's does. A push of a version already live or canary from the same checkpoint
  (a resumed trainer's re-sync) is answered 200.
- ``--promote-before VERSION,...``: when the push of VERSION arrives, the canary is first promoted to live, as the
  canary test would have just before it.
- ``--roll-back-before VERSION:TO,...``: when the push of VERSION arrives, the ledger first rolls back to TO (the
  live version: the canary is dropped), as the canary test or an operator would have just before it.

Every request's method, path, JSON body and answer status is appended to FILE as one JSON line. The bearer key
must be ``tests.testkit.servers.ADMIN_KEY``. :func:`start_ledger_stub` starts it as the test kit starts servers.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import uuid
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Query, Request
from fastapi.responses import JSONResponse

from engine.records import WeightVersion
from policy_server.store import Store, VersionConflict
from tests.testkit.procs import ManagedProcess, free_port, start_process
from tests.testkit.servers import ADMIN_KEY

BASE_VERSION = "base"  # the engines' weights when the ledger starts (policy server: ``--weight-version`` unset)


def create_app(
    samples_path: str,
    data_dir: str,
    base_checkpoint: str,
    calls_path: str,
    roll_back: str,
    *,
    safe_updates: bool = False,
    promote: str = "",
) -> FastAPI:
    samples = [json.loads(x) for x in Path(samples_path).read_text().splitlines() if x.strip()]
    store = Store(Path(data_dir))
    store.ensure_live(BASE_VERSION, base_checkpoint)
    promote_before = {v for v in promote.split(",") if v}
    # the pushed version -> the version restored just before it arrives
    roll_back_to = {v: to for v, _, to in (pair.partition(":") for pair in roll_back.split(",") if pair)}
    cursor = [0]
    app = FastAPI()

    def answer(request: Request, body: Any, status: int, content: Any) -> JSONResponse:
        line = {"method": request.method, "path": request.url.path, "body": body, "status": status}
        with open(calls_path, "a", encoding="utf-8") as f:
            f.write(json.dumps(line) + "\n")
        return JSONResponse(content, status_code=status)

    def pushed(version: str, state: str) -> dict[str, Any]:
        """The server's answer to a push it took (policy_server/api/weights.py ``WeightsPushed``)."""
        return {"success": True, "weight_version": version, "paused_s": 0.0, "state": state}

    def refused(request: Request, body: Any) -> JSONResponse | None:
        if request.headers.get("authorization") != f"Bearer {ADMIN_KEY}":
            return answer(request, body, 401, {"error": {"message": "bad admin key", "code": "unauthorized"}})
        return None

    @app.get("/health")
    async def health() -> dict[str, bool]:
        return {"ok": True}

    @app.get("/v1/samples/lease")
    async def lease(request: Request, max_samples: int = Query(1, alias="max")) -> JSONResponse:
        if (no := refused(request, None)) is not None:
            return no
        batch = samples[cursor[0] : cursor[0] + max_samples]
        cursor[0] += len(batch)
        body = {"lease_id": uuid.uuid4().hex, "samples": batch, "lease_timeout_s": 600.0}
        return answer(request, {"max": max_samples, "ids": [s["sample_id"] for s in batch]}, 200, body)

    @app.post("/v1/samples/ack")
    async def ack(request: Request) -> JSONResponse:
        body = await request.json()
        if (no := refused(request, body)) is not None:
            return no
        return answer(request, body, 200, {})

    @app.get("/admin/weights")
    async def ledger(request: Request) -> JSONResponse:
        if (no := refused(request, None)) is not None:
            return no
        versions = store.list_versions()
        live = next((v.version for v in versions if v.state == "live"), None)
        canary = next((v.version for v in versions if v.state == "canary"), None)
        content = {"live": live, "canary": canary, "versions": [v.model_dump() for v in versions]}
        return answer(request, None, 200, content)

    @app.post("/admin/weights/update")
    async def update(request: Request) -> JSONResponse:
        push = await request.json()
        if (no := refused(request, push)) is not None:
            return no
        version = push["weight_version"]
        same = store.get_version(version)
        if same is not None and same.state in ("live", "canary") and same.checkpoint == push["model_path"]:
            return answer(request, push, 200, pushed(version, same.state))
        if version in promote_before:
            store.promote(f"scripted promotion before the push of {version}")
        if version in roll_back_to:
            store.roll_back(roll_back_to[version], note=f"scripted rollback before the push of {version}")
        now = time.time()
        row = WeightVersion(
            version=version,
            checkpoint=push["model_path"],
            parent=push.get("parent_version"),
            created_at=now,
            updated_at=now,
            sample_count=push.get("sample_count"),
            sample_id_min=push.get("sample_id_min"),
            sample_id_max=push.get("sample_id_max"),
        )
        try:
            store.add_version(row, stale_after_s=600.0)
        except VersionConflict as exc:
            return answer(request, push, 409, {"error": {"message": str(exc), "code": exc.code}})
        done = store.finish_push(version, "canary" if safe_updates else "live", "pushed (ledger stub)")
        return answer(request, push, 200, pushed(version, done.state))

    return app


def start_ledger_stub(
    log_dir: Path,
    samples: Path,
    base_checkpoint: Path,
    *,
    safe_updates: bool = False,
    promote_before: str = "",
    roll_back_before: str = "",
    name: str = "ledger-stub",
) -> ManagedProcess:
    """The stub on a 127.0.0.1 ephemeral port, ready, its ledger under ``log_dir``; ``extra["calls"]`` is the file
    of its JSON lines (:func:`calls_of` reads it)."""
    port = free_port()
    calls = log_dir / f"{name}-calls.jsonl"
    data_dir = log_dir / f"{name}-store"
    data_dir.mkdir(parents=True, exist_ok=True)
    cmd = [
        *(sys.executable, "-m", "tests.testkit.ledger_stub", "--port", str(port), "--samples", str(samples)),
        *("--data-dir", str(data_dir), "--base-checkpoint", str(base_checkpoint), "--calls", str(calls)),
        *("--promote-before", promote_before, "--roll-back-before", roll_back_before),
        *(["--safe-updates"] if safe_updates else []),
    ]
    mp = start_process(name, cmd, url=f"http://127.0.0.1:{port}", log_dir=log_dir)
    mp.extra["calls"] = calls
    return mp


def calls_of(stub: ManagedProcess) -> list[dict[str, Any]]:
    """Every request the stub answered so far, in order: {method, path, body, status}."""
    path: Path = stub.extra["calls"]
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


if __name__ == "__main__":
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--samples", required=True)
    parser.add_argument("--data-dir", required=True)
    parser.add_argument("--base-checkpoint", required=True)
    parser.add_argument("--calls", required=True)
    parser.add_argument("--safe-updates", action="store_true", help="a push becomes canary rather than live")
    parser.add_argument("--promote-before", default="", help="VERSION[,VERSION...]")
    parser.add_argument("--roll-back-before", default="", help="VERSION:TO[,VERSION:TO...]")
    args = parser.parse_args()
    app = create_app(
        args.samples,
        args.data_dir,
        args.base_checkpoint,
        args.calls,
        args.roll_back_before,
        safe_updates=args.safe_updates,
        promote=args.promote_before,
    )
    uvicorn.run(app, host="127.0.0.1", port=args.port, log_level="warning")
