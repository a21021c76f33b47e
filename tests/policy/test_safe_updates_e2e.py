"""Acceptance of safe live updates on the CPU dev stack: two dev engines, the rules judge, scripted users.

Contract (docs/SAFE_UPDATES.md): with --safe-updates a pushed version goes to one engine as canary and a share
of new sessions goes to it; the sequential test promotes a helpful version (real weights: the teacher, whose
replies contain the phrase the scripted user thanks for) and rolls back a harmful one (the base weights,
which never say it) by itself within a bounded number of judged sessions; kill -9 of the policy server
mid-canary resumes the same ledger and pins; no request fails meanwhile (a background flow of one-turn
sessions runs through every push, promotion, rollback and the restart), and no judged session mixes
versions; the rolled-back version's samples are flagged when leased.
"""

from __future__ import annotations

import shutil
import threading
import time

import httpx
import pytest

from policy_server.store import Store
from tests.testkit.procs import start_dev_engine
from tests.testkit.servers import ADMIN_KEY, admin, client, start_judge, start_policy
from tests.testkit.stack import ScriptedUser, judged_rl_args
from tests.waiting import wait_until
from trainer.report import data as report_data
from trainer.report import page

pytestmark = [pytest.mark.e2e, pytest.mark.slow]

MIN_SESSIONS = 5
CHECK_S = 0.3
# Measured bound (tests/unit/test_sequential.py): rewards of -1 against +1 are decided after about 13 sessions
# per arm; at share 0.5 that is about 26 judged sessions, so 60 leaves room for the hash's imbalance.
MAX_PHASE_SESSIONS = 60
BATCH = 6


def ledger(url: str) -> dict:
    with admin(url) as a:
        r = a.get("/admin/weights")
    assert r.status_code == 200, r.text
    return r.json()


class Background:
    """One-turn sessions, one after another, until stopped: every answer must be a 200."""

    def __init__(self) -> None:
        self.url = ""
        self.ok = 0
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        n = 0
        while not self._stop.is_set():
            n += 1
            body = {"messages": [{"role": "user", "content": f"background {n}"}], "max_tokens": 8}
            try:
                with client(self.url) as c:
                    r = c.post(
                        "/v1/chat/completions", json=body, headers={"X-Session-Id": f"bg-{n}", "X-Session-Done": "1"}
                    )
            except httpx.HTTPError as exc:
                self.errors.append(repr(exc))
                continue
            if r.status_code != 200:
                self.errors.append(f"{r.status_code} {r.text[:200]}")
            else:
                self.ok += 1

    def start(self, url: str) -> None:
        self.url = url
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=60)


def undecided_or_done(url: str) -> bool:
    lg = ledger(url)
    return lg["canary"] is None or lg["comparison"]["decision"] == "continue"


def run_until(url: str, prefix: str, done, store: Store, start: int = 0) -> int:
    """Judged sessions in batches (judged before the next batch, so the test decides between batches) until
    ``done(ledger)``; returns the number of sessions run."""
    user = ScriptedUser(url, lambda reply: "Thanks" in reply, max_tokens=8, workers=2)
    n = start
    try:
        while not done(ledger(url)):
            assert n - start < MAX_PHASE_SESSIONS, ledger(url)
            user.run(f"{prefix}-{n}", [f"help me with task {n + i}" for i in range(BATCH)], turns=1, seed=n)
            n += BATCH
            wait_until(lambda: store.stats().samples["pending_judge"] == 0, timeout_s=60)
            time.sleep(3 * CHECK_S)  # the canary test looks at the judged sessions
            # and a decision it took is carried out (the engines loaded) before the next batch starts
            wait_until(lambda: undecided_or_done(url), timeout_s=60)
    finally:
        user.close()
    return n - start


def test_helpful_promoted_harmful_rolled_back_kill9_resumes(tiny_model_dir, teacher_model_dir, tmp_path):
    base = tmp_path / "base"
    shutil.copytree(tiny_model_dir, base)
    engines = [
        start_dev_engine(shutil.copytree(base, tmp_path / f"e{i}"), log_dir=tmp_path, name=f"e{i}") for i in (0, 1)
    ]
    judge = start_judge(tmp_path, m=1)
    data = tmp_path / "data"
    extra = [
        "--engine-worker-urls",
        ",".join(e.url for e in engines),
        *judged_rl_args(judge.url),
        "--safe-updates",
        "--canary-share",
        "0.5",
        "--canary-min-sessions",
        str(MIN_SESSIONS),
        "--canary-check-interval-s",
        str(CHECK_S),
    ]
    pol = start_policy(base, engines[0].url, data, tmp_path, extra=extra)
    store = Store(data)
    bg = bg_before = Background()
    try:
        live0 = ledger(pol.url)["live"]
        bg.start(pol.url)
        with admin(pol.url) as a:
            body = {"model_path": str(teacher_model_dir), "weight_version": "helpful", "parent_version": live0}
            r = a.post("/admin/weights/update", json=body)
        assert r.status_code == 200 and r.json()["state"] == "canary", r.text
        helpful_n = run_until(pol.url, "h", lambda lg: lg["live"] == "helpful", store)
        promoted = next(v for v in ledger(pol.url)["versions"] if v["version"] == "helpful")
        assert promoted["note"].startswith("automatic promote"), promoted

        with admin(pol.url) as a:
            body = {"model_path": str(base), "weight_version": "harmful", "parent_version": "helpful"}
            r = a.post("/admin/weights/update", json=body)
        assert r.status_code == 200 and r.json()["state"] == "canary", r.text
        user = ScriptedUser(pol.url, lambda reply: "Thanks" in reply, max_tokens=8, workers=2)
        user.run("k", [f"before the crash {i}" for i in range(4)], turns=1, seed=7)
        user.close()
        before = ledger(pol.url)
        assert before["canary"] == "harmful" and before["comparison"]["decision"] == "continue", before
        bg.stop()  # a killed server fails what it holds: the background flow pauses over the crash
        pol.kill()  # kill -9 mid-canary
        pol = start_policy(base, engines[0].url, data, tmp_path, name="policy-2", extra=extra)
        bg_before, bg = bg, Background()
        bg.start(pol.url)
        after = ledger(pol.url)
        assert [(v["version"], v["state"]) for v in after["versions"]] == [
            (v["version"], v["state"]) for v in before["versions"]
        ]
        harmful_n = run_until(pol.url, "x", lambda lg: lg["canary"] is None, store, start=4)
        states = {v["version"]: v["state"] for v in ledger(pol.url)["versions"]}
        assert states == {"harmful": "rolled_back", "helpful": "live", live0: "retired"}, states
        rolled = next(v for v in ledger(pol.url)["versions"] if v["version"] == "harmful")
        assert rolled["note"].startswith("automatic rollback"), rolled
        for e in engines:  # both engines serve the restored version
            assert httpx.get(e.url + "/model_info", trust_env=False).json()["weight_version"] == "helpful"
        text = httpx.get(pol.url + "/metrics", trust_env=False).text  # the dashboard's series
        assert 'hindsight_policy_weight_version{state="live",version="helpful"} 1.0' in text
        assert 'hindsight_policy_canary_decisions_total{decision="rollback"} 1.0' in text  # since the restart
        assert 'hindsight_policy_canary_reward{arm="canary",bound="mean"} NaN' in text  # no canary now
        report = page.render(report_data.collect(tmp_path / "no-trainer", pol.url, ADMIN_KEY))
        for plot in ("version_timeline", "version_session_reward"):  # the run report draws both
            figure = report.split(f'data-plot="{plot}"')[1].split("</figure>")[0]
            assert "no data in this run" not in figure, plot
        with admin(pol.url) as a:  # the harmful version's samples are flagged when leased, no other one
            leased = a.get("/v1/samples/lease", params={"max": 4096}).json()["samples"]
        flagged = {s["weight_version"]: bool(s.get("rolled_back")) for s in leased}
        assert flagged.get("harmful") is True and flagged.get("helpful") is False, flagged
    finally:
        bg.stop()
        pol.stop()
        judge.stop()
        for e in engines:
            e.stop()
    for flow in (bg_before, bg):
        assert not flow.errors, flow.errors[:5]
        assert flow.ok > 0
    assert helpful_n <= MAX_PHASE_SESSIONS and harmful_n <= MAX_PHASE_SESSIONS

    # no judged session mixes versions; each one's version is its pin
    judged = {r.session_id for r in store.list_samples(limit=100_000) if not r.session_id.startswith("bg-")}
    assert len(judged) >= helpful_n + harmful_n
    for sid in judged:
        versions: set[str] = set()
        for row in store.list_samples(session_id=sid, limit=1000):
            turn = store.get_turn(sid, row.turn_index)
            assert turn is not None
            versions |= {v for v in [turn.weight_version, *(turn.weight_versions or [])] if v}
        assert versions == {store.session_pin(sid)}, (sid, versions)
