"""Graceful shutdown, real subprocesses: SIGTERM while a chat request and judge calls are in flight.

A latency-injecting reverse proxy (fault injection only: it forwards to the real dev engine / real rules
judge after a delay) keeps requests in flight long enough to send SIGTERM in the middle of them."""

from __future__ import annotations

import signal
import threading
import time
from collections import Counter
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import httpx
import pytest

from policy_server.store import Store
from tests.testkit.procs import free_port
from tests.testkit.servers import admin, client, ready_status, samples_of, start_judge, start_policy
from tests.waiting import wait_until

pytestmark = pytest.mark.e2e


class DelayProxy:
    """Forwards every request to ``upstream``; POSTs whose path starts with a key of ``delays`` wait first.
    ``arrived`` counts the POSTs per path, so a test can wait until a request is in flight."""

    def __init__(self, upstream: str):
        self.upstream, self.delays, self.arrived = upstream, {}, Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *a):  # quiet
                pass

            def _forward(self, method: str) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0)) if method == "POST" else None
                if method == "POST":
                    proxy.arrived[self.path.split("?")[0]] += 1
                for prefix, delay in proxy.delays.items():
                    if method == "POST" and self.path.startswith(prefix):
                        time.sleep(delay)
                headers = {k: v for k, v in self.headers.items() if k.lower() in ("content-type", "authorization")}
                try:
                    r = httpx.request(
                        method, proxy.upstream + self.path, content=body, headers=headers, timeout=120, trust_env=False
                    )
                except httpx.HTTPError:
                    self.send_error(502)
                    return
                self.send_response(r.status_code)
                self.send_header("content-type", r.headers.get("content-type", "application/json"))
                self.send_header("content-length", str(len(r.content)))
                self.end_headers()
                self.wfile.write(r.content)

            def do_GET(self):
                self._forward("GET")

            def do_POST(self):
                self._forward("POST")

        self.server = ThreadingHTTPServer(("127.0.0.1", free_port()), Handler)
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _chat(url: str, sid: str, messages: list[dict], **headers) -> httpx.Response:
    with client(url) as c:
        return c.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": 6},
            headers={"X-Session-Id": sid, **headers},
        )


def test_sigterm_drains_then_restart_resumes(tiny_model_dir, engine, tmp_path):
    judge = start_judge(tmp_path)
    eng_proxy, judge_proxy = DelayProxy(engine.url), DelayProxy(judge.url)
    data = tmp_path / "data"
    pol = None
    try:
        drain_s = 1.5
        extra = [
            "--judge-url",
            judge_proxy.url,
            "--shutdown-drain-s",
            str(drain_s),
            "--shutdown-grace-s",
            "20",
            "--dispatch-retry-initial-s",
            "0.2",
        ]
        pol = start_policy(tiny_model_dir, eng_proxy.url, data, tmp_path, name="policy-a", extra=extra)
        u = [{"role": "user", "content": "open the file"}]
        # s1: a turn paired, judged slowly (30 s per judge call >> drain_s): its judge call is in flight at SIGTERM
        a1 = _chat(pol.url, "s1", u).json()["choices"][0]["message"]
        judge_proxy.delays["/v1/judge"] = 30.0
        assert (
            _chat(
                pol.url,
                "s1",
                u
                + [{"role": "assistant", "content": a1["content"]}, {"role": "user", "content": "thanks, that worked"}],
            ).status_code
            == 200
        )
        wait_until(lambda: judge_proxy.arrived["/v1/judge"] >= 1)  # the dispatcher's judge call is in flight
        # a chat request in flight at SIGTERM (the engine answers after 2 s) must finish
        eng_proxy.delays["/generate"] = 2.0
        box: dict = {}
        engine_calls = eng_proxy.arrived["/generate"]
        t = threading.Thread(target=lambda: box.update(r=_chat(pol.url, "s2", u)))
        t.start()
        wait_until(lambda: eng_proxy.arrived["/generate"] > engine_calls)  # the chat request is at the engine
        t0 = time.monotonic()
        pol.proc.send_signal(signal.SIGTERM)
        wait_until(lambda: ready_status(pol.url) == 503)  # draining
        refused = _chat(pol.url, "s3", u)
        assert refused.status_code == 503 and "shutting down" in refused.json()["error"]["message"]
        t.join(30)
        assert box["r"].status_code == 200, box["r"].text  # in flight -> finished
        rc = pol.proc.wait(timeout=30)
        elapsed = time.monotonic() - t0
        assert rc == 0, pol.log_tail()
        # The in-flight chat (2 s) and drain_s, plus slack for a loaded machine (14.7 s seen with both cores
        # busy): below the 30 s judge call that shutdown must cancel rather than wait for.
        assert elapsed < 2.0 + drain_s + 16.0, f"shutdown took {elapsed:.1f}s"
        log = pol.log_path.read_text()
        assert "1 judge call(s) cancelled" in log and "stay in the store" in log

        st = Store(data)
        [s1] = samples_of(st, "s1")
        assert s1.status == "pending_judge" and s1.sample is None  # left pending, not half-written
        assert st.get_turn("s2", 0) is not None  # the in-flight turn was recorded before its answer
        assert st.get_turn("s3", 0) is None  # the refused one was not
        assert st.stats().turns == 3

        # restart: the judge is fast again; the pending turn is judged, nothing lost
        judge_proxy.delays.clear()
        eng_proxy.delays.clear()
        pol = start_policy(tiny_model_dir, eng_proxy.url, data, tmp_path, name="policy-b", extra=extra)
        wait_until(lambda: samples_of(st, "s1")[0].status == "ready")
        assert (samples_of(st, "s1")[0].sample or {})["reward"] == 1.0
        with admin(pol.url) as a:
            stats = a.get("/v1/samples/stats").json()
        assert stats["turns"] == 3 and stats["turns_awaiting_next_state"] == 2  # s1 turn 1 and s2 turn 0 await
        # a drain that finishes in time: judged before exit
        judge_proxy.delays["/v1/judge"] = 0.5
        a2 = box["r"].json()["choices"][0]["message"]
        judge_calls = judge_proxy.arrived["/v1/judge"]
        assert (
            _chat(
                pol.url,
                "s2",
                u + [{"role": "assistant", "content": a2["content"]}, {"role": "user", "content": "thanks"}],
            ).status_code
            == 200
        )
        wait_until(lambda: judge_proxy.arrived["/v1/judge"] > judge_calls)  # s2's judge call is in flight
        pol.proc.send_signal(signal.SIGTERM)
        assert pol.proc.wait(timeout=30) == 0
        assert samples_of(st, "s2")[0].status == "ready"  # completed while draining
    finally:
        if pol:
            pol.stop()
        judge.stop()
        eng_proxy.close()
        judge_proxy.close()
