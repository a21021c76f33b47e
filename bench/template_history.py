"""Per-template continuity and cost of both history modes, over the tiny dev model.

    python -m bench.template_history [--templates-dir tests/data/chat-templates] [--turns 5] [--history-tokens 30000]

Part 1 (served): for every shared chat template and each ``--history`` mode, a policy server
(``--chat-template``) in front of the dev engine runs three sessions of ``--turns`` turns: plain chat,
``reasoning_effort: "none"`` and a forced tool loop. Per session, from the store: how many continued turns start
with the previous prompt + sampled ids (continuous through the reply), how many start with the previous prompt
(prompt kept), and the trainer tokens per turn separate vs merged (a merged row is a run of continuous turns:
the last turn's sequence). A template's refusal (a 400) is shown as ``400``.

Part 2 (in process): the CPU ms of one continuing turn's render (``ContinuationRenderer.render``) after a
``--history-tokens`` history, per template and mode (``sampled`` also on a turn whose full-render check is due,
``--render-verify-tokens-per-turn``): what grows with the history in each mode.
"""

from __future__ import annotations

import argparse
import random
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

from devkit.engine_procs import start_dev_engine
from engine.chat import load_tokenizer, render_prompt_ids
from engine.continuation import ContinuationRenderer, PriorTurn
from policy_server.store import Store
from tests.testkit.cached_models import policy
from tests.testkit.servers import CLIENT_KEY, start_policy

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "rename",
            "description": "rename the file",
            "parameters": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 8}}},
        },
    }
]
FORCE = {"type": "function", "function": {"name": "rename"}}
NO_SYSTEM = ("gemma",)
TOOLS_ALWAYS = ("tool_use",)
SCENARIOS: dict[str, dict[str, Any]] = {
    "chat": {},
    "think_off": {"reasoning_effort": "none"},
    # Room for the longest family markup: in the tiny vocabulary other families' specials are spelled in bytes.
    "tools": {"tools": TOOLS, "tool_choice": FORCE, "max_tokens": 256},
}


def _session(http: httpx.Client, template: str, sid: str, scenario: str, turns: int) -> tuple[int | None, int]:
    """Runs one session: (None when every turn was answered, else the refused turn's status; tool calls parsed)."""
    extra = dict(SCENARIOS[scenario])
    if any(t in template for t in TOOLS_ALWAYS):
        extra.setdefault("tools", TOOLS)
    messages: list[dict[str, Any]] = (
        [] if any(t in template for t in NO_SYSTEM) else [{"role": "system", "content": "S"}]
    )
    messages.append({"role": "user", "content": "rename the report"})
    n_calls = 0
    for k in range(turns):
        body = {"messages": messages, "max_tokens": 12, "temperature": 1.0, "seed": k, **extra}
        r = http.post("/v1/chat/completions", json=body, headers={"X-Session-Id": sid})
        if r.status_code != 200:
            return r.status_code, n_calls
        reply = {key: v for key, v in r.json()["choices"][0]["message"].items() if v is not None}
        calls = reply.get("tool_calls") or []
        n_calls += bool(calls)
        nxt = (
            {"role": "tool", "tool_call_id": calls[0]["id"], "content": f"renamed {k}"}
            if calls
            else {"role": "user", "content": f"next step {k}"}
        )
        messages += [reply, nxt]
    return None, n_calls


def _measure(store: Store, sid: str, turns: int) -> tuple[int, int, float, float]:
    """(continuous, prompt kept, trainer tokens per turn separate, merged)."""
    recs = [store.get_turn(sid, k) for k in range(turns)]
    seqs = [r.prompt_ids + r.response_ids for r in recs if r is not None]
    cont = kept = 0
    merged_rows: list[int] = []
    for k, seq in enumerate(seqs):
        if k and seq[: len(seqs[k - 1])] == seqs[k - 1]:
            cont += 1
            merged_rows[-1] = len(seq)
        else:
            merged_rows.append(len(seq))
        if k:
            prev = recs[k - 1]
            cur = recs[k]
            assert prev is not None and cur is not None
            kept += cur.prompt_ids[: len(prev.prompt_ids)] == prev.prompt_ids
    return cont, kept, sum(map(len, seqs)) / len(seqs), sum(merged_rows) / len(seqs)


def served(templates: list[Path], turns: int) -> None:
    model = policy()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        with start_dev_engine(model, log_dir=work, extra_args=["--seed", "0"]) as eng:
            print(
                "| template | history | chat cont/kept | think_off cont/kept | tools cont/kept | trainer tok/turn sep -> merged (tools) |"
            )
            print("| --- | --- | --- | --- | --- | --- |")
            for tpl in templates:
                for mode in ("sampled", "template"):
                    d = work / f"{tpl.stem}-{mode}"
                    args = ["--chat-template", str(tpl), "--history", mode]
                    with start_policy(model, eng.url, d / "data", d, extra=args) as pol:
                        headers = {"Authorization": f"Bearer {CLIENT_KEY}"}
                        with httpx.Client(base_url=pol.url, headers=headers, trust_env=False, timeout=120) as http:
                            cells, tokens = [], ""
                            for scenario in SCENARIOS:
                                refused, n_calls = _session(http, tpl.name, scenario, scenario, turns)
                                if refused is not None:
                                    cells.append(str(refused))
                                    continue
                                cont, kept, sep, merged = _measure(Store(d / "data"), scenario, turns)
                                calls = f" ({n_calls}/{turns} calls)" if scenario == "tools" else ""
                                cells.append(f"{cont}/{turns - 1} / {kept}/{turns - 1}{calls}")
                                if scenario == "tools":
                                    tokens = f"{sep:.0f} -> {merged:.0f}"
                    print(f"| {tpl.stem} | {mode} | " + " | ".join(cells) + f" | {tokens} |", flush=True)


def render_cost(templates: list[Path], history_tokens: int, rounds: int = 5) -> None:
    tok = load_tokenizer(str(policy()))
    rng = random.Random(0)
    words = "the file list report error value result answer check run test fix".split()
    print(
        f"\n| template | render ms per continuing turn at {history_tokens} history tokens: sampled "
        "| sampled, full-render check due | template |"
    )
    print("| --- | --- | --- | --- |")
    for tpl in templates:
        tok.chat_template = tpl.read_text()
        system = [] if any(t in tpl.name for t in NO_SYSTEM) else [{"role": "system", "content": "S"}]
        messages: list[dict[str, Any]] = [*system, {"role": "user", "content": "start"}]
        tools = TOOLS if any(t in tpl.name for t in TOOLS_ALWAYS) else None
        while len(render_prompt_ids(tok, messages, tools)) < history_tokens:
            text = " ".join(rng.choice(words) for _ in range(400))
            messages += [{"role": "assistant", "content": text}, {"role": "user", "content": text}]
        prompt = render_prompt_ids(tok, messages, tools)
        response = [*tok.encode("done", add_special_tokens=False), tok.eos_token_id]
        prior = PriorTurn(messages, tools, None, prompt, response)
        nxt = [*messages, {"role": "assistant", "content": "done"}, {"role": "user", "content": "next"}]
        row = []
        # (history mode, check budget): no check due, a check due on every turn, the whole render.
        for mode, verify_tokens in (("sampled", 0), ("sampled", 10**9), ("template", 0)):
            renderer = ContinuationRenderer(tok, verify_tokens_per_turn=verify_tokens, history=mode)
            renderer.render(nxt, tools, None, prior)  # the probe, once per shape
            times = []
            for _ in range(rounds):
                t0 = time.process_time()
                renderer.render(nxt, tools, None, prior)
                times.append((time.process_time() - t0) * 1000)
            row.append(f"{statistics.median(times):.1f}")
        print(f"| {tpl.stem} | " + " | ".join(row) + " |", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--templates-dir", default=str(Path(__file__).parents[1] / "tests" / "data" / "chat-templates"))
    ap.add_argument("--turns", type=int, default=5)
    ap.add_argument("--history-tokens", type=int, default=30000)
    ap.add_argument("--skip-served", action="store_true")
    args = ap.parse_args()
    templates = sorted(Path(args.templates_dir).glob("*.jinja"))
    if not args.skip_served:
        served(templates, args.turns)
    render_cost(templates, args.history_tokens)


if __name__ == "__main__":
    main()
