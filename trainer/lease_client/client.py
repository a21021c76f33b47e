"""The lease client's HTTP half: the sample-source interface, its HTTP client and a file source.

A ``SampleSource`` has three calls, mirroring the policy server's admin API (docs/CONTRACTS.md):

    lease(max_samples, wait_s, min_samples)  GET  /v1/samples/lease?max=N&min=M&wait_s=S -> {"lease_id", "samples", "prm_metrics"}
    ack(lease_id)                            POST /v1/samples/ack {"lease_id"}
    update_weights(model_path, version, lineage)
                                             POST /admin/weights/update {"model_path", "weight_version",
                                             "parent_version", "sample_count", "sample_id_min", "sample_id_max"}

A push the server refuses with 409 is read against its version ledger (``GET /admin/weights``): when the
pushed weights descend from a version that was rolled back, or the live version was restored by a rollback
(``parent_required``) and the push does not name it as parent, ``WeightsRolledBack`` names the restored live
version (the trainer reloads its checkpoint and pushes from there, naming it); otherwise (another version is
being loaded or on trial as canary) ``PublishDeferred``: the weights stay unpublished until the next checkpoint.

The trainer acks a lease only after the checkpoint that contains its samples is on disk, so a lease
that is never acked (crash) goes back to the server's pool and is trained exactly once.

``PolicyClient`` is the HTTP implementation: one sync ``httpx.Client`` (the trainer is a sync program),
explicit timeouts, admin bearer key, on engine.http_client's retry policy: transport errors, 408/429 and
5xx are retried with capped exponential backoff + jitter within a total deadline (a call ends within
``deadline_s`` plus one request timeout), then raise ``PolicyUnavailable``; a 4xx is never retried and
raises ``PolicyRejected`` with the server's message. ``FileSampleSource`` serves a JSONL file with the same
semantics (dev runs and the DDP test); its ack cursor is persisted so a restart never re-serves an acked sample.

:func:`collect_leases` assembles one training step from live traffic: it leases until it holds at least
``min_batch`` samples or its wait ends, then hands over what it holds (possibly nothing: no step). A partial
lease is HELD while more samples are awaited, never returned: the wait is capped at half the server's lease
timeout from the first lease, so every held lease is acked (after the step's checkpoint) before it expires.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import httpx

from engine.http_client import CallError, CallRejected, RetryPolicy, bearer_headers, build_sync_http, send_sync
from engine.records import WeightsPushed, WeightVersion

logger = logging.getLogger(__name__)


class TrainerError(Exception):
    """Base of the trainer's own failures."""


class PolicyUnavailable(TrainerError):
    """The policy server could not be reached (or kept answering 5xx) within the call's deadline."""


class PolicyRejected(TrainerError):
    """The policy server answered 4xx: the request was wrong (bad key, unknown lease); never retried."""

    def __init__(self, message: str, status_code: int):
        super().__init__(f"{message} (HTTP {status_code})")
        self.status_code = status_code


class PublishDeferred(TrainerError):
    """The server did not take this push now (another version is loading or on trial); train on, push later."""


class WeightsRolledBack(TrainerError):
    """The pushed weights descend from a rolled-back version: reload ``live`` (the restored version) first."""

    def __init__(self, message: str, live: WeightVersion):
        super().__init__(message)
        self.live = live


@dataclass(frozen=True)
class Lineage:
    """Where pushed weights come from: the version they were trained from and the samples trained since."""

    parent_version: str | None = None
    sample_count: int | None = None
    sample_id_min: str | None = None
    sample_id_max: str | None = None


class SourceExhausted(TrainerError):
    """A finite source (a samples file) has nothing left to lease."""


@dataclass
class Lease:
    lease_id: str
    samples: list[dict[str, Any]] = field(default_factory=list)
    # The policy server's PRM metrics window drained by this lease ({} when scoring is off).
    prm_metrics: dict[str, float] = field(default_factory=dict)
    lease_timeout_s: float | None = None  # the server's lease timeout (None: unknown, e.g. a file source)


class SampleSource(Protocol):
    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease: ...

    def ack(self, lease_id: str) -> None: ...

    def update_weights(self, model_path: str, weight_version: str, lineage: Lineage | None = None) -> WeightsPushed: ...


class PolicyClient:
    """HTTP ``SampleSource`` for the policy server's admin API."""

    def __init__(
        self,
        base_url: str,
        admin_api_key: str = "",
        *,
        timeout_s: float = 30.0,
        deadline_s: float = 120.0,
        weight_sync_timeout_s: float = 600.0,
        max_attempts: int = 100,
        transport: httpx.BaseTransport | None = None,
    ):
        self.timeout_s = timeout_s
        self.deadline_s = deadline_s
        self.revoked: set[str] = set()  # sample ids a session deletion revoked (their acks said so)
        self.weight_sync_timeout_s = weight_sync_timeout_s
        self.retry = RetryPolicy(
            max_attempts=max_attempts, initial_backoff_s=0.25, max_backoff_s=8.0, jitter_s=0.25, deadline_s=deadline_s
        )
        self._http = build_sync_http(
            self._timeout(timeout_s),
            base_url=base_url.rstrip("/"),
            headers=bearer_headers(admin_api_key),
            transport=transport,
        )

    def _timeout(self, read_s: float) -> httpx.Timeout:
        return httpx.Timeout(connect=5.0, read=read_s, write=self.timeout_s, pool=self.timeout_s)

    def close(self) -> None:
        self._http.close()

    def _call(self, method: str, path: str, *, read_s: float | None = None, **kw: Any) -> object:
        """One logical call with retries; returns the JSON body ({} when empty), for the caller to check."""
        try:
            resp = send_sync(
                self._http, method, path, policy=self.retry, timeout=self._timeout(read_s or self.timeout_s), **kw
            )
        except CallRejected as exc:
            raise PolicyRejected(f"{method} {path}: {exc.message}", exc.status_code or 400) from exc
        except CallError as exc:
            last = f"HTTP {exc.status_code}: {exc.message}" if exc.status_code is not None else exc.message
            raise PolicyUnavailable(
                f"{method} {path} failed after {exc.attempts} attempts within {self.deadline_s:.0f}s: {last}"
            ) from exc
        return resp.json() if resp.content else {}

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        params = {"max": max_samples, "min": min_samples, "wait_s": wait_s}
        body = self._call("GET", "/v1/samples/lease", params=params, read_s=self.timeout_s + wait_s)
        if not isinstance(body, dict) or not isinstance(body.get("samples", []), list):
            raise TrainerError(f"lease answer is not {{lease_id, samples}}: {str(body)[:200]}")
        prm = body.get("prm_metrics") or {}
        prm_metrics = (
            {str(k): float(v) for k, v in prm.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
            if isinstance(prm, dict)
            else {}
        )
        timeout = body.get("lease_timeout_s")
        return Lease(
            lease_id=str(body.get("lease_id") or ""),
            samples=[
                s for s in body.get("samples") or [] if not (isinstance(s, dict) and s.get("sample_id") in self.revoked)
            ],
            prm_metrics=prm_metrics,
            lease_timeout_s=float(timeout) if isinstance(timeout, (int, float)) and timeout > 0 else None,
        )

    def ack(self, lease_id: str) -> None:
        # A 4xx raises PolicyRejected; the loop tolerates it only when re-acking after a resume.
        body = self._call("POST", "/v1/samples/ack", json={"lease_id": lease_id})
        # Samples whose session a user deleted while they were leased: the server consumed none of them; they
        # are dropped here (``revoked``: never counted as trained, skipped should they ever be offered again).
        revoked = body.get("revoked") if isinstance(body, dict) else None
        if revoked:
            self.revoked.update(str(s) for s in revoked)
            logger.warning("lease %s: %d sample(s) revoked by a session deletion, dropped", lease_id, len(revoked))

    def update_weights(self, model_path: str, weight_version: str, lineage: Lineage | None = None) -> WeightsPushed:
        push: dict[str, Any] = {"model_path": model_path, "weight_version": weight_version}
        if lineage is not None:
            push.update({k: v for k, v in asdict(lineage).items() if v is not None})
        try:
            body = self._call("POST", "/admin/weights/update", json=push, read_s=self.weight_sync_timeout_s)
        except PolicyRejected as exc:
            if exc.status_code != 409:
                raise
            self._explain_refusal(exc, lineage)
            raise
        if not isinstance(body, dict):
            raise TrainerError(f"weights update answer is not an object: {str(body)[:200]}")
        if body.get("success") is False:
            raise TrainerError(f"weights update refused: {body}")
        try:
            return WeightsPushed.model_validate(body, strict=False)
        except ValueError as exc:
            raise TrainerError(f"weights update answer is not a push answer: {str(body)[:200]}") from exc

    def weight_ledger(self) -> list[WeightVersion]:
        """The server's version ledger (``GET /admin/weights``), newest first."""
        body = self._call("GET", "/admin/weights")
        if not isinstance(body, dict) or not isinstance(body.get("versions"), list):
            raise TrainerError(f"weights ledger answer is not {{versions}}: {str(body)[:200]}")
        return [WeightVersion.model_validate(v, strict=False) for v in body["versions"]]

    def _explain_refusal(self, exc: PolicyRejected, lineage: Lineage | None) -> None:
        """A 409 on a push: WeightsRolledBack when its parent was rolled back or the restored live version must be
        its parent, else PublishDeferred."""
        ledger = self.weight_ledger()
        live = next((v for v in ledger if v.state == "live"), None)
        parent = lineage.parent_version if lineage else None
        rolled = {v.version for v in ledger if v.state == "rolled_back"}
        if live is not None and (parent in rolled or (live.parent_required and parent != live.version)):
            raise WeightsRolledBack(f"{exc}: restart from the restored version {live.version}", live) from exc
        raise PublishDeferred(str(exc)) from exc


def collect_leases(source: SampleSource, batch_size: int, min_batch: int, wait_s: float) -> list[Lease]:
    """Leases (each non-empty) holding between ``min_batch`` and ``batch_size`` samples in all, or fewer when
    ``wait_s`` (capped at half the lease timeout once something is held) ended first; [] when nothing came.
    A finite source that runs dry ends the collection with what is held (SourceExhausted when nothing is)."""
    end = time.monotonic() + wait_s
    held: list[Lease] = []
    n = 0
    while True:
        try:
            got = source.lease(batch_size - n, max(0.0, end - time.monotonic()), min_samples=max(1, min_batch - n))
        except SourceExhausted:
            if held:
                return held
            raise
        if got.samples:
            if not held and got.lease_timeout_s:
                # Held leases must outlive the wait plus the step that follows it.
                end = min(end, time.monotonic() + got.lease_timeout_s / 2)
            held.append(got)
            n += len(got.samples)
        if n >= min_batch or time.monotonic() >= end:
            return held


class FileSampleSource:
    """Samples from a JSONL file, leased in order; the ack cursor persists in ``state_path``.

    Unacked leases are forgotten on restart (they return to the pool, as a server's expired lease would).
    No weight updates: ``update_weights`` only records the call.
    """

    def __init__(self, path: str | Path, state_path: str | Path):
        self.samples = [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]
        self.state_path = Path(state_path)
        self.acked = json.loads(self.state_path.read_text())["acked"] if self.state_path.exists() else 0
        self._next = self.acked
        self._leases: dict[str, int] = {}  # lease_id -> end index
        self.weight_updates: list[tuple[str, str]] = []

    def lease(self, max_samples: int, wait_s: float, min_samples: int = 1) -> Lease:
        # A file never grows: what is left is all there will be, so min_samples cannot be waited for.
        if self._next >= len(self.samples):
            raise SourceExhausted(f"all {len(self.samples)} samples of the file were leased")
        end = min(self._next + max_samples, len(self.samples))
        lease = Lease(lease_id=uuid.uuid4().hex, samples=self.samples[self._next : end])
        self._leases[lease.lease_id] = end
        self._next = end
        return lease

    def ack(self, lease_id: str) -> None:
        if lease_id not in self._leases:
            raise PolicyRejected(f"unknown lease {lease_id}", 404)
        self.acked = max(self.acked, self._leases.pop(lease_id))
        tmp = self.state_path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"acked": self.acked}))
        os.replace(tmp, self.state_path)

    def update_weights(self, model_path: str, weight_version: str, lineage: Lineage | None = None) -> WeightsPushed:
        self.weight_updates.append((model_path, weight_version))
        return WeightsPushed(success=True, weight_version=weight_version, paused_s=0.0, state="live")
