"""Two policy server replicas on one PostgreSQL store (real cluster), dev engine behind sglang-router, rules judge.

Contract (docs/SCALING.md, policy_server.store.postgres, policy_server.serving.replicas): any replica serves any request
of any session. Sessions whose requests alternate between the replicas pair exactly as on one replica (rules
judge: "thanks, that worked" +1, "No, that is wrong." -1; no history mismatch), stats and /metrics sample
gauges are the same at both; ``kill -9`` of a replica loses no answered turn and the other replica finishes its
claimed judge work once the claim expires; two trainers leasing at different replicas never get the same sample
(long-polls woken by LISTEN/NOTIFY whichever replica judged) and ack at the other replica; a reward mode switched
at A holds at B; a weight update called at A holds the chat requests arriving at B.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from policy_server.store import open_store
from tests.testkit.procs import free_port, metric_value
from tests.testkit.servers import admin, chat, client, start_judge, start_judged_policy, stats
from tests.waiting import wait_until

pytestmark = [pytest.mark.e2e, pytest.mark.slow]
CLAIM_S = 2.0


def _replica(
    tiny_model_dir: Path,
    router_url: str,
    pg_url: str,
    judge_url: str,
    tmp: Path,
    name: str,
    extra: list[str] | None = None,
):
    return start_judged_policy(
        *(tiny_model_dir, router_url, judge_url, tmp / f"data-{name}", tmp),
        name=f"policy-{name}",
        extra=[
            *("--store-url", pg_url, "--replica-id", name, "--dispatch-claim-s", str(CLAIM_S)),
            *("--dispatch-retry-initial-s", "0.2", "--idle-sweep-interval-s", "0.2"),
            *(extra or []),
        ],
    )


def _settled(url: str) -> bool:
    s = stats(url)
    return s["samples"]["pending_judge"] == 0 and s["turns_awaiting_next_state"] == 0


@pytest.fixture
def judge(tmp_path):
    mp = start_judge(tmp_path, "judge-rules", m=3)
    yield mp
    mp.stop()


@pytest.fixture
def pair(tiny_model_dir, router, pg_url, judge, tmp_path):
    a = _replica(tiny_model_dir, router.url, pg_url, judge.url, tmp_path, "A")
    b = _replica(tiny_model_dir, router.url, pg_url, judge.url, tmp_path, "B")
    yield a, b
    a.stop()
    b.stop()


def _session(urls: list[str], sid: str, feedback: list[str]) -> None:
    """One session whose k-th request goes to urls[k % len(urls)]; the last request ends the session."""
    msgs = [{"role": "user", "content": f"task {sid}"}]
    for k, text in enumerate([*feedback, None]):
        reply = chat(urls[k % len(urls)], sid, msgs, max_tokens=6, done=text is None)
        if text is not None:
            msgs += [{"role": "assistant", "content": reply["content"]}, {"role": "user", "content": text}]


def test_alternating_sessions_pair_as_on_one_replica(pair):
    a, b = pair
    feedback = ["thanks, that worked", "No, that is wrong."]
    for i in range(4):  # even sessions start at A, odd ones at B
        _session([a.url, b.url] if i % 2 == 0 else [b.url, a.url], f"alt{i}", feedback)
    wait_until(lambda: _settled(a.url), timeout_s=60)
    with admin(b.url) as c:
        for i in range(4):
            rows = {
                r["turn_index"]: r for r in c.get("/v1/samples", params={"session_id": f"alt{i}"}).json()["samples"]
            }
            assert [rows[k]["turn"]["pairing"] for k in (0, 1, 2)] == ["paired", "paired", "session_end"]
            assert rows[0]["sample"]["reward"] == 1.0 and rows[1]["sample"]["reward"] == -1.0
    sa, sb = stats(a.url), stats(b.url)
    assert sa["history_mismatches"] == 0 and sa["turns"] == 12 and sa["reject_reasons"].get("concurrent_turns") is None
    keys = ("samples", "reject_reasons", "turns", "sessions", "sessions_open", "history_mismatches", "active_leases")
    assert {k: sa[k] for k in keys} == {k: sb[k] for k in keys}  # from the database: the same at every replica
    for status, n in sa["samples"].items():  # /metrics sample gauges too, whichever replica recorded the turn
        assert metric_value(a.url, "hindsight_policy_samples", status=status) == n
        assert metric_value(b.url, "hindsight_policy_samples", status=status) == n
    # the reward mode switched at A is in force at B (runtime table + NOTIFY), without a restart
    with admin(a.url) as ca, admin(b.url) as cb:
        before = cb.get("/admin/mode").json()
        r = ca.post("/admin/mode", json={"mode": "rl", "w_rl": 0.5, "w_opd": 2.0})
        assert r.status_code == 200, r.text
        wait_until(lambda: cb.get("/admin/mode").json() == {"mode": "rl", "w_rl": 0.5, "w_opd": 2.0}, timeout_s=10)
        assert before != cb.get("/admin/mode").json()


class _Blackhole:
    """A judge that accepts connections and never answers: judge calls hang, so a claim stays held."""

    def __init__(self) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.sock.listen(64)
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.conns: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            self.conns.append(conn)

    def close(self) -> None:
        self.sock.close()
        for c in self.conns:
            c.close()


def test_kill9_loses_no_answered_turn_and_the_other_replica_finishes(tiny_model_dir, router, pg_url, judge, tmp_path):
    hole = _Blackhole()
    a = _replica(tiny_model_dir, router.url, pg_url, hole.url, tmp_path, "A")  # its judge calls hang
    b = _replica(tiny_model_dir, router.url, pg_url, judge.url, tmp_path, "B", ["--dispatch-concurrency", "2"])
    store = open_store(pg_url, "")
    answered: list[tuple[str, int, str]] = []
    stop = threading.Event()

    def traffic(i: int) -> None:
        with client(a.url) as ca, client(b.url) as cb:
            n = 0
            while not stop.is_set():
                sid, n = f"k{i}-{n}", n + 1
                msgs = [{"role": "user", "content": f"job {sid}"}]
                for k, c in enumerate((ca, cb) if n % 2 else (cb, ca)):
                    try:
                        r = c.post(
                            "/v1/chat/completions",
                            json={"messages": msgs, "max_tokens": 6},
                            headers={"X-Session-Id": sid, **({"X-Session-Done": "1"} if k else {})},
                        )
                    except Exception:  # the killed replica drops connections: not answered
                        break
                    if r.status_code != 200:
                        break
                    text = r.json()["choices"][0]["message"]["content"]
                    answered.append((sid, k, text))
                    msgs += [{"role": "assistant", "content": text}, {"role": "user", "content": "thanks, that worked"}]

    threads = [threading.Thread(target=traffic, args=(i,)) for i in range(3)]
    try:
        for t in threads:
            t.start()
        # A holds at least one session's judge work (claimed, its judge call hanging): then kill -9 it.
        wait_until(lambda: _claimed_by(store, "A") > 0, timeout_s=60)
        a.kill()
        answered_at_kill = len(answered)  # traffic goes on against B alone (A's connections now fail)
        wait_until(lambda: len(answered) >= answered_at_kill + 3, timeout_s=60)
        stop.set()
        for t in threads:
            t.join(timeout=60)
        assert answered
        # B takes A's work over once the claims expire, and judges everything.
        wait_until(lambda: stats(b.url)["samples"]["pending_judge"] == 0 and _claimed_by(store, "A") == 0, timeout_s=60)
        for sid, k, text in answered:
            turn = store.get_turn(sid, k)
            assert turn is not None and turn.response["content"] == text, (sid, k)
        s = stats(b.url)
        assert s["turns"] >= len(answered) and s["history_mismatches"] == 0
    finally:
        stop.set()
        store.close()
        a.stop()
        b.stop()
        hole.close()


def _claimed_by(store, owner: str) -> int:
    with store._read() as db:
        return db.execute(
            "SELECT COUNT(*) FROM sessions s WHERE claimed_by=? AND EXISTS (SELECT 1 FROM samples p "
            "WHERE p.session_id=s.session_id AND p.status='pending_judge')",
            (owner,),
        ).fetchone()[0]


def test_two_trainers_at_two_replicas_never_share_a_sample(pair):
    a, b = pair
    got: dict[str, list[str]] = {"A": [], "B": []}
    stop = threading.Event()

    bad_acks: list[str] = []

    def trainer(name: str, url: str, ack_url: str) -> None:
        """Leases at ``url`` and acks at the other replica (a lease is the database's, not the replica's)."""
        with admin(url) as c, admin(ack_url) as other:
            while not stop.is_set():
                body = c.get("/v1/samples/lease", params={"max": 2, "wait_s": 2}).json()
                if body["lease_id"]:
                    got[name] += [s["sample_id"] for s in body["samples"]]
                    r = other.post("/v1/samples/ack", json={"lease_id": body["lease_id"]})
                    if r.status_code != 200 or r.json()["acked"] != len(body["samples"]):
                        bad_acks.append(r.text)

    trainers = [
        threading.Thread(target=trainer, args=(n, u, o)) for n, u, o in (("A", a.url, b.url), ("B", b.url, a.url))
    ]
    for t in trainers:
        t.start()  # long-polling before any sample exists: woken by NOTIFY from whichever replica judges
    try:
        for i in range(8):
            _session([a.url, b.url] if i % 2 else [b.url, a.url], f"tr{i}", ["thanks, that worked"])
        wait_until(
            lambda: (
                _settled(a.url) and stats(a.url)["samples"]["ready"] == 0 and stats(a.url)["samples"]["leased"] == 0
            ),
            timeout_s=60,
        )
    finally:
        stop.set()
        for t in trainers:
            t.join(timeout=30)
    assert bad_acks == [] and not set(got["A"]) & set(got["B"])
    assert len(got["A"] + got["B"]) == stats(b.url)["samples"]["consumed"] >= 8


class _SlowPause(BaseHTTPRequestHandler):
    """Engine admin endpoints of a second weight-sync worker whose pause takes until the test releases it."""

    entered = threading.Event()
    release = threading.Event()

    def do_POST(self) -> None:  # http.server's naming
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        if self.path == "/pause_generation":
            type(self).entered.set()
            type(self).release.wait(60)
        body = {"success": True} if self.path == "/update_weights_from_disk" else {}
        data = json.dumps(body).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args: object) -> None:
        pass


def test_weight_update_at_a_holds_requests_at_b(tiny_model_dir, router, engine, pg_url, judge, tmp_path):
    slow = ThreadingHTTPServer(("127.0.0.1", free_port()), _SlowPause)
    threading.Thread(target=slow.serve_forever, daemon=True).start()
    slow_url = f"http://127.0.0.1:{slow.server_address[1]}"
    a = _replica(
        tiny_model_dir,
        router.url,
        pg_url,
        judge.url,
        tmp_path,
        "A",
        ["--engine-worker-urls", f"{engine.url},{slow_url}"],
    )
    b = _replica(tiny_model_dir, router.url, pg_url, judge.url, tmp_path, "B", ["--engine-worker-urls", engine.url])
    update: dict = {}
    held: dict = {}
    try:

        def do_update() -> None:
            with admin(a.url) as c:
                update["r"] = c.post(
                    "/admin/weights/update", json={"model_path": str(tiny_model_dir), "weight_version": "v-replicas"}
                )

        def ask_b() -> None:
            with client(b.url) as c:
                held["r"] = c.post(
                    "/v1/chat/completions",
                    headers={"X-Session-Id": "held", "X-Session-Done": "1"},
                    json={"messages": [{"role": "user", "content": "during the update"}], "max_tokens": 6},
                )
                held["at"] = time.monotonic()

        t_update = threading.Thread(target=do_update)
        t_update.start()
        assert _SlowPause.entered.wait(30)  # A announced the pause (B acknowledged) and is pausing the engines
        t_chat = threading.Thread(target=ask_b)
        t_chat.start()
        wait_until(lambda: metric_value(b.url, "hindsight_policy_gate_waiting") == 1, timeout_s=30)  # held at B's gate
        assert "r" not in held
        released_at = time.monotonic()
        _SlowPause.release.set()
        t_update.join(60)
        t_chat.join(60)
        assert update["r"].status_code == 200, update["r"].text
        assert held["r"].status_code == 200 and held["at"] >= released_at
        assert held["r"].json()["hindsight"]["weight_version"] == "v-replicas"  # the new weights, at B too
        wait_until(lambda: stats(b.url)["weight_version"] == "v-replicas", timeout_s=10)  # B learnt the version
        a.stop(grace_s=30)
        b.stop(grace_s=30)
        st = open_store(pg_url, "")
        try:  # a replica that shut down no longer counts as live: a later update does not wait for it
            assert st.runtime_keys("replica:") == [] and st.runtime_keys("weights_seen:") == []
        finally:
            st.close()
    finally:
        _SlowPause.release.set()
        a.stop()
        b.stop()
        slow.shutdown()
