"""Bench: hindsight-judge-eval against the tiny LLM judge on the CPU dev engine (AgentProcessBench, m=3).

Run:  python -m bench.judge_eval [--limit N] [--votes 3] [--concurrency 4] [--final-step marker|skip]
                                 [--json OUT] [--html OUT]

Starts the dev stack's judge the way the test kit does (tests.testkit.servers.llm_judge_stack: one CPU dev engine
on the dev stack's judge/teacher model, tests.testkit.cached_models.dev_teacher, and hindsight-judge on it with the
dev stack's judge settings, launch.devstack.DEV_JUDGE_ENV, keyed), then runs ``hindsight-judge-eval`` on
bench/data/agentprocessbench/hotpotqa.dev.jsonl (all 597 labelled steps unless ``--limit``) with a fresh step
cache, and prints its table, the wall time, the seconds per step and the full run's extrapolated time (target:
under 10 minutes for the 597 steps). The tiny judge's votes are random but well-formed text: the figures check
the pipeline end to end, not a judge's quality; the time is what the service costs per step on this machine.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

from judge_server.eval import cli
from judge_server.eval.dataset import load_dataset
from launch.devstack import DEV_JUDGE_ENV
from tests.testkit import cached_models
from tests.testkit.servers import JUDGE_KEY, llm_judge_stack

DATASET = Path(__file__).resolve().parent / "data" / "agentprocessbench" / "hotpotqa.dev.jsonl"
FULL_RUN_TARGET_S = 600.0


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m bench.judge_eval", description=__doc__.split("\n\n")[0])
    p.add_argument("--limit", type=int, help="only the first N labelled steps (default: all 597)")
    p.add_argument("--votes", type=int, default=3)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--final-step", choices=("marker", "skip"), default="marker")
    p.add_argument("--json", type=Path)
    p.add_argument("--html", type=Path)
    args = p.parse_args(argv)
    total = len(load_dataset(DATASET))
    steps = min(args.limit or total, total)
    print(f"# hindsight-judge-eval on the tiny LLM judge (CPU dev engine): {steps} of {total} steps, m={args.votes}")
    t0 = time.monotonic()
    model = cached_models.dev_teacher()
    print(f"judge model {model} ({time.monotonic() - t0:.1f} s)", flush=True)
    with tempfile.TemporaryDirectory() as tmp:
        t0 = time.monotonic()
        judge_args = ["--api-key", JUDGE_KEY, "--log-level", "warning"]
        with llm_judge_stack(model, Path(tmp), m=args.votes, args=judge_args, env=DEV_JUDGE_ENV) as stack:
            print(f"judge stack ready in {time.monotonic() - t0:.1f} s at {stack.judge.url}", flush=True)
            eval_argv = [
                str(DATASET),
                *("--judge-url", stack.judge.url, "--judge-api-key", JUDGE_KEY),
                *("--votes", str(args.votes), "--concurrency", str(args.concurrency)),
                *("--final-step", args.final_step, "--cache", str(Path(tmp) / "cache.jsonl"), "--no-progress"),
                *(["--limit", str(args.limit)] if args.limit else []),
                *(["--json", str(args.json)] if args.json else []),
                *(["--html", str(args.html)] if args.html else []),
            ]
            t0 = time.monotonic()
            code = cli.main(eval_argv)
            wall_s = time.monotonic() - t0
    per_step_s = wall_s / steps
    full_s = per_step_s * total
    print(f"\nwall {wall_s:.1f} s for {steps} steps (concurrency {args.concurrency}): {per_step_s:.2f} s per step")
    verdict = "PASS" if full_s < FULL_RUN_TARGET_S else "MISS"
    print(f"the full {total} steps: about {full_s / 60:.1f} min (target < {FULL_RUN_TARGET_S / 60:.0f} min): {verdict}")
    return code


if __name__ == "__main__":
    sys.exit(main())
