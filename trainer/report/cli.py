"""``hindsight-report``: write the run report of a trainer out dir as one self-contained HTML file.

    hindsight-report RUN_DIR [--policy-url URL --admin-api-key K] [--judge-url URL] [--out FILE]

RUN_DIR is the trainer's ``--out-dir`` (metrics.jsonl, config.json). With ``--policy-url`` the stored
samples are read through the admin API (non-consuming) for the verdict, mode, status and vote plots;
with ``--judge-url`` the judge's /metrics gives tokens per turn. The admin key may come from
``HINDSIGHT_POLICY_ADMIN_API_KEY``. Prints the path written (default ``RUN_DIR/report.html``); exit 2 on
bad arguments, 1 when a given service cannot be read.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import httpx

from engine.http_client import CallError
from trainer.report.data import collect
from trainer.report.page import render


def write_report(out_dir: Path, out_file: Path | None = None, **sources: str | None) -> Path:
    """Collect, render and write atomically; returns the file written."""
    target = out_file or out_dir / "report.html"
    html = render(collect(out_dir, **sources))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="hindsight-report", description=__doc__.split("\n\n")[0])
    p.add_argument("run_dir", type=Path, help="the trainer's --out-dir")
    p.add_argument("--policy-url", help="policy server base URL (admin API) for sample plots")
    p.add_argument("--admin-api-key", default=os.environ.get("HINDSIGHT_POLICY_ADMIN_API_KEY"))
    p.add_argument("--judge-url", help="judge server base URL, for judge tokens per turn")
    p.add_argument("--out", type=Path, help="output HTML file [RUN_DIR/report.html]")
    args = p.parse_args(argv)
    if not args.run_dir.is_dir():
        p.error(f"{args.run_dir} is not a directory")
    try:
        path = write_report(args.run_dir, args.out, policy_url=args.policy_url, admin_api_key=args.admin_api_key,
                            judge_url=args.judge_url)
    except (httpx.HTTPError, CallError) as exc:
        print(f"error: could not read a service for the report: {exc!r}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
