"""``hindsight-judge-eval``: score verdict sources against step-labelled agent trajectories (docs/JUDGE_EVAL.md).

    hindsight-judge-eval DATASET.jsonl --predictions P.jsonl [P2.jsonl ...]
    hindsight-judge-eval DATASET.jsonl --judge-url URL [--judge-api-key K] [--votes 3] [--concurrency 4]
                         [--limit N] [--final-step marker|skip] [--cache PATH]
    hindsight-judge-eval DATASET.jsonl --judge-args "--backend openai --base-url URL --model NAME --api-key-file F"
    common: [--json OUT] [--html OUT] [--bootstrap 1000] [--seed 0] [--no-guards] [--no-progress]

Sources, in this order: the always-+1 base rate, the deterministic guards (default configuration; ``--no-guards``
drops them and their rule table), each prediction file (named by its stem without ``.dev``), and the judge at
``--judge-url``, or at a ``hindsight-judge`` started for the run with ``--judge-args`` (every labelled step sent as a (turn, next_state) pair to ``POST /v1/judge``, cached per step
for resume). Prints the table (and the judge's backend and prompt versions); ``--json`` / ``--html`` write the
figures, the HTML with a confusion matrix per source. Bad input exits 2; an unreachable judge exits 1.
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import os
import sys
from collections import Counter
from pathlib import Path

from judge_server.eval.dataset import DatasetError, LabelledStep, load_dataset, load_predictions
from judge_server.eval.guard_stats import guard_verdicts, measure_guards
from judge_server.eval.local_judge import local_judge
from judge_server.eval.metrics import Verdict, bootstrap_intervals, constant_verdicts, score
from judge_server.eval.report import EvalReport, JudgeSummary, SourceReport, format_table, render_html, to_json
from judge_server.eval.run import EvalRunError, JudgeTarget, RunResult, judge_steps

PROG = "hindsight-judge-eval"
BASE_RATE = "always +1 (base rate)"
GUARDS_SOURCE = "guards (default config)"
DEFAULT_CACHE_DIR = Path(".hindsight/judge-eval")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _non_negative(text: str) -> int:
    value = int(text)
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be at least 0, got {value}")
    return value


def _seconds(text: str) -> float:
    value = float(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive number of seconds, got {value}")
    return value


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=PROG, description=__doc__.split("\n\n")[0] if __doc__ else None)
    p.add_argument("dataset", type=Path, help="labelled trajectories (JSON lines with messages and step_labels)")
    p.add_argument("--predictions", type=Path, nargs="+", default=[], metavar="P", help="prediction files to score")
    target = p.add_mutually_exclusive_group()
    target.add_argument("--judge-url", help="a running judge service to send every labelled step to")
    target.add_argument(
        "--judge-args",
        metavar="ARGS",
        help='start hindsight-judge with these arguments for the run, e.g. "--backend openai --base-url URL '
        '--model NAME --api-key-file F" (on 127.0.0.1, stopped after)',
    )
    p.add_argument(
        "--judge-api-key",
        default=os.environ.get("HINDSIGHT_JUDGE_API_KEY"),
        help="the judge's Bearer key (default: $HINDSIGHT_JUDGE_API_KEY)",
    )
    p.add_argument("--votes", type=_positive, default=3, metavar="M", help="votes per step (the request's m)")
    p.add_argument("--concurrency", type=_positive, default=4, help="judge requests in flight at once")
    p.add_argument("--limit", type=_positive, help="only the first N labelled steps (dataset order)")
    p.add_argument(
        "--final-step",
        choices=("marker", "skip"),
        default="marker",
        help="a step nothing followed: judged with the end-of-episode marker as its next state, or skipped (missing)",
    )
    p.add_argument(
        "--cache", type=Path, help="per-step verdict cache (default: next to --json, else .hindsight/judge-eval/)"
    )
    p.add_argument("--json", type=Path, metavar="OUT", help="write every figure as JSON")
    p.add_argument("--html", type=Path, metavar="OUT", help="write one self-contained HTML page with the matrices")
    p.add_argument("--bootstrap", type=_non_negative, default=1000, metavar="N", help="trajectory resamples (0: none)")
    p.add_argument("--seed", type=int, default=0, help="bootstrap seed")
    p.add_argument("--guards", action=argparse.BooleanOptionalAction, default=True, help="measure the guards")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (it is off anyway when not a TTY)")
    p.add_argument("--timeout-s", type=_seconds, default=600.0, help="read timeout of one judge request")
    p.add_argument("--step-deadline-s", type=_seconds, default=900.0, help="retries of one step stop after this")
    return p


def default_cache_path(args: argparse.Namespace) -> Path:
    if args.cache is not None:
        return Path(args.cache)
    if args.json is not None:
        return Path(args.json).with_suffix(".cache.jsonl")
    # One file per dataset, judge and vote count; the per-step keys inside make sharing safe anyway.
    ident = json.dumps([str(Path(args.dataset).resolve()), args.judge_url.rstrip("/"), args.votes])
    return DEFAULT_CACHE_DIR / f"{hashlib.sha256(ident.encode()).hexdigest()[:16]}.jsonl"


def _source(
    name: str, steps: list[LabelledStep], verdicts: dict[tuple[int, int], Verdict], args: argparse.Namespace
) -> SourceReport:
    intervals = bootstrap_intervals(steps, verdicts, resamples=args.bootstrap, seed=args.seed)
    return SourceReport(
        name=name,
        scores=score(steps, verdicts),
        macro_f1_ci=intervals[0] if intervals else None,
        kappa_ci=intervals[1] if intervals else None,
    )


def _run_judge(steps: list[LabelledStep], args: argparse.Namespace) -> RunResult:
    target = JudgeTarget(
        url=args.judge_url.rstrip("/"),
        api_key=args.judge_api_key,
        m=args.votes,
        final_step=args.final_step,
        concurrency=args.concurrency,
        read_timeout_s=args.timeout_s,
        step_deadline_s=args.step_deadline_s,
    )
    progress = sys.stderr.isatty() and not args.no_progress
    return asyncio.run(judge_steps(steps, target, default_cache_path(args), progress=progress))


def evaluate(args: argparse.Namespace) -> EvalReport:
    steps = load_dataset(args.dataset)
    if args.limit is not None:
        steps = steps[: args.limit]
    sources = [_source(BASE_RATE, steps, constant_verdicts(steps, 1), args)]
    if args.guards:
        sources.append(_source(GUARDS_SOURCE, steps, dict(guard_verdicts(steps)), args))
    for path in args.predictions:
        predictions = load_predictions(path)
        sources.append(_source(predictions.name, steps, dict(predictions.labels), args))
    judge = None
    if args.judge_url:
        run = _run_judge(steps, args)
        verdicts: dict[tuple[int, int], Verdict] = {v.key: v.score for v in run.verdicts}
        name = f"judge {run.info.backend or args.judge_url} m={args.votes}"
        source = _source(name, steps, verdicts, args)
        statuses = Counter(v.status for v in run.verdicts)
        sources.append(SourceReport(source.name, source.scores, source.macro_f1_ci, source.kappa_ci, dict(statuses)))
        judge = JudgeSummary(
            url=args.judge_url,
            m=args.votes,
            backend=run.info.backend,
            prompt_versions=run.info.prompt_versions,
            final_step=run.final_step_marker,
            sent=run.sent,
            from_cache=run.from_cache,
            wall_s=run.wall_s,
            cache_path=str(run.cache_path),
        )
    return EvalReport(
        dataset=str(args.dataset),
        steps=len(steps),
        trajectories=len({s.trajectory_id for s in steps}),
        sources=tuple(sources),
        guard_rules=tuple(measure_guards(steps)) if args.guards else (),
        judge=judge,
        bootstrap_resamples=args.bootstrap,
        seed=args.seed,
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.judge_url is not None and not args.judge_url.startswith(("http://", "https://")):
        parser.error(f"--judge-url must be an http(s) URL, got {args.judge_url!r}")
    try:
        if args.judge_args is not None:
            with local_judge(args.judge_args, args.judge_api_key) as url:
                args.judge_url = url
                report = evaluate(args)
        else:
            report = evaluate(args)
    except DatasetError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 2
    except EvalRunError as exc:
        print(f"{PROG}: error: {exc}", file=sys.stderr)
        return 1
    print(format_table(report))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(to_json(report), indent=2) + "\n", encoding="utf-8")
        print(f"wrote {args.json}")
    if args.html is not None:
        args.html.parent.mkdir(parents=True, exist_ok=True)
        args.html.write_text(render_html(report), encoding="utf-8")
        print(f"wrote {args.html}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
