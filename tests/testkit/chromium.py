"""Open an HTML file in headless Chromium (Debian's ``chromium``) over the DevTools protocol and report
what rendered: each ``figure.plot``'s size, its ``.mark`` count, how many pixels of its screenshot differ
from the background, and every console error / uncaught exception / error log entry of the page.

Used by the run-report and dev-stack tests (``check_rendered``: every plot of ``trainer.report.page.PLOTS``
rendered). Chromium runs in its own session with a private profile; ``stop`` ends only that process group.
"""

from __future__ import annotations

import base64
import itertools
import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import pytest
from websockets.sync.client import connect

from trainer.report.page import PLOTS

START_DEADLINE_S = 60.0

# Decodes a PNG screenshot in the browser itself and counts pixels that differ from its top-left pixel
# (the chart's white background); a chart that did not render is one flat colour.
COUNT_INK_JS = """
async (b64) => {
  const img = new Image(); img.src = 'data:image/png;base64,' + b64; await img.decode();
  const c = document.createElement('canvas'); c.width = img.width; c.height = img.height;
  const g = c.getContext('2d'); g.drawImage(img, 0, 0);
  const px = g.getImageData(0, 0, c.width, c.height).data; let ink = 0;
  for (let i = 0; i < px.length; i += 4)
    if (Math.abs(px[i] - px[0]) + Math.abs(px[i+1] - px[1]) + Math.abs(px[i+2] - px[2]) > 30) ink++;
  return {ink: ink, w: c.width, h: c.height};
}
"""

PLOTS_JS = """
JSON.stringify([...document.querySelectorAll('figure.plot')].map(f => {
  const s = f.querySelector('svg'); const r = s ? s.getBoundingClientRect() : {left: 0, top: 0, width: 0, height: 0};
  return {name: f.dataset.plot, x: r.left + window.scrollX, y: r.top + window.scrollY, w: r.width, h: r.height,
          marks: f.querySelectorAll('.mark').length};
}))
"""


def chromium_path() -> str | None:
    return shutil.which("chromium") or shutil.which("chromium-browser")


@dataclass
class PageReport:
    plots: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)


class _Cdp:
    def __init__(self, ws_url: str):
        self.ws = connect(ws_url, max_size=None, open_timeout=10)
        self.ids = itertools.count(1)
        self.events: list[dict[str, Any]] = []

    def call(self, method: str, timeout_s: float = 30.0, **params: Any) -> dict[str, Any]:
        msg_id = next(self.ids)
        self.ws.send(json.dumps({"id": msg_id, "method": method, "params": params}))
        end = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, end - time.monotonic())))
            if msg.get("id") == msg_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            self.events.append(msg)

    def wait_event(self, method: str, timeout_s: float = 30.0) -> dict[str, Any]:
        for ev in self.events:
            if ev.get("method") == method:
                return ev
        end = time.monotonic() + timeout_s
        while True:
            msg = json.loads(self.ws.recv(timeout=max(0.1, end - time.monotonic())))
            self.events.append(msg)
            if msg.get("method") == method:
                return msg

    def evaluate(self, expression: str, **kw: Any) -> Any:
        res = self.call("Runtime.evaluate", expression=expression, returnByValue=True, **kw)
        if "exceptionDetails" in res:
            raise RuntimeError(f"evaluate failed: {res['exceptionDetails']}")
        return res["result"]["value"]


def _errors(events: list[dict[str, Any]]) -> list[str]:
    out = []
    for ev in events:
        m, p = ev.get("method"), ev.get("params", {})
        if m == "Runtime.exceptionThrown":
            out.append("exception: " + json.dumps(p.get("exceptionDetails", {}))[:300])
        elif m == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
            out.append("console.error: " + json.dumps(p.get("args", []))[:300])
        elif m == "Log.entryAdded" and p.get("entry", {}).get("level") == "error":
            out.append("log: " + p["entry"].get("text", "")[:300])
    return out


def inspect_page(html: Path, timeout_s: float = START_DEADLINE_S) -> PageReport:
    exe = chromium_path()
    assert exe, "chromium is not installed"
    profile = Path(tempfile.mkdtemp(prefix="hs-chromium-"))
    proc = subprocess.Popen(
        [
            exe,
            "--headless=new",
            "--no-sandbox",
            "--disable-gpu",
            "--disable-dev-shm-usage",
            "--no-first-run",
            "--no-default-browser-check",
            "--hide-scrollbars",
            "--remote-debugging-address=127.0.0.1",
            "--remote-debugging-port=0",
            f"--user-data-dir={profile}",
            "--window-size=1280,900",
            "about:blank",
        ],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    try:
        port_file, end = profile / "DevToolsActivePort", time.monotonic() + timeout_s
        while not (port_file.exists() and port_file.read_text().strip()):
            assert proc.poll() is None, f"chromium exited with {proc.returncode}"
            assert time.monotonic() < end, "chromium did not open its DevTools port"
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        with httpx.Client(trust_env=False, timeout=10) as c:
            while True:
                targets = [t for t in c.get(f"http://127.0.0.1:{port}/json/list").json() if t.get("type") == "page"]
                if targets:
                    break
                assert time.monotonic() < end, "chromium opened no page"
                time.sleep(0.1)
        cdp = _Cdp(targets[0]["webSocketDebuggerUrl"])
        for method in ("Runtime.enable", "Log.enable", "Page.enable"):
            cdp.call(method)
        cdp.events.clear()
        cdp.call("Page.navigate", url=html.resolve().as_uri())
        cdp.wait_event("Page.loadEventFired", timeout_s)
        report = PageReport()
        for plot in json.loads(cdp.evaluate(PLOTS_JS)):
            shot = cdp.call(
                "Page.captureScreenshot",
                format="png",
                captureBeyondViewport=True,
                clip={
                    "x": plot["x"],
                    "y": plot["y"],
                    "width": max(1, plot["w"]),
                    "height": max(1, plot["h"]),
                    "scale": 1,
                },
            )["data"]
            base64.b64decode(shot, validate=True)  # a well-formed screenshot came back
            ink = cdp.evaluate(f"({COUNT_INK_JS})({json.dumps(shot)})", awaitPromise=True)
            report.plots[plot["name"]] = {**plot, **ink}
        report.errors = _errors(cdp.events)
        cdp.ws.close()
        return report
    finally:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
            proc.wait(timeout=10)
        except (ProcessLookupError, subprocess.TimeoutExpired):
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
        shutil.rmtree(profile, ignore_errors=True)


def require_chromium() -> None:
    if chromium_path() is None:
        if os.environ.get("CI"):
            pytest.fail("chromium is missing in CI (.ci/run installs Debian's chromium package)")
        pytest.skip("Debian's chromium package is not installed (apt-get install -y chromium)")


def check_rendered(html: Path, must_have_marks: tuple[str, ...]) -> None:
    """Every plot rendered in Chromium: present, sized, a non-blank screenshot; no console error."""
    page = inspect_page(html)
    assert page.errors == []
    assert list(page.plots) == list(PLOTS)
    for name, plot in page.plots.items():
        assert plot["w"] >= 500 and plot["h"] >= 200, (name, plot)
        assert plot["ink"] > 0.005 * plot["w"] * plot["h"], (name, plot)  # more than a blank box
    for name in must_have_marks:
        assert page.plots[name]["marks"] > 0, (name, page.plots[name])
