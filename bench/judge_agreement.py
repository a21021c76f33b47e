"""Judge evaluation harness: how often does the judge agree with our gold verdicts, and does voting help?

Run:  python -m bench.judge_agreement --judge-url URL [--api-key K] [--turns FILE] [--concurrency 8] [--json OUT]
  or: python -m bench.judge_agreement --judge-args "--backend openai --base-url URL --model NAME --api-key-file F"

Either backend: ``--judge-url`` measures a running judge service, whatever its backend (``llm`` on SGLang's
``/generate``, ``openai`` on any OpenAI-compatible chat endpoint, ``rules``); ``--judge-args`` starts a
``hindsight-judge`` with those arguments on a free loopback port for the run and stops it after (so a hosted
judge can be measured against the labelled set before it is trusted with rewards). The backend, model and
prompt versions are printed with the figures.

The labelled set (``bench/judge_agreement_turns.jsonl``, written by us) holds agent turns across six
categories (user corrections, thanks, tool successes, tool errors, ambiguous replies, prompt-injection
attempts in the response or in the next state), each with ``context``, ``response``, ``next_state`` and a
gold PRM verdict in {1, 0, -1}. Every turn is sent to ``POST /v1/judge`` (task ``prm``) under four settings:
fixed m = 1, 3, 5 and adaptive (``policy: adaptive``, m = 5), once as written and once with the context
order perturbed. Printed per setting (and written with ``--json``):

- ``accuracy``: share of turns whose verdict is ``ok`` with score == gold (a tie, no_valid_votes or
  judge_failed is never right);
- ``tie_aware``: like accuracy, but a tie earns 1/k when gold is one of the k values tied at the top
  of the valid votes (the agreement a random tie-break would have);
- ``flip_rate``: share of turns whose verdict (score, or the status when not ok) differs between the
  original and the perturbed context (the context's messages between the leading system message and the
  last message in reverse order; the judged turn is unchanged);
- ``no_valid_rate``: share of turns with status ``no_valid_votes``; ``failed_rate``: judge_failed or a
  request that failed (never counted as a verdict); ``guarded_rate``: share of turns a guard took the score
  from (status ``abstained`` or ``quarantined``: no score, never right);
- ``votes_per_turn``, ``engine_calls_per_turn``, ``tokens_per_turn`` (prompt + completion as the judge's
  ``usage`` reports them; ``cached_tokens`` too when reported), means over the original requests;
- ``failed_requests``: requests (original and perturbed) that got no answer (transport error or non-2xx).

Exit status 0 when every request was answered, 1 (after printing and writing the figures) when any failed:
the figures then count those turns as failed, so they do not measure the judge alone.

Against the rules backend (keywords in the next state) it is a sanity check with hand-counted figures
(tests/judge/test_agreement_harness.py); against a real judge model it is the number to trust it by.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx

from engine.records import STATUS_ABSTAINED, STATUS_FAILED, STATUS_NO_VALID, STATUS_OK, STATUS_QUARANTINED, STATUS_TIE
from judge_server.eval.local_judge import local_judge

DEFAULT_TURNS = Path(__file__).resolve().parent / "judge_agreement_turns.jsonl"
SETTINGS = (("m=1", 1, "fixed"), ("m=3", 3, "fixed"), ("m=5", 5, "fixed"), ("adaptive", 5, "adaptive"))
CATEGORIES = ("correction", "thanks", "tool_success", "tool_error", "ambiguous", "injection")


def load_turns(path: Path) -> list[dict[str, Any]]:
    turns = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    for t in turns:
        if t.get("gold") not in (1, 0, -1) or t.get("category") not in CATEGORIES:
            raise ValueError(f"turn {t.get('id')}: gold must be 1/0/-1 and category one of {CATEGORIES}")
    return turns


def perturb_context(context: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Reverse the messages between a leading system message and the last message (both stay in place)."""
    head = 1 if context and context[0].get("role") == "system" else 0
    if len(context) - head < 3:
        return list(context)
    return context[:head] + context[head:-1][::-1] + context[-1:]


def verdict(prm: dict[str, Any] | None) -> str:
    """The comparable outcome of one judgement: the score when ok, else the status."""
    if not prm:
        return "request_failed"
    return str(prm.get("score")) if prm.get("status") == STATUS_OK else str(prm.get("status"))


def tie_aware_credit(prm: dict[str, Any] | None, gold: int) -> float:
    if not prm:
        return 0.0
    if prm.get("status") == STATUS_OK:
        return 1.0 if prm.get("score") == gold else 0.0
    if prm.get("status") == STATUS_TIE:
        counts = Counter(v for v in prm.get("votes") or [] if v is not None)
        if not counts:
            return 0.0
        top = max(counts.values())
        tied = [v for v, n in counts.items() if n == top]
        return 1.0 / len(tied) if gold in tied else 0.0
    return 0.0


def summarise(
    turns: list[dict[str, Any]], original: list[dict[str, Any] | None], perturbed: list[dict[str, Any] | None]
) -> dict[str, Any]:
    """Figures of one setting; ``original[i]``/``perturbed[i]`` are the judge's responses for turn i (None: failed)."""
    n = len(turns)
    prms = [r.get("prm") if r else None for r in original]
    usage = [(r or {}).get("usage") or {} for r in original]
    right = [
        p is not None and p.get("status") == STATUS_OK and p.get("score") == t["gold"]
        for p, t in zip(prms, turns, strict=True)
    ]
    by_cat = {c: [ok for ok, t in zip(right, turns, strict=True) if t["category"] == c] for c in CATEGORIES}
    flips = sum(verdict(p) != verdict((q or {}).get("prm")) for p, q in zip(prms, perturbed, strict=True))
    return {
        "turns": n,
        "accuracy": sum(right) / n,
        "tie_aware": sum(tie_aware_credit(p, t["gold"]) for p, t in zip(prms, turns, strict=True)) / n,
        "flip_rate": flips / n,
        "no_valid_rate": sum(p is not None and p.get("status") == STATUS_NO_VALID for p in prms) / n,
        "failed_rate": sum(p is None or p.get("status") == STATUS_FAILED for p in prms) / n,
        "guarded_rate": sum(p is not None and p.get("status") in (STATUS_ABSTAINED, STATUS_QUARANTINED) for p in prms)
        / n,
        "failed_requests": sum(r is None for r in original) + sum(r is None for r in perturbed),
        "votes_per_turn": sum(len((p or {}).get("votes") or []) for p in prms) / n,
        "engine_calls_per_turn": sum(u.get("engine_calls", 0) for u in usage) / n,
        "tokens_per_turn": sum(u.get("prompt_tokens", 0) + u.get("completion_tokens", 0) for u in usage) / n,
        "cached_tokens_per_turn": sum(u.get("cached_tokens", 0) for u in usage) / n,
        "accuracy_by_category": {c: (sum(v) / len(v) if v else None) for c, v in by_cat.items()},
        "right_by_category": {c: sum(v) for c, v in by_cat.items()},
    }


async def judge_all(
    url: str,
    api_key: str | None,
    turns: list[dict[str, Any]],
    m: int,
    policy: str,
    concurrency: int,
    timeout_s: float,
    perturbed: bool,
) -> list[dict[str, Any] | None]:
    """One /v1/judge per turn; a request that fails (transport error or non-2xx) is None, reported on stderr."""
    sem = asyncio.Semaphore(concurrency)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def one(client: httpx.AsyncClient, t: dict[str, Any]) -> dict[str, Any] | None:
        body = {
            "context": perturb_context(t["context"]) if perturbed else t["context"],
            "response": t["response"],
            "next_state": t["next_state"],
            "tasks": ["prm"],
            "m": m,
            "policy": policy,
        }
        async with sem:
            try:
                r = await client.post("/v1/judge", json=body)
                r.raise_for_status()
                return r.json()
            except httpx.HTTPError as exc:
                print(f"  turn {t['id']} (m={m} {policy}): request failed: {exc!r}", file=sys.stderr)
                return None

    async with httpx.AsyncClient(
        base_url=url, headers=headers, trust_env=False, timeout=httpx.Timeout(timeout_s, connect=5.0)
    ) as client:
        return list(await asyncio.gather(*(one(client, t) for t in turns)))


async def evaluate(
    url: str, api_key: str | None, turns: list[dict[str, Any]], concurrency: int = 8, timeout_s: float = 300.0
) -> dict[str, dict[str, Any]]:
    out = {}
    for name, m, policy in SETTINGS:
        orig = await judge_all(url, api_key, turns, m, policy, concurrency, timeout_s, perturbed=False)
        pert = await judge_all(url, api_key, turns, m, policy, concurrency, timeout_s, perturbed=True)
        out[name] = summarise(turns, orig, pert)
    return out


def print_report(figures: dict[str, dict[str, Any]], turns: list[dict[str, Any]]) -> None:
    counts = Counter(t["category"] for t in turns)
    print(f"judge agreement on {len(turns)} labelled turns: " + ", ".join(f"{c} {counts[c]}" for c in CATEGORIES))
    cols = (
        "accuracy",
        "tie_aware",
        "flip_rate",
        "no_valid_rate",
        "failed_rate",
        "votes_per_turn",
        "engine_calls_per_turn",
        "tokens_per_turn",
    )
    print(f"{'setting':9} " + " ".join(f"{c:>12}" for c in cols))
    for name, f in figures.items():
        print(f"{name:9} " + " ".join(f"{f[c]:>12.3f}" for c in cols))
    print("accuracy by category:")
    print(f"{'setting':9} " + " ".join(f"{c:>12}" for c in CATEGORIES))
    for name, f in figures.items():
        print(f"{name:9} " + " ".join(f"{f['right_by_category'][c]:>6}/{counts[c]:<5}" for c in CATEGORIES))


@contextlib.contextmanager
def judge_service(url: str | None, judge_args: str | None, api_key: str | None) -> Iterator[str]:
    """The judge's URL: ``url`` as given, or a ``hindsight-judge`` started with ``judge_args`` (stopped after)."""
    if url is not None:
        yield url
        return
    assert judge_args is not None
    with local_judge(judge_args, api_key) as started:
        yield started


def describe_judge(url: str, api_key: str | None) -> str:
    """One line naming what is measured (the judge's /ready as its key holder sees it)."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        info = httpx.get(url + "/ready", headers=headers, timeout=10, trust_env=False).json()
    except (httpx.HTTPError, ValueError) as exc:
        return f"judge {url}: /ready unreadable ({exc!r})"
    return (
        f"judge {url}: backend {info.get('backend', '?')}, endpoint {info.get('engine_url')}, "
        f"prompts {info.get('prompt_versions')}"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    target = p.add_mutually_exclusive_group(required=True)
    target.add_argument("--judge-url", help="a running judge service")
    target.add_argument(
        "--judge-args", help="start hindsight-judge with these arguments for the run (e.g. a hosted openai backend)"
    )
    p.add_argument("--api-key", default=None, help="the judge's API key (Bearer)")
    p.add_argument("--turns", type=Path, default=DEFAULT_TURNS, help="labelled set (JSONL)")
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--timeout-s", type=float, default=300.0, help="per request")
    p.add_argument("--json", type=Path, default=None, help="also write the figures here")
    args = p.parse_args(argv)
    turns = load_turns(args.turns)
    with judge_service(args.judge_url, args.judge_args, args.api_key) as url:
        measured = describe_judge(url, args.api_key)
        figures = asyncio.run(evaluate(url, args.api_key, turns, args.concurrency, args.timeout_s))
    print_report(figures, turns)
    print(measured)
    if args.json:
        args.json.write_text(json.dumps(figures, indent=2) + "\n")
    failed = sum(f["failed_requests"] for f in figures.values())
    if failed:
        print(
            f"{failed} of {2 * len(turns) * len(figures)} judge requests failed (see above): the figures count "
            "those turns as failed",
            file=sys.stderr,
        )
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
