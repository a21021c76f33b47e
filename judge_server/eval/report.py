"""The figures of ``hindsight-judge-eval`` as a printed table, a JSON document and one self-contained HTML page.

Contract:
- :class:`EvalReport` holds everything reported: per source (the always-+1 base rate, the guards, prediction
  files, a judge run) its :class:`~judge_server.eval.metrics.Scores`, bootstrap intervals and verdict status
  tally; the guard rules' measurement; the judge's identity when one was run.
- :func:`format_table` is the terminal text; :func:`to_json` a JSON-ready dict (every figure, the confusion
  matrices, the guard table); :func:`render_html` one HTML page with the tables and, per source, its confusion
  matrix (gold rows 1/0/-1, predicted columns 1/0/-1/missing) drawn by matplotlib (Agg, no pyplot state) and
  inlined as SVG, so the file needs nothing else.
"""

from __future__ import annotations

import html
import io
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from engine.records import Interval
from judge_server.eval.guard_stats import RuleStats, implied_default
from judge_server.eval.metrics import GOLD_LABELS, PREDICTED_COLUMNS, Scores
from judge_server.guards import DEFAULT_GUARD_ACTIONS


@dataclass(frozen=True)
class SourceReport:
    name: str
    scores: Scores
    macro_f1_ci: Interval | None = None
    kappa_ci: Interval | None = None
    statuses: Mapping[str, int] = field(default_factory=dict)  # verdict statuses of a judge run


@dataclass(frozen=True)
class JudgeSummary:
    """A judge run's identity and cost, printed with its figures."""

    url: str
    m: int
    backend: str | None
    prompt_versions: Mapping[str, str]
    final_step: str  # the end-of-episode marker's template version, or "skip"
    sent: int
    from_cache: int
    wall_s: float
    cache_path: str


@dataclass(frozen=True)
class EvalReport:
    dataset: str
    steps: int
    trajectories: int
    sources: tuple[SourceReport, ...]
    guard_rules: tuple[RuleStats, ...] = ()
    judge: JudgeSummary | None = None
    bootstrap_resamples: int = 0
    seed: int = 0


def _f(x: float | None) -> str:
    return "-" if x is None else f"{x:.3f}"


def _ci(value: float, ci: Interval | None) -> str:
    return f"{value:.3f}" + (f" [{ci.lo:.3f}, {ci.hi:.3f}]" if ci else "")


def _main_rows(report: EvalReport) -> list[list[str]]:
    return [
        [
            s.name,
            str(s.scores.steps),
            f"{s.scores.accuracy:.3f}",
            _ci(s.scores.macro_f1, s.macro_f1_ci),
            f"{s.scores.f1_bad:.3f}",
            _ci(s.scores.kappa, s.kappa_ci),
            f"{s.scores.first_error_accuracy:.3f}",
            str(s.scores.missing),
        ]
        for s in report.sources
    ]


MAIN_HEADER = ["source", "steps", "acc", "macro-F1 [95% CI]", "F1(-1)", "kappa [95% CI]", "first-err acc", "missing"]
CLASS_HEADER = ["source", *(f"{k}({c:+d})" if c else f"{k}(0)" for c in GOLD_LABELS for k in ("P", "R", "F1"))]
GUARD_HEADER = [
    *("rule", "action", "readable", "fired", "on +1", "on 0", "on -1"),
    *("-1 precision", "-1 recall", "implied", "default"),
]


def _class_rows(report: EvalReport) -> list[list[str]]:
    return [
        [s.name, *(_f(getattr(s.scores.classes[c], k)) for c in GOLD_LABELS for k in ("precision", "recall", "f1"))]
        for s in report.sources
    ]


def _guard_rows(report: EvalReport) -> list[list[str]]:
    return [
        [
            r.rule,
            r.natural_action,
            str(r.decidable),
            str(r.fired),
            str(r.fired_good),
            str(r.fired_neutral),
            str(r.fired_bad),
            _f(r.bad_precision),
            _f(r.bad_recall),
            implied_default(r),
            DEFAULT_GUARD_ACTIONS[r.rule],
        ]
        for r in report.guard_rules
    ]


def _text_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    widths = [max(len(row[i]) for row in [header, *rows]) for i in range(len(header))]
    lines = [
        "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths, strict=True)))
        for row in [header, *rows]
    ]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


def _judge_lines(judge: JudgeSummary) -> list[str]:
    versions = ", ".join(f"{k}={v}" for k, v in sorted(judge.prompt_versions.items())) or "unknown (no key?)"
    per_step = judge.wall_s / judge.sent if judge.sent else 0.0
    return [
        (
            f"judge {judge.url}: backend {judge.backend or 'unknown'}, prompt versions {versions}, m={judge.m}, "
            f"final step {judge.final_step}"
        ),
        (
            f"judge run: {judge.sent} steps sent, {judge.from_cache} from the cache ({judge.cache_path}), "
            f"{judge.wall_s:.1f} s wall, {per_step:.2f} s per sent step"
        ),
    ]


def format_table(report: EvalReport) -> str:
    parts = [f"{report.dataset}: {report.steps} labelled steps in {report.trajectories} trajectories"]
    if report.judge is not None:
        parts += _judge_lines(report.judge)
    parts += ["", _text_table(MAIN_HEADER, _main_rows(report)), "", _text_table(CLASS_HEADER, _class_rows(report))]
    tallies = [
        f"{s.name}: " + ", ".join(f"{k} {v}" for k, v in sorted(s.statuses.items()))
        for s in report.sources
        if s.statuses
    ]
    if tallies:
        parts += ["", "verdict statuses: " + "; ".join(tallies)]
    if report.guard_rules:
        parts += ["", "guards, measured on the labelled steps:", _text_table(GUARD_HEADER, _guard_rows(report))]
    return "\n".join(parts)


def _interval(ci: Interval | None) -> list[float] | None:
    return [ci.lo, ci.hi] if ci else None


def to_json(report: EvalReport) -> dict[str, Any]:
    sources = [
        {
            "name": s.name,
            "steps": s.scores.steps,
            "trajectories": s.scores.trajectories,
            "accuracy": s.scores.accuracy,
            "macro_f1": s.scores.macro_f1,
            "macro_f1_ci95": _interval(s.macro_f1_ci),
            "f1_bad": s.scores.f1_bad,
            "kappa": s.scores.kappa,
            "kappa_ci95": _interval(s.kappa_ci),
            "first_error_accuracy": s.scores.first_error_accuracy,
            "missing": s.scores.missing,
            "classes": {
                str(c): {"precision": v.precision, "recall": v.recall, "f1": v.f1, "support": v.support}
                for c, v in s.scores.classes.items()
            },
            "confusion": {
                "rows_gold": list(GOLD_LABELS),
                "columns_predicted": list(PREDICTED_COLUMNS),
                "counts": [list(r) for r in s.scores.confusion],
            },
            "statuses": dict(s.statuses),
        }
        for s in report.sources
    ]
    guards = [
        {
            "rule": r.rule,
            "natural_action": r.natural_action,
            "decidable": r.decidable,
            "fired": r.fired,
            "fired_on": {"1": r.fired_good, "0": r.fired_neutral, "-1": r.fired_bad},
            "bad_precision": r.bad_precision,
            "bad_recall": r.bad_recall,
            "implied_default": implied_default(r),
            "default": DEFAULT_GUARD_ACTIONS[r.rule],
        }
        for r in report.guard_rules
    ]
    judge = None
    if report.judge is not None:
        j = report.judge
        judge = {
            "url": j.url,
            "m": j.m,
            "backend": j.backend,
            "prompt_versions": dict(j.prompt_versions),
            "final_step": j.final_step,
            "sent": j.sent,
            "from_cache": j.from_cache,
            "wall_s": j.wall_s,
            "cache_path": j.cache_path,
        }
    return {
        "dataset": report.dataset,
        "steps": report.steps,
        "trajectories": report.trajectories,
        "bootstrap": {"resamples": report.bootstrap_resamples, "seed": report.seed, "unit": "trajectory"},
        "judge": judge,
        "sources": sources,
        "guards": guards,
    }


def confusion_svg(source: SourceReport) -> str:
    """The source's 3 x 4 confusion matrix as an inline ``<svg>`` element (counts, shaded by row share)."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    counts = source.scores.confusion
    # A bare Figure on the Agg canvas: no pyplot, no global backend switch, nothing needs a display.
    fig = Figure(figsize=(4.2, 3.2))
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    shares = [[c / max(1, sum(row)) for c in row] for row in counts]
    ax.imshow(shares, cmap="Blues", vmin=0.0, vmax=1.0)
    for i, row in enumerate(counts):
        for j, count in enumerate(row):
            ax.text(j, i, str(count), ha="center", va="center", color="white" if shares[i][j] > 0.6 else "black")
    ax.set_xticks(range(len(PREDICTED_COLUMNS)), list(PREDICTED_COLUMNS))
    ax.set_yticks(range(len(GOLD_LABELS)), [str(c) for c in GOLD_LABELS])
    ax.set_xlabel("predicted")
    ax.set_ylabel("gold")
    ax.set_title(source.name, fontsize=9)
    fig.tight_layout()
    buf = io.StringIO()
    # Text stays text (searchable, small); a fixed hash salt keeps the SVG ids the same run to run.
    with matplotlib.rc_context({"svg.fonttype": "none", "svg.hashsalt": "hindsight"}):
        fig.savefig(buf, format="svg")
    svg = buf.getvalue()
    return svg[svg.index("<svg") :]


def _html_table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{html.escape(c)}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html(report: EvalReport) -> str:
    parts = [
        "<!DOCTYPE html><html><head><meta charset='utf-8'><title>hindsight-judge-eval</title>",
        (
            "<style>body{font-family:sans-serif;margin:2em}table{border-collapse:collapse;margin:1em 0}"
            "td,th{border:1px solid #ccc;padding:2px 8px;text-align:right}td:first-child{text-align:left}"
            ".matrices{display:flex;flex-wrap:wrap;gap:1em}</style></head><body>"
        ),
        f"<h1>Judge evaluation: {html.escape(report.dataset)}</h1>",
        (
            f"<p>{report.steps} labelled steps in {report.trajectories} trajectories; bootstrap: "
            f"{report.bootstrap_resamples} trajectory resamples, seed {report.seed}.</p>"
        ),
    ]
    if report.judge is not None:
        parts += [f"<p>{html.escape(line)}</p>" for line in _judge_lines(report.judge)]
    parts += ["<h2>Figures</h2>", _html_table(MAIN_HEADER, _main_rows(report))]
    parts += ["<h2>Per class</h2>", _html_table(CLASS_HEADER, _class_rows(report))]
    if report.guard_rules:
        parts += ["<h2>Guards</h2>", _html_table(GUARD_HEADER, _guard_rows(report))]
    parts += ["<h2>Confusion matrices</h2><div class='matrices'>"]
    parts += [f"<figure class='confusion'>{confusion_svg(s)}</figure>" for s in report.sources]
    parts += ["</div></body></html>"]
    return "\n".join(parts)
