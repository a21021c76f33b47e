"""The run report (trainer/report/, ``hindsight-report``).

Contract: the summaries are pure functions of the stored sample rows / metrics.jsonl / the judge's
/metrics text (hand-counted cases below); the page is one self-contained HTML file whose every plot
(``page.PLOTS``) renders in headless Chromium: a non-blank screenshot per plot and no console error.
The demo run's report is checked the same way in test_dev_stack.py.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.testkit.chromium import check_rendered, inspect_page, require_chromium
from trainer.report import data as d
from trainer.report.cli import main as report_main
from trainer.report.page import PLOTS


def row(
    status: str,
    *,
    version: str = "default",
    mode: str = "rl",
    prm: dict | None = None,
    hint: dict | None = None,
    reason: str | None = None,
    reward: float | None = None,
) -> dict:
    sample = {
        "mode": mode,
        "weight_version": version,
        "prm": prm,
        "hint": hint,
        "reward": reward,
        "has_reward": reward is not None,
    }
    return {"status": status, "reject_reason": reason, "sample": sample}


ROWS = [
    row("ready", prm={"status": "ok", "score": 1, "votes": [1, 1, -1]}, reward=1.0),
    row("consumed", prm={"status": "ok", "score": -1, "votes": [-1, -1, None]}, reward=-1.0),
    row("rejected", prm={"status": "tie", "score": None, "votes": [1, -1]}, reason="tie"),
    row("rejected", prm=None, reason="no_next_state"),
    row(
        "ready",
        version="1",
        mode="opd",
        prm={"status": "ok", "score": 1, "votes": [1]},
        hint={"status": "ok", "accepted": True, "votes": [1, 1, 1]},
        reward=1.0,
    ),
    row(
        "rejected",
        version="1",
        prm={"status": "judge_failed", "score": None, "votes": []},
        reason="prm_rejected: too long",
    ),
    {"status": "pending_judge", "reject_reason": None, "sample": None},
]


@pytest.mark.unit
def test_guard_statuses_are_verdict_classes_of_their_own() -> None:
    """A guard's verdict without a score is drawn as its status, never lumped into "no verdict"."""
    quarantined = row("rejected", prm={"status": "quarantined", "score": None}, reason="degenerate: truncated: cut")
    abstained = row("rejected", prm={"status": "abstained", "score": None}, reason="prm_abstained: tool_error")
    assert [d.verdict_class(r) for r in (quarantined, abstained)] == ["quarantined", "abstained"]
    _, mix = d.verdict_mix_by_version([quarantined, abstained, quarantined])
    assert mix == {"abstained": [1.0], "quarantined": [2.0]}


@pytest.mark.unit
def test_summaries_hand_counted() -> None:
    assert [d.verdict_class(r) for r in ROWS] == ["+1", "-1", "tie", "no verdict", "+1", "judge_failed", "no verdict"]
    versions, mix = d.verdict_mix_by_version(ROWS)
    assert versions == ["default", "1", "unknown"]
    assert mix == {
        "+1": [1.0, 1.0, 0.0],
        "-1": [1.0, 0.0, 0.0],
        "tie": [1.0, 0.0, 0.0],
        "judge_failed": [0.0, 1.0, 0.0],
        "no verdict": [1.0, 0.0, 1.0],
    }
    assert d.reward_by_version(ROWS) == {"default": (0.0, 2), "1": (1.0, 1)}
    assert d.mode_counts(ROWS) == {"not judged": 1, "opd": 1, "rl": 5}
    assert d.status_counts(ROWS) == {
        "consumed": 1,
        "pending_judge": 1,
        "ready": 2,
        "rejected: no_next_state": 1,
        "rejected: prm_rejected": 1,
        "rejected: tie": 1,
    }
    sizes, votes = d.votes_per_turn(ROWS)
    assert sizes == ["0", "1", "2", "3"]
    assert votes == {"prm": [1.0, 1.0, 1.0, 2.0], "hint": [0.0, 0.0, 0.0, 1.0]}


@pytest.mark.unit
def test_judge_tokens_from_metrics_text_and_later_step_wins(tmp_path: Path) -> None:
    text = "\n".join(
        [
            "# TYPE hindsight_judge_tokens_per_turn histogram",
            'hindsight_judge_tokens_per_turn_bucket{kind="prompt",task="prm",le="+Inf"} 4.0',
            'hindsight_judge_tokens_per_turn_sum{kind="prompt",task="prm"} 1000.0',
            'hindsight_judge_tokens_per_turn_count{kind="prompt",task="prm"} 4.0',
            'hindsight_judge_tokens_per_turn_bucket{kind="completion",task="prm",le="+Inf"} 4.0',
            'hindsight_judge_tokens_per_turn_sum{kind="completion",task="prm"} 120.0',
            'hindsight_judge_tokens_per_turn_count{kind="completion",task="prm"} 4.0',
            'hindsight_judge_tokens_per_turn_bucket{kind="prompt",task="hint",le="+Inf"} 2.0',
            'hindsight_judge_tokens_per_turn_sum{kind="prompt",task="hint"} 300.0',
            'hindsight_judge_tokens_per_turn_count{kind="prompt",task="hint"} 2.0',
            "",
        ]
    )
    assert d.judge_tokens_per_turn(text) == (["hint", "prm"], {"prompt": [150.0, 250.0], "completion": [0.0, 30.0]})
    cached = text + "\n".join(
        [  # cached tokens are part of the prompt tokens: stacked as prefilled + cached
            'hindsight_judge_tokens_per_turn_bucket{kind="cached",task="prm",le="+Inf"} 4.0',
            'hindsight_judge_tokens_per_turn_sum{kind="cached",task="prm"} 800.0',
            'hindsight_judge_tokens_per_turn_count{kind="cached",task="prm"} 4.0',
            "",
        ]
    )
    assert d.judge_tokens_per_turn(cached) == (
        ["hint", "prm"],
        {"prefilled": [150.0, 50.0], "cached": [0.0, 200.0], "completion": [0.0, 30.0]},
    )
    assert d.judge_tokens_per_turn("# nothing\n") == ([], {})
    (tmp_path / "metrics.jsonl").write_text('{"step": 1, "loss": 3}\n{"step": 2, "loss": 2}\n{"step": 2, "loss": 1}\n')
    assert d.read_steps(tmp_path) == [{"step": 1, "loss": 3}, {"step": 2, "loss": 1}]


def synthetic_run(tmp_path: Path) -> Path:
    out = tmp_path / "run"
    out.mkdir()
    lines = [
        {
            "step": s,
            "loss": 1.0 / s,
            "pg_loss": 0.5 / s,
            "reward_mean": 0.1 * s,
            "clip_frac": 0.05,
            "approx_kl": 0.01 * s,
            "entropy": 3.0,
            "grad_norm": 1.0,
            "adv_mean": 0.0,
            "adv_abs_mean": 0.4,
            "tokens_per_s": 50.0 + s,
            "n_trained_samples": 4,
            "step_time_s": 2.0,
            "forward_tokens_per_turn": 300.0,
            "separate_tokens_per_turn": 900.0,
        }
        for s in (1, 2, 3)
    ]
    (out / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
    return out


@pytest.mark.unit
def test_cli_writes_a_self_contained_page(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = synthetic_run(tmp_path)
    assert report_main([str(out)]) == 0
    html = (out / "report.html").read_text()
    assert capsys.readouterr().out.strip() == str(out / "report.html")
    assert [html.count(f'data-plot="{n}"') for n in PLOTS] == [1] * len(PLOTS)
    for external in ("<script", "src=", "href=", "@import", "url("):
        assert external not in html, external
    assert "no --policy-url" in html  # the missing input is said, not hidden
    with pytest.raises(SystemExit) as exc:
        report_main([str(tmp_path / "missing")])
    assert exc.value.code == 2


@pytest.mark.unit
def test_skipped_steps_and_stale_samples_are_shown(tmp_path: Path) -> None:
    out = synthetic_run(tmp_path)
    with open(out / "metrics.jsonl", "a") as f:  # a later line for step 3 wins: it set 2 samples aside as stale
        f.write(json.dumps({"step": 3, "loss": 0.1, "n_stale": 2}) + "\n")
    (out / "skipped_steps.jsonl").write_text('{"after_step": 1, "n_samples": 1}\n{"after_step": 3, "n_samples": 2}\n')
    assert d.collect(out).skipped_steps == 2
    assert report_main([str(out)]) == 0
    html = (out / "report.html").read_text()
    assert "<th>skipped steps (no gradient)</th><td>2</td>" in html
    assert "<th>samples set aside as stale</th><td>2</td>" in html


@pytest.mark.e2e
def test_report_renders_in_headless_chromium(tmp_path: Path) -> None:
    require_chromium()
    out = synthetic_run(tmp_path)
    assert report_main([str(out)]) == 0
    check_rendered(out / "report.html", ("reward_per_step", "ppo_loss", "ppo_clip_kl", "trainer_throughput"))
    assert inspect_page(out / "report.html").plots["reward_per_step"]["marks"] == 3  # one point per step


@pytest.mark.unit
def test_summary_shows_explicit_feedback_by_state(tmp_path: Path) -> None:
    from trainer.report.page import render

    feedback = {"pending": 1, "applied": 3, "late": 2, "recorded": 0, "total": 6, "policy": "average"}
    html = render(d.RunData(out_dir=tmp_path, stats={"samples": {}, "feedback": feedback}))
    assert "<th>explicit feedback</th>" in html and "&#x27;late&#x27;: 2" in html
    assert "explicit feedback" not in render(d.RunData(out_dir=tmp_path, stats={"samples": {}}))


def fb(sid: str, turn: int, value: float, judge: int | None, at_s: float) -> dict:
    """A GET /admin/feedback row (the fields the agreement reads)."""
    return {
        "feedback_id": f"fb-{sid}-{at_s}",
        "session_id": sid,
        "turn_index": turn,
        "value": value,
        "judge_sign": judge,
        "created_at": 1000.0 + at_s,
    }


FEEDBACK = [  # newest first, as the admin API answers
    fb("c", 0, -1.0, 1, 240.0),  # c changes its mind: disagree now
    fb("d", 0, 1.0, None, 180.0),  # not judged (or no PRM verdict): no pair
    fb("c", 0, 1.0, 1, 120.0),  # agree
    fb("b", 0, 0.0, 0, 60.0),  # neutral against neutral: agree
    fb("a", 0, 0.5, -1, 0.0),  # disagree
]


@pytest.mark.unit
def test_agreement_series_hand_counted() -> None:
    # after a: 0/1; b: 1/2; c (+1, up): 2/3; d: no pair; c again (+1, down), counted once: 1/3
    assert d.agreement_series(FEEDBACK) == [(0.0, 0.0), (1.0, 0.5), (2.0, pytest.approx(2 / 3)), (4.0, 1 / 3)]
    # a window of the 2 latest turns: after c's change, b and c -> 1/2
    assert d.agreement_series(FEEDBACK, window=2)[-1] == (4.0, 0.5)
    assert d.agreement_series([fb("d", 0, 1.0, None, 0.0)]) == []


@pytest.mark.unit
def test_agreement_plot_and_summary(tmp_path: Path) -> None:
    from trainer.report.page import render

    html = render(d.RunData(out_dir=tmp_path, stats={"samples": {}}, feedback=FEEDBACK))
    plot = html.split('data-plot="judge_feedback_agreement"')[1].split("</figure>")[0]
    assert "no data in this run" not in plot and "now 0.333." in plot
    assert "<th>judge/feedback agreement</th><td>0.333 (latest 200 pairs)</td>" in html
    empty = render(d.RunData(out_dir=tmp_path, stats={"samples": {}}))
    plot = empty.split('data-plot="judge_feedback_agreement"')[1].split("</figure>")[0]
    assert "no data in this run" in plot and "no pair in this run." in plot
    assert "judge/feedback agreement</th>" not in empty


@pytest.mark.unit
def test_version_timeline_and_session_reward_intervals_hand_counted() -> None:
    from engine.sequential import interval, rho_for

    versions = [
        {"version": "2", "state": "rolled_back", "created_at": 180.0, "updated_at": 300.0},
        {"version": "1", "state": "live", "created_at": 60.0, "updated_at": 120.0},
    ]
    assert d.version_timeline(versions, now_s=600.0) == {
        "1 (live)": [(0.0, 0.0), (9.0, 0.0)],
        "2 (rolled_back)": [(2.0, 1.0), (4.0, 1.0)],
    }
    ok = {"status": "ok", "score": 1}
    bad = {"status": "ok", "score": -1}
    rows = [
        {**row("ready", version="1", prm=ok), "session_id": "a"},
        {**row("ready", version="1", prm=bad), "session_id": "a"},  # session a: mean 0
        {**row("ready", version="1", prm=ok), "session_id": "b"},  # session b: 1
        {**row("rejected", version="1", prm=None), "session_id": "b"},  # no verdict: not counted
        {**row("ready", version="2", prm=bad), "session_id": "c"},  # session c: -1
        {**row("ready", version="1", prm=ok), "session_id": "m"},  # m mixes versions: not counted
        {**row("ready", version="2", prm=ok), "session_id": "m"},
    ]
    names, series = d.session_reward_intervals(rows, ["1", "2"])
    assert names == ["1", "2"]
    assert [y for _, y in series["mean"]] == [0.5, -1.0]
    rho = rho_for(50, 0.025)
    assert series["lo"][0][1] == interval(d.ArmStats(2, 1.0), 0.025, rho).lo
