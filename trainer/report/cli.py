"""``hindsight-report``: write the run report of a trainer out dir as one self-contained HTML file.

    HINDSIGHT_POLICY_ADMIN_API_KEY=K hindsight-report RUN_DIR [--policy-url URL] [--judge-url URL] [--out FILE]

RUN_DIR is the trainer's ``--out-dir`` (metrics.jsonl, config.json). With ``--policy-url`` the stored
samples are read through the admin API (non-consuming) for the verdict, mode, status and vote plots;
with ``--judge-url`` the judge's /metrics gives tokens per turn. The admin key is never a flag: it comes
from ``HINDSIGHT_POLICY_ADMIN_API_KEY`` (or ``HINDSIGHT_REPORT_ADMIN_API_KEY``, or a ``--config`` file).
The command line comes from ReportSettings (engine.cli_settings). Prints the path written (default
``RUN_DIR/report.html``); exit 2 on bad arguments, 1 when a given service cannot be read.
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Annotated

import httpx
from pydantic import AliasChoices, Field, field_validator
from pydantic_settings import SettingsConfigDict

from engine.cli_settings import CliSettings, EnvOnly, Positional, parse_cli
from engine.http_client import CallError
from trainer.report.data import collect
from trainer.report.page import render

PROG = "hindsight-report"
DESCRIPTION = "Write the run report of a trainer out dir as one self-contained HTML file."


class ReportSettings(CliSettings):
    """What the report reads and where it writes."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_REPORT_", extra="ignore", validate_by_name=True)

    run_dir: Annotated[Path, Positional()] = Field(..., description="the trainer's --out-dir")
    policy_url: str | None = Field(None, description="policy server base URL (admin API) for sample plots")
    # The policy server's own variable is accepted, so one exported key serves the server and the report.
    admin_api_key: Annotated[str | None, EnvOnly()] = Field(
        None,
        validation_alias=AliasChoices("HINDSIGHT_REPORT_ADMIN_API_KEY", "HINDSIGHT_POLICY_ADMIN_API_KEY"),
        description="policy server admin bearer key: HINDSIGHT_POLICY_ADMIN_API_KEY or HINDSIGHT_REPORT_ADMIN_API_KEY",
    )
    judge_url: str | None = Field(None, description="judge server base URL, for judge tokens per turn")
    out: Path | None = Field(None, description="output HTML file (default: RUN_DIR/report.html)")

    @field_validator("run_dir")
    @classmethod
    def _is_dir(cls, v: Path) -> Path:
        if not v.is_dir():
            raise ValueError(f"{v} is not a directory")
        return v


def write_report(
    out_dir: Path,
    out_file: Path | None = None,
    *,
    policy_url: str | None = None,
    admin_api_key: str | None = None,
    judge_url: str | None = None,
) -> Path:
    """Collect, render and write atomically; returns the file written."""
    target = out_file or out_dir / "report.html"
    html = render(collect(out_dir, policy_url=policy_url, admin_api_key=admin_api_key, judge_url=judge_url))
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".tmp")
    tmp.write_text(html, encoding="utf-8")
    tmp.replace(target)
    return target


def main(argv: list[str] | None = None) -> int:
    args = parse_cli(ReportSettings, argv, prog=PROG, description=DESCRIPTION)
    try:
        path = write_report(
            args.run_dir,
            args.out,
            policy_url=args.policy_url,
            admin_api_key=args.admin_api_key,
            judge_url=args.judge_url,
        )
    except (httpx.HTTPError, CallError) as exc:
        print(f"error: could not read a service for the report: {exc!r}", file=sys.stderr)
        return 1
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
