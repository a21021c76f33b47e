"""The run report as one self-contained HTML page (inline SVG plots, inline CSS, no script, no link).

Contract: ``render(data) -> str``; every plot is a ``<figure class="plot" data-plot=NAME>`` holding one
``<svg>`` (``PLOTS`` lists the names in page order) and a caption saying what it shows and where it comes
from. A plot without data still renders, saying "no data in this run"; notes about missing inputs are
listed at the top.
"""

from __future__ import annotations

import time
from html import escape
from typing import Any

from trainer.report import data as d
from trainer.report.svg import bar_chart, line_chart

PLOTS = (
    "reward_per_step",
    "reward_per_version",
    "verdicts_per_version",
    "judge_feedback_agreement",
    "samples_per_mode",
    "samples_per_status",
    "judge_votes_per_turn",
    "judge_tokens_per_turn",
    "ppo_loss",
    "ppo_clip_kl",
    "ppo_entropy_grad",
    "ppo_advantages",
    "trainer_throughput",
    "trainer_tokens_per_turn",
    "version_timeline",
    "version_session_reward",
)

CSS = (
    "body{font-family:sans-serif;margin:24px;color:#222;max-width:1200px}"
    "h1{font-size:22px}h2{font-size:17px;border-bottom:1px solid #ccc;padding-bottom:4px;margin-top:28px}"
    ".grid{display:flex;flex-wrap:wrap;gap:16px}figure.plot{margin:0;width:560px}"
    "figcaption{font-size:12px;color:#555;margin-top:2px}table{border-collapse:collapse;font-size:13px}"
    "td,th{border:1px solid #ddd;padding:3px 8px;text-align:left}.note{color:#a60}"
)


def _figure(name: str, svg: str, caption: str) -> str:
    return f'<figure class="plot" data-plot="{name}">{svg}<figcaption>{escape(caption)}</figcaption></figure>'


def _plots(data: d.RunData) -> dict[str, str]:
    rows, steps = data.rows, data.steps
    versions, verdicts = d.verdict_mix_by_version(rows)
    by_version = d.reward_by_version(rows)
    modes, statuses = d.mode_counts(rows), d.status_counts(rows)
    vote_sizes, votes = d.votes_per_turn(rows)
    token_tasks, tokens = d.judge_tokens_per_turn(data.judge_metrics)
    ordered = sorted(by_version, key=d.version_key)
    agreement = d.agreement_series(data.feedback)
    ledger_order = [v["version"] for v in sorted(data.versions, key=lambda v: v["created_at"])]
    states = {v["version"]: v["state"] for v in data.versions}
    reward_versions, reward_series = d.session_reward_intervals(rows, ledger_order)
    return {
        "version_timeline": _figure(
            "version_timeline",
            line_chart("Weight version timeline", d.version_timeline(data.versions, time.time()), x_label="minutes"),
            "Each version of the ledger (GET /admin/weights) from when it was pushed to its last state change "
            "(still running: live or canary); the legend names its state now.",
        ),
        "version_session_reward": _figure(
            "version_session_reward",
            line_chart(
                "Per-session reward by version, always-valid interval",
                reward_series,
                x_label="version #: "
                + ", ".join(f"{i}={v} ({states.get(v, '?')})" for i, v in enumerate(reward_versions))[:90],
            ),
            "Mean judge reward per session of each version with the canary test's confidence sequence "
            "(engine.sequential): canary vs live is the gap between two versions' bands. "
            + (
                f"Canary now: canary - live in [{data.comparison['diff']['lo']:.3f}, {data.comparison['diff']['hi']:.3f}], "
                f"decision {data.comparison['decision']}."
                if data.comparison
                else "No canary now."
            ),
        ),
        "reward_per_step": _figure(
            "reward_per_step",
            line_chart("Mean reward per trained step", d.step_series(steps, "reward_mean")),
            "metrics.jsonl reward_mean: the PRM reward averaged over the step's samples that carry one.",
        ),
        "reward_per_version": _figure(
            "reward_per_version",
            line_chart(
                "Mean reward per weight version",
                {"reward_mean": [(float(i), by_version[v][0]) for i, v in enumerate(ordered)]},
                x_label="weight version #: "
                + ", ".join(f"{i}={v} (n={by_version[v][1]})" for i, v in enumerate(ordered))[:90],
            ),
            "Samples' reward grouped by the weight version that sampled them (version N = the policy after step N).",
        ),
        "verdicts_per_version": _figure(
            "verdicts_per_version",
            bar_chart("Judge verdict mix per weight version", versions, verdicts, x_label="weight version"),
            "PRM verdict of each stored sample: +1/0/-1 (ok), tie, no_valid_votes, judge_failed, abstained, "
            "quarantined, or none.",
        ),
        "judge_feedback_agreement": _figure(
            "judge_feedback_agreement",
            line_chart(
                f"Judge/feedback agreement (latest {d.AGREEMENT_WINDOW} pairs)",
                {"agreement": agreement},
                x_label="minutes since the first feedback",
            ),
            "Share of judged turns whose /v1/feedback value has the judge verdict's sign (+1/0/-1), over the "
            f"latest {d.AGREEMENT_WINDOW} such turns, after each feedback (GET /admin/feedback); "
            + (f"now {agreement[-1][1]:.3f}." if agreement else "no pair in this run."),
        ),
        "samples_per_mode": _figure(
            "samples_per_mode",
            bar_chart("Samples per reward mode", list(modes), {"samples": [float(v) for v in modes.values()]}),
            "Stored samples by the mode that produced them (rl, opd, combine).",
        ),
        "samples_per_status": _figure(
            "samples_per_status",
            bar_chart(
                "Samples per status and reject reason",
                list(statuses),
                {"samples": [float(v) for v in statuses.values()]},
            ),
            "Every stored sample by status; rejected ones by reject reason.",
        ),
        "judge_votes_per_turn": _figure(
            "judge_votes_per_turn",
            bar_chart("Judge votes per turn", vote_sizes, votes, x_label="votes drawn"),
            "Turns by the number of votes the judge drew (len(votes) of each verdict).",
        ),
        "judge_tokens_per_turn": _figure(
            "judge_tokens_per_turn",
            bar_chart("Judge tokens per turn (mean)", token_tasks, tokens, x_label="task"),
            "The judge's hindsight_judge_tokens_per_turn histogram (_sum / _count) by task and kind.",
        ),
        "ppo_loss": _figure(
            "ppo_loss",
            line_chart("PPO loss", d.step_series(steps, "loss", "pg_loss")),
            "metrics.jsonl loss and pg_loss per step.",
        ),
        "ppo_clip_kl": _figure(
            "ppo_clip_kl",
            line_chart(
                "Clip fraction and KL",
                d.step_series(steps, "clip_frac", "approx_kl", "ref_kl", "rollout_is_over_cap_frac"),
            ),
            "clip_frac, approx_kl (to the old policy), ref_kl (with --kl-coef), share of tokens over the IS cap.",
        ),
        "ppo_entropy_grad": _figure(
            "ppo_entropy_grad",
            line_chart("Entropy and gradient norm", d.step_series(steps, "entropy", "grad_norm")),
            "Per-token entropy and the pre-clip gradient norm.",
        ),
        "ppo_advantages": _figure(
            "ppo_advantages",
            line_chart("Advantages", d.step_series(steps, "adv_mean", "adv_abs_mean", "train_rollout_lp_abs_diff")),
            "Advantage mean and mean |A| after shaping; mean |recomputed - rollout| log-prob gap.",
        ),
        "trainer_throughput": _figure(
            "trainer_throughput",
            line_chart("Trainer throughput", d.step_series(steps, "tokens_per_s", "n_trained_samples", "step_time_s")),
            "Tokens per second, samples trained per step, step time.",
        ),
        "trainer_tokens_per_turn": _figure(
            "trainer_tokens_per_turn",
            line_chart(
                "Trainer tokens per trained turn",
                d.step_series(steps, "forward_tokens_per_turn", "separate_tokens_per_turn"),
            ),
            "Tokens the forward pass runs per turn, next to prompt + response per turn run separately "
            "(merged trajectories, the default, run a session's shared prompt once; --no-merge-trajectories turns it off).",
        ),
    }


def _summary(data: d.RunData) -> str:
    cfg = data.config
    items: list[tuple[str, Any]] = [("trainer out dir", str(data.out_dir)), ("steps logged", len(data.steps))]
    if data.steps:
        items.append(("last step", data.steps[-1]["step"]))
        items.append(("samples set aside as stale", sum(int(st.get("n_stale", 0)) for st in data.steps)))
    items.append(("skipped steps (no gradient)", data.skipped_steps))
    for key in ("advantage_mode", "batch_size", "lr", "kl_coef", "rollout_correction", "world_size"):
        if key in cfg:
            items.append((key, cfg[key]))
    if data.stats:
        items += [
            ("samples by status", data.stats.get("samples")),
            ("reject reasons", data.stats.get("reject_reasons")),
            ("policy weight version", data.stats.get("weight_version")),
            ("weight updates", data.stats.get("weight_updates")),
        ]
        if data.stats.get("feedback"):  # explicit feedback by state (late: arrived after its sample was leased)
            items.append(("explicit feedback", data.stats["feedback"]))
    agreement = d.agreement_series(data.feedback)
    if agreement:
        items.append(("judge/feedback agreement", f"{agreement[-1][1]:.3f} (latest {d.AGREEMENT_WINDOW} pairs)"))
    items.append(("samples read", len(data.rows)))
    body = "".join(f"<tr><th>{escape(k)}</th><td>{escape(str(v))}</td></tr>" for k, v in items)
    notes = "".join(f'<p class="note">{escape(n)}</p>' for n in data.notes)
    return f"<table>{body}</table>{notes}"


def render(data: d.RunData) -> str:
    plots = _plots(data)
    sections = [
        ("Reward and verdicts", PLOTS[:4]),
        ("Samples", PLOTS[4:6]),
        ("Judge cost", PLOTS[6:8]),
        ("PPO", PLOTS[8:14]),
        ("Weight versions", PLOTS[14:]),
    ]
    body = "".join(
        f'<h2>{escape(title)}</h2><div class="grid">{"".join(plots[n] for n in names)}</div>'
        for title, names in sections
    )
    stamp = time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime())
    return (
        f'<!DOCTYPE html><html lang="en"><head><meta charset="utf-8"><title>Hindsight run report</title>'
        f"<style>{CSS}</style></head><body><h1>Hindsight run report</h1><p>generated {stamp}</p>"
        f"{_summary(data)}{body}</body></html>\n"
    )
