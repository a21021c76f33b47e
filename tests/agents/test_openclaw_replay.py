"""What stock OpenClaw sends back of a streamed reply, for the replies that are hard to stream.

OpenClaw's own model runtime (``@openclaw/ai``, installed with the ``openclaw`` CLI by install_openclaw.sh) runs two
turns against a loopback server that streams a reply exactly as the policy server splits it
(policy_server.api.chat.streaming.StreamSplitter and the OpenAI chunk shape), then captures the second request. Asserted
for each reply: the history OpenClaw resends pairs with the turn the policy server records
(policy_server.serving.pairing.pair_next_state), so the reply is judged instead of splitting the session. The
replies: a stray ``</think>`` (the random tiny policy writes them; before the splitter and the parser shared one rule,
the splitter sent the text before it again as reasoning after the content, and OpenClaw then dropped what it still held
of that content), a leading think block, an inline think block
(OpenClaw hides it and rejoins the text), a reply that is all reasoning (OpenClaw leaves it out of the history), and
a tool call followed by its result.
"""

from __future__ import annotations

import json
import os
import subprocess
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from policy_server.api.chat import completions
from policy_server.api.chat.streaming import StreamSplitter, assistant_message
from policy_server.serving.pairing import pair_next_state
from tests.testkit.openclaw import OPENCLAW_DIR, openclaw_binaries

pytestmark = pytest.mark.e2e

SCRIPT = Path(__file__).with_name("openclaw_replay.mjs")
CALL = '<tool_call>\n{"name": "read", "arguments": {"path": "a.txt"}}\n</tool_call>'


def sse_body(text: str, chunk_chars: int = 3) -> tuple[str, dict]:
    """The SSE answer the policy server streams for ``text`` (sampled ``chunk_chars`` at a time) and the reply it
    records."""
    sp = StreamSplitter()
    pairs = [p for i in range(0, len(text), chunk_chars) for p in sp.feed(text[i : i + chunk_chars])]
    tail, calls = sp.finish()
    pairs += tail

    def chunk(**kw: object) -> dict:
        return completions.chunk(rid="chatcmpl-replay", model="hindsight-policy", created=0, **kw)  # type: ignore[arg-type]

    events = [chunk(delta={"role": "assistant", "content": ""})]
    events += [chunk(delta={"reasoning_content" if k == "reasoning" else "content": t}) for k, t in pairs]
    if calls:
        events.append(chunk(delta={"tool_calls": [{**c, "index": i} for i, c in enumerate(calls)]}))
    events.append(chunk(delta={}, finish=completions.finish_reason({"type": "stop"}, bool(calls))))
    body = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
    record = assistant_message(sp.content, sp.reasoning or None, calls)
    return body, {k: record.get(k) for k in ("content", "reasoning_content", "tool_calls")}


class ReplayServer:
    """Streams ``reply`` to the first chat request and ``ok`` to later ones; keeps every request body."""

    def __init__(self) -> None:
        self.reply = ""
        self.bodies: list[dict] = []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                outer.bodies.append(json.loads(self.rfile.read(int(self.headers["content-length"]))))
                data = sse_body(outer.reply if len(outer.bodies) == 1 else "ok")[0].encode()
                self.send_response(200)
                self.send_header("content-type", "text/event-stream")
                self.send_header("content-length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args: object) -> None:
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_port}/v1"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()


@pytest.fixture(scope="module")
def server() -> Iterator[ReplayServer]:
    srv = ReplayServer()
    yield srv
    srv.httpd.shutdown()


@pytest.mark.parametrize(
    "reply",
    [
        "Some noise 52 Resul</think> 34 890 tail",
        # OpenClaw holds text from a backtick on; reasoning arriving after it used to drop the held part
        "noise ` more 29< again</think> tail",
        "line one\n\nline two</think> z",
        "<think>plan the answer</think>\n\nThe answer is 4.",
        "Sure. <think>check the units</think> It is 4.",
        "<think>all reasoning, cut by max_tokens",
        "Let me look.\n" + CALL,
    ],
    ids=[
        "stray-close",
        "stray-close-after-held-text",
        "stray-close-after-blank-line",
        "leading-block",
        "inline-block",
        "all-reasoning",
        "tool-call",
    ],
)
def test_openclaw_resends_a_history_that_pairs_with_the_recorded_reply(server: ReplayServer, reply: str) -> None:
    node, _ = openclaw_binaries()
    server.reply, server.bodies = reply, []
    env = {k: v for k, v in os.environ.items() if "proxy" not in k.lower()}
    ai_dir = OPENCLAW_DIR / "oc/node_modules/@openclaw/ai"
    res = subprocess.run(
        [str(node), str(SCRIPT), str(ai_dir), server.url, "file text"],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    first, second = server.bodies
    recorded = sse_body(reply)[1]
    pairing = pair_next_state(first["messages"], recorded, second["messages"])
    assert pairing.kind == "paired", (pairing.note, recorded, second["messages"][len(first["messages"]) :])
    feedback = pairing.next_state or []
    assert [m["role"] for m in feedback] == (["tool"] if recorded["tool_calls"] else ["user"])
