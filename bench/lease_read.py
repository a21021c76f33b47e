"""Bench: the cost of reading leased samples as records, side by side with passing their JSON through.

Run:  python -m bench.lease_read [--response-tokens 2000] [--prompt-tokens 3000] [--samples 64] [--rounds 5]

A lease reads each ``ready`` row's stored JSON, checks its values (engine.sample_values) and the route writes
the samples back out as JSON. Two ways, on the same stored rows:

- passthrough: ``fastjson.loads`` -> ``value_problem`` on the dict -> ``fastjson.dumps`` of the body;
- records (what the store and route do): the same, plus ``Sample.model_validate`` and ``Sample.to_json`` per
  sample (the one typed read the trainer path then uses).

Printed: milliseconds per sample of each (best of ``--rounds``), and their ratio (records / passthrough). The two
bodies are checked to be the same bytes first.
"""

from __future__ import annotations

import argparse
import json
import random
import time
from collections.abc import Callable

from engine import fastjson
from engine.records import Sample
from engine.sample_values import value_problem


def stored_rows(n: int, prompt_tokens: int, response_tokens: int, seed: int = 0) -> list[str]:
    """``n`` combine-mode Sample JSON rows as the dispatcher stores them."""
    rng = random.Random(seed)
    rows = []
    for i in range(n):
        r = response_tokens
        sample = Sample(
            mode="combine",
            loss_mask=[1] * r,
            reward=rng.choice([-1.0, 1.0]),
            has_reward=True,
            has_teacher=True,
            teacher_logprobs=[-rng.uniform(0.0, 5.0) for _ in range(r)],
            w_rl=1.0,
            w_opd=1.0,
            prompt_versions={"prm": "prm_eval_v2@abc", "hint": "hint_v1@def"},
            prompt_ids=[rng.randrange(50000) for _ in range(prompt_tokens)],
            response_ids=[rng.randrange(50000) for _ in range(r)],
            rollout_logprobs=[-rng.uniform(0.0, 5.0) for _ in range(r)],
            weight_version="3",
            sampling_params={"temperature": 1.0},
            sample_id=f"s{i}",
            session_id="bench",
            turn_index=i,
            created_at=1.0,
        )
        rows.append(json.dumps(sample.to_json()))
    return rows


def passthrough(rows: list[str]) -> str:
    samples = [fastjson.loads(r) for r in rows]
    assert not any(value_problem(s) for s in samples)
    return fastjson.dumps({"samples": samples})


def records(rows: list[str]) -> str:
    samples = []
    for r in rows:
        raw = fastjson.loads(r)
        assert value_problem(raw) is None
        samples.append(Sample.model_validate(raw))
    return fastjson.dumps({"samples": [s.to_json() for s in samples]})


def best_ms(fn: Callable[[list[str]], str], rows: list[str], rounds: int) -> float:
    best = float("inf")
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn(rows)
        best = min(best, time.perf_counter() - t0)
    return best * 1000 / len(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--response-tokens", type=int, default=2000)
    ap.add_argument("--prompt-tokens", type=int, default=3000)
    ap.add_argument("--samples", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=5)
    a = ap.parse_args()
    rows = stored_rows(a.samples, a.prompt_tokens, a.response_tokens)
    assert passthrough(rows) == records(rows), "the two bodies must be the same bytes"
    plain, typed = best_ms(passthrough, rows, a.rounds), best_ms(records, rows, a.rounds)
    print(f"samples={a.samples} prompt={a.prompt_tokens} response={a.response_tokens} tokens")
    print(f"passthrough: {plain:.3f} ms/sample")
    print(f"records:     {typed:.3f} ms/sample")
    print(f"ratio records/passthrough: {typed / plain:.2f}x")


if __name__ == "__main__":
    main()
