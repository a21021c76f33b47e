"""What the run report reads, and the pure summaries it plots.

Inputs (``collect``): the trainer's out dir (``metrics.jsonl``, later line wins for a step that was redone
after a crash; ``config.json``), and optionally the policy server's admin API (``GET /v1/samples/stats``
and the non-consuming ``GET /v1/samples?status=S&limit=N`` for every status the stats list, so reading
changes nothing for the trainer, ``GET /admin/feedback``: the newest explicit feedback with the sign of
the judge's verdict on its turn, and ``GET /admin/weights``: the weight-version ledger and canary test) and the judge's ``/metrics`` text (judge tokens and votes per turn).
Those reads use engine.http_client's retry policy (transport errors, 408/429 and 5xx retried within a total
deadline); a service that stays down raises ``engine.http_client.CallError``.
The summaries below are pure functions of those rows; each is what one plot draws.

Verdict classes of a sample (``verdict_class``): ``+1`` / ``0`` / ``-1`` for an ``ok`` PRM verdict by the
sign of its score; ``tie``, ``no_valid_votes``, ``judge_failed``, ``abstained``, ``quarantined`` (a judge
guard withheld the score or quarantined the reply) for those statuses; ``no verdict`` when
the row has no PRM verdict (e.g. rejected ``no_next_state``, or not judged yet).
"""

from __future__ import annotations

import json
import math
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from engine.http_client import RetryPolicy, bearer_headers, build_sync_http, send_sync
from engine.records import (
    STATUS_ABSTAINED,
    STATUS_FAILED,
    STATUS_NO_VALID,
    STATUS_OK,
    STATUS_QUARANTINED,
    STATUS_TIE,
    SampleState,
)
from engine.sequential import DEFAULT_ALPHA, DEFAULT_MIN_SESSIONS, ArmStats, interval, trial_rho

# The PRM score classes, then every verdict status that carries no score (engine.records), then a sample without one.
VERDICT_CLASSES = (
    "+1",
    "0",
    "-1",
    STATUS_TIE,
    STATUS_NO_VALID,
    STATUS_FAILED,
    STATUS_ABSTAINED,
    STATUS_QUARANTINED,
    "no verdict",
)
ROWS_PER_STATUS = 4096  # the policy server's default max_lease_size: the most one read may return
FEEDBACK_ROWS = 4096  # the most GET /admin/feedback returns
AGREEMENT_WINDOW = 200  # the policy server's default --feedback-agreement-window (its /metrics gauge)


@dataclass
class RunData:
    out_dir: Path
    steps: list[dict[str, Any]] = field(default_factory=list)
    config: dict[str, Any] = field(default_factory=dict)
    rows: list[dict[str, Any]] = field(default_factory=list)
    stats: dict[str, Any] | None = None
    judge_metrics: str | None = None
    feedback: list[dict[str, Any]] = field(default_factory=list)  # GET /admin/feedback rows, newest first
    versions: list[dict[str, Any]] = field(default_factory=list)  # GET /admin/weights: the ledger, newest first
    comparison: dict[str, Any] | None = None  # GET /admin/weights: the canary test now (None: no canary)
    notes: list[str] = field(default_factory=list)
    skipped_steps: int = 0  # batches that had no gradient (skipped_steps.jsonl): no optimizer step, no publish


def read_steps(out_dir: Path) -> list[dict[str, Any]]:
    """metrics.jsonl as one record per step, in step order; a redone step's later line wins."""
    path = out_dir / "metrics.jsonl"
    if not path.exists():
        return []
    by_step: dict[int, dict[str, Any]] = {}
    for line in path.read_text().splitlines():
        if line.strip():
            rec = json.loads(line)
            by_step[int(rec["step"])] = rec
    return [by_step[k] for k in sorted(by_step)]


def collect(
    out_dir: Path,
    policy_url: str | None = None,
    admin_api_key: str | None = None,
    judge_url: str | None = None,
    timeout_s: float = 30.0,
) -> RunData:
    data = RunData(out_dir=out_dir, steps=read_steps(out_dir))
    if (out_dir / "config.json").exists():
        data.config = json.loads((out_dir / "config.json").read_text())
    skipped = out_dir / "skipped_steps.jsonl"  # trainer.train.SKIPPED_STEPS_FILE
    if skipped.exists():
        data.skipped_steps = sum(1 for line in skipped.read_text().splitlines() if line.strip())
    if not data.steps:
        data.notes.append(f"no metrics.jsonl under {out_dir}: no trainer steps to plot")
    retry = RetryPolicy(max_attempts=4, initial_backoff_s=0.5, max_backoff_s=4.0, deadline_s=timeout_s * 2)
    if policy_url:
        with build_sync_http(httpx.Timeout(timeout_s), base_url=policy_url, headers=bearer_headers(admin_api_key)) as c:
            data.stats = send_sync(c, "GET", "/v1/samples/stats", policy=retry).json()
            for status, n in sorted((data.stats.get("samples") or {}).items()):
                if not n:
                    continue
                got = send_sync(
                    c, "GET", "/v1/samples", policy=retry, params={"status": status, "limit": ROWS_PER_STATUS}
                )
                data.rows += got.json()["samples"]
                if n > ROWS_PER_STATUS:
                    data.notes.append(f"{n} samples are {status}: the plots use the oldest {ROWS_PER_STATUS}")
            got = send_sync(c, "GET", "/admin/feedback", policy=retry, params={"limit": FEEDBACK_ROWS})
            data.feedback = got.json()["feedback"]
            ledger = send_sync(c, "GET", "/admin/weights", policy=retry).json()
            data.versions, data.comparison = ledger["versions"], ledger.get("comparison")
            if len(data.feedback) >= FEEDBACK_ROWS:
                data.notes.append(f"the judge/feedback agreement uses the newest {FEEDBACK_ROWS} feedback")
    else:
        data.notes.append("no --policy-url: sample, verdict and judge plots are empty")
    if judge_url:
        with build_sync_http(httpx.Timeout(timeout_s)) as c:
            data.judge_metrics = send_sync(c, "GET", judge_url.rstrip("/") + "/metrics", policy=retry).text
    return data


# --- pure summaries --------------------------------------------------------------------------------


def verdict_class(row: dict[str, Any]) -> str:
    prm = (row.get("sample") or {}).get("prm")
    if not prm:
        return "no verdict"
    status = prm.get("status")
    if status == STATUS_OK and isinstance(prm.get("score"), (int, float)):
        return "+1" if prm["score"] > 0 else "-1" if prm["score"] < 0 else "0"
    return status if status in VERDICT_CLASSES else "no verdict"


def version_key(version: str) -> tuple[int, float, str]:
    """Weight versions in training order: 'default' (the initial weights), then numeric steps, then the rest."""
    if version == "default":
        return (0, 0.0, version)
    try:
        return (1, float(version), version)
    except ValueError:
        return (2, 0.0, version)


def weight_version_of(row: dict[str, Any]) -> str:
    return str((row.get("sample") or {}).get("weight_version") or "unknown")


def verdict_mix_by_version(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    """(versions, {verdict class: count per version}); classes that never occur are left out."""
    counts = Counter((weight_version_of(r), verdict_class(r)) for r in rows)
    versions = sorted({v for v, _ in counts}, key=version_key)
    stacks = {c: [float(counts[(v, c)]) for v in versions] for c in VERDICT_CLASSES}
    return versions, {c: vs for c, vs in stacks.items() if any(vs)}


def reward_by_version(rows: list[dict[str, Any]]) -> dict[str, tuple[float, int]]:
    """{version: (mean reward, n)} over samples that carry a finite reward."""
    acc: dict[str, list[float]] = {}
    for r in rows:
        s = r.get("sample") or {}
        if s.get("has_reward") and isinstance(s.get("reward"), (int, float)) and math.isfinite(s["reward"]):
            acc.setdefault(weight_version_of(r), []).append(float(s["reward"]))
    return {v: (sum(xs) / len(xs), len(xs)) for v, xs in sorted(acc.items(), key=lambda kv: version_key(kv[0]))}


def mode_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Samples per reward mode (rl/opd/combine); rows without a Sample yet count as 'not judged'."""
    return dict(sorted(Counter((r.get("sample") or {}).get("mode") or "not judged" for r in rows).items()))


def status_counts(rows: list[dict[str, Any]]) -> dict[str, int]:
    """Samples per status, rejected ones split by reject reason (text before the first ':')."""

    def label(r: dict[str, Any]) -> str:
        if r.get("status") == SampleState.REJECTED:
            return "rejected: " + str(r.get("reject_reason") or "?").split(":")[0]
        return str(r.get("status"))

    return dict(sorted(Counter(label(r) for r in rows).items()))


def votes_per_turn(rows: list[dict[str, Any]]) -> tuple[list[str], dict[str, list[float]]]:
    """Histogram of votes drawn per judged turn: (vote counts as labels, {"prm"|"hint": turns})."""
    counts: Counter[tuple[str, int]] = Counter()
    for r in rows:
        s = r.get("sample") or {}
        for task in ("prm", "hint"):
            verdict = s.get(task)
            if verdict and verdict.get("votes") is not None:
                counts[(task, len(verdict["votes"]))] += 1
    sizes = sorted({n for _, n in counts})
    stacks = {t: [float(counts[(t, n)]) for n in sizes] for t in ("prm", "hint")}
    return [str(n) for n in sizes], {t: v for t, v in stacks.items() if any(v)}


def judge_tokens_per_turn(metrics_text: str | None) -> tuple[list[str], dict[str, list[float]]]:
    """Mean judge tokens per turn by task (categories) and kind (stacks), from the
    ``hindsight_judge_tokens_per_turn`` histogram's _sum / _count; empty when the judge does not export it.

    Cached prompt tokens are part of the prompt tokens, so the stacks are ``prefilled`` (prompt - cached),
    ``cached`` and ``completion``: they add up to the tokens the engine saw per turn."""
    if not metrics_text:
        return [], {}
    sums: dict[tuple[str, str], float] = {}
    cnts: dict[tuple[str, str], float] = {}
    for fam in text_string_to_metric_families(metrics_text):
        if fam.name != "hindsight_judge_tokens_per_turn":
            continue
        for s in fam.samples:
            key = (s.labels.get("task", "?"), s.labels.get("kind", "?"))
            if s.name.endswith("_sum"):
                sums[key] = s.value
            elif s.name.endswith("_count"):
                cnts[key] = s.value
    tasks = sorted({t for t, _ in cnts if cnts[(t, _)]})
    kinds = [k for k in ("prompt", "cached", "completion") if any((t, k) in cnts for t in tasks)]
    means = {k: [sums.get((t, k), 0.0) / cnts[(t, k)] if cnts.get((t, k)) else 0.0 for t in tasks] for k in kinds}
    if "prompt" in means and "cached" in means:
        means["prefilled"] = [max(0.0, p - c) for p, c in zip(means.pop("prompt"), means["cached"], strict=True)]
    order = ("prefilled", "prompt", "cached", "completion")
    return tasks, {k: means[k] for k in order if k in means}


def step_series(steps: list[dict[str, Any]], *keys: str) -> dict[str, list[tuple[float, float]]]:
    """{key: [(step, value), ...]} for the numeric values of each key."""
    return {
        k: [
            (float(s["step"]), float(s[k]))
            for s in steps
            if isinstance(s.get(k), (int, float)) and not isinstance(s.get(k), bool)
        ]
        for k in keys
    }


def agreement_series(feedback: list[dict[str, Any]], window: int = AGREEMENT_WINDOW) -> list[tuple[float, float]]:
    """The judge/feedback agreement after each paired feedback, as the policy server's gauge computes it: the
    latest ``window`` judged turns by their latest feedback, each pairing its verdict sign (``judge_sign``)
    with that feedback's sign; equal signs agree. Points are (minutes since the first feedback, share)."""
    ordered = sorted(feedback, key=lambda r: (r["created_at"], r["feedback_id"]))
    latest: dict[tuple[str, int], bool] = {}  # turn -> agrees, in order of its latest feedback
    points: list[tuple[float, float]] = []
    for r in ordered:
        turn = (r["session_id"], int(r["turn_index"]))
        latest.pop(turn, None)
        if r.get("judge_sign") is None:
            continue  # not judged yet or no PRM verdict: no pair
        value = float(r["value"])
        latest[turn] = int(r["judge_sign"]) == (value > 0) - (value < 0)
        recent = list(latest.values())[-window:]
        points.append(((r["created_at"] - ordered[0]["created_at"]) / 60.0, sum(recent) / len(recent)))
    return points


def version_timeline(versions: list[dict[str, Any]], now_s: float) -> dict[str, list[tuple[float, float]]]:
    """One horizontal segment per ledger version (y: its place in creation order), from when it was made to when
    its state last changed (to ``now_s`` while it is live or canary); x in minutes since the first version."""
    ordered = sorted(versions, key=lambda v: v["created_at"])
    if not ordered:
        return {}
    t0 = ordered[0]["created_at"]
    out: dict[str, list[tuple[float, float]]] = {}
    for i, v in enumerate(ordered):
        end = now_s if v["state"] in ("live", "canary") else v["updated_at"]
        out[f"{v['version']} ({v['state']})"] = [((v["created_at"] - t0) / 60, float(i)), ((end - t0) / 60, float(i))]
    return out


def session_reward_intervals(
    rows: list[dict[str, Any]], order: list[str], alpha: float = DEFAULT_ALPHA
) -> tuple[list[str], dict[str, list[tuple[float, float]]]]:
    """Per weight version (in ``order``, then any other): the mean per-session judge reward and the canary test's
    always-valid interval (engine.sequential, level ``1 - alpha / 2`` per arm as the test uses it). A session
    counts once, as the mean of its turns' ok/tie verdicts, and only when all its samples share one version."""
    by_session: dict[str, tuple[set[str], list[float]]] = {}
    for r in rows:
        s = r.get("sample") or {}
        versions, values = by_session.setdefault(str(r.get("session_id")), (set(), []))
        if s.get("weight_version"):
            versions.add(str(s["weight_version"]))
        prm = s.get("prm") or {}
        if prm.get("status") == STATUS_OK and isinstance(prm.get("score"), (int, float)):
            values.append(float(prm["score"]))
        elif prm.get("status") == STATUS_TIE:
            values.append(0.0)
    arms: dict[str, ArmStats] = {}
    for versions, values in by_session.values():
        if len(versions) == 1 and values:
            v = next(iter(versions))
            arms[v] = arms.get(v, ArmStats()).add(sum(values) / len(values))
    names = [v for v in order if v in arms] + sorted(set(arms) - set(order), key=version_key)
    rho = trial_rho(alpha, DEFAULT_MIN_SESSIONS)
    series: dict[str, list[tuple[float, float]]] = {"mean": [], "lo": [], "hi": []}
    for i, v in enumerate(names):
        iv = interval(arms[v], alpha / 2, rho)
        series["mean"].append((float(i), arms[v].mean))
        series["lo"].append((float(i), iv.lo))
        series["hi"].append((float(i), iv.hi))
    return names, series
