"""Bench: what the secret scanner adds to a turn of an agent-sized session, side by side with a turn's render.

Run:  python -m bench.secret_scan [--history-chars 120000] [--turns 6] [--rounds 3]

An OpenClaw-shaped session: a system prompt, tool definitions and a history of tool calls and results that totals
about ``--history-chars`` characters (about 30k tokens), each later turn adding one tool result of 4k characters.
The policy server redacts a turn's messages before pairing (policy_server.serving.chat_turn), so this sits before
the first token. Measured per turn, best of ``--rounds``:

- first sight: the scanner has never seen any of the session's strings (a new session, or a new replica);
- continuing: what a continuing turn's arrival costs (SecretScanner.redact_transcript, as the chat turn calls it):
  the previous turn's transcript was found clean, so only the messages after it are walked and the new tool
  result scanned;
- render: the chat template rendering the same messages with the tiny model's tokenizer (the work every turn
  does anyway), as the yardstick.

Printed: milliseconds of each and the ratios scan / render.
"""

from __future__ import annotations

import argparse
import json
import random
import time

from engine.chat import load_tokenizer, render_prompt_ids
from policy_server.serving.secrets import SecretScanner

WORDS = "the build failed because a test read a stale fixture so I reran it with a clean cache and".split()


def _text(rng: random.Random, chars: int) -> str:
    out: list[str] = []
    n = 0
    while n < chars:
        w = rng.choice(WORDS)
        out.append(w)
        n += len(w) + 1
    return " ".join(out)


def session(history_chars: int, turns: int, seed: int = 0) -> tuple[list[dict], list[list[dict]]]:
    """(tools, the messages of each turn): each turn's messages extend the previous turn's by one tool round."""
    rng = random.Random(seed)
    tools = [
        {
            "type": "function",
            "function": {
                "name": f"tool_{i}",
                "description": _text(rng, 300),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for i in range(12)
    ]
    messages: list[dict] = [{"role": "system", "content": _text(rng, 8000)}, {"role": "user", "content": "Fix it."}]
    k = 0

    def round_trip(result_chars: int) -> list[dict]:
        nonlocal k
        k += 1
        call = {"id": f"call_{k}", "type": "function", "function": {"name": "tool_1", "arguments": '{"path": "a"}'}}
        return [
            {"role": "assistant", "content": _text(rng, 200), "tool_calls": [call]},
            {"role": "tool", "tool_call_id": f"call_{k}", "content": _text(rng, result_chars)},
        ]

    while sum(len(json.dumps(m)) for m in messages) < history_chars:
        messages += round_trip(4000)
    out = [list(messages)]
    for _ in range(turns - 1):
        messages = messages + round_trip(4000)
        out.append(list(messages))
    return tools, out


def best_ms(fn, rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best * 1e3


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--history-chars", type=int, default=120_000)
    ap.add_argument("--turns", type=int, default=6)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--model-path", default=None, help="a tokenizer with a chat template (default: the tiny model)")
    args = ap.parse_args()
    if args.model_path is None:
        from devkit.model_cache import tiny_policy

        args.model_path = str(tiny_policy(seed=0))  # built once into the machine's model cache
    tokenizer = load_tokenizer(args.model_path)
    tools, turns = session(args.history_chars, args.turns)
    chars = sum(len(json.dumps(m)) for m in turns[-1])
    print(f"{len(turns)} turns, last turn {len(turns[-1])} messages, {chars} characters of messages")
    first = best_ms(lambda: SecretScanner().redact(turns[-1]), args.rounds)
    scanner = SecretScanner()
    for messages in turns[:-1]:
        scanner.redact(messages)
    scanner.redact(tools)

    def continuing() -> float:
        s = SecretScanner()
        s._cache = scanner._cache.copy()  # the state after the earlier turns, for every round
        s.redact_transcript(turns[-2])  # the previous turn's arrival: its strings cached, the transcript clean
        t = time.perf_counter()
        s.redact_transcript(turns[-1])
        return time.perf_counter() - t

    cont = min(continuing() for _ in range(args.rounds)) * 1e3
    render = best_ms(lambda: render_prompt_ids(tokenizer, turns[-1], tools), args.rounds)
    print(f"{'first sight':12s} {first:9.1f} ms   scan/render {first / render:6.2f}")
    print(f"{'continuing':12s} {cont:9.1f} ms   scan/render {cont / render:6.2f}")
    print(f"{'render':12s} {render:9.1f} ms")


if __name__ == "__main__":
    main()
