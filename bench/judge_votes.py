"""Bench: adaptive vs fixed voting on a seeded synthetic vote source, and n-in-one-call vs m calls.

Run:  python -m bench.judge_votes [--turns 20000] [--seed 0] [--unparseable 0.05] [--wrong-skew P] [--no-engine]

Part 1 (pure, seeded): each turn has a true verdict in {1, 0, -1}; each vote is unparseable with probability
``--unparseable`` (0.05), else equals the truth with probability ``agreement``, else is one of the two other
values, uniformly or, with ``--wrong-skew P``, the first of them (order 1, 0, -1) with probability P. The same
per-turn vote stream feeds fixed m=5 (first five votes) and the adaptive policy (as many as it asks for),
through judge_server.voting.run_policy; so does the sequential policy with the judge's default settings
(JudgeSettings: sequential_stop_rule, error_budget_share, the vote-noise tracker's warm-up and window, m_max 9),
with one fresh AgreementTracker per row (so each row includes the warm-up), and the change_prob rule at the default
stop_change_prob for comparison. Printed: mean votes per turn (and the ratio to 5) and the share of turns where
the policy gives the same (score, status) as fixed m=5, and each policy's share of turns with status ok and the
true verdict ("correct"); then the target of the sequential rule: at agreement >= 0.85 at most 0.50x fixed m=5's
votes with at least its correctness, below that at least its correctness at no more votes (PASS/MISS per
agreement and rule). 20000 turns per row (about 20 s): a correctness difference of 0.002 is about 2 standard
errors of the paired difference there, and not resolved at 2000.

Part 2 (one CPU dev engine, tiny model): one judge prompt rendered with the real template, sampled as
ONE /generate with n=m vs m separate n=1 calls, each from a cold prefix cache. Printed: the prompt tokens
the engine reports prefilling (prompt_tokens - cached_tokens; n samples of one call share one prefill in
SGLang; m separate calls each prefill unless the prefix cache catches them: on the dev
engine, whose prefills are serialised, the later ones reuse the first one's KV, so the token ratio is about
1 and the saving shows in the wall clock, i.e. in batched decoding) and the wall-clock ratio. One run.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from judge_server.judge import tracker_for
from judge_server.settings import JudgeSettings
from judge_server.voting import Vote, run_policy


def synthetic_stream(
    rng: random.Random, agreement: float, length: int = 32, unparseable: float = 0.05, wrong_skew: float | None = None
) -> tuple[int, list[int | None]]:
    """One turn: (true verdict, votes). A wrong vote is one of the two other verdicts, uniformly, or with
    ``wrong_skew`` the first of them (in the order 1, 0, -1) with that probability."""
    truth = rng.choice([1, 0, -1])
    others = [v for v in (1, 0, -1) if v != truth]
    out: list[int | None] = []
    for _ in range(length):
        if rng.random() < unparseable:
            out.append(None)
        elif rng.random() < agreement:
            out.append(truth)
        elif wrong_skew is None:
            out.append(rng.choice(others))
        else:
            out.append(others[0] if rng.random() < wrong_skew else others[1])
    return truth, out


async def _score(stream: list[int | None], **kw: object) -> tuple[int | None, str, int]:
    pos = 0

    async def sample(k: int, round_index: int) -> list[Vote]:
        nonlocal pos
        votes = [Vote(v) for v in stream[pos : pos + k]]
        pos += k
        return votes

    r = await run_policy(sample, **kw)  # type: ignore[arg-type]
    return r.score, r.status, len(r.votes)


async def bench_policies(turns: int, seed: int, unparseable: float = 0.05, wrong_skew: float | None = None) -> None:
    print(
        f"# part 1: synthetic votes, {turns} turns per row, seed {seed}, unparseable {unparseable}, "
        f"wrong-vote skew {wrong_skew if wrong_skew is not None else 'none (uniform)'}"
    )
    print(
        f"{'agreement':>9} {'policy':>22} {'votes/turn':>10} {'vs fixed5':>9} {'same as fixed5':>14} "
        f"{'correct':>8} {'fixed5 correct':>14}"
    )
    d = JudgeSettings(backend="rules")
    policies = {
        "adaptive m=5 m_max=9": {"policy": "adaptive", "m": 5, "m_max": 9, "escalate_step": 2},
        "adaptive m=3 m_max=7": {"policy": "adaptive", "m": 3, "m_max": 7, "escalate_step": 2},
    }
    policies[f"sequential {d.sequential_stop_rule}"] = {  # the service default
        "policy": "sequential",
        "m": 5,
        "m_max": 9,
        "escalate_step": d.escalate_step,
        "stop_change_prob": d.stop_change_prob,
        "stop_prior": d.stop_prior,
        "first_round": d.sequential_first_round,
        "stop_rule": d.sequential_stop_rule,
        "error_budget_share": d.error_budget_share,
    }
    policies[f"sequential p<{d.stop_change_prob:.2f}"] = {
        **policies[f"sequential {d.sequential_stop_rule}"],
        "stop_rule": "change_prob",
    }
    verdicts = []
    for agreement in (0.95, 0.85, 0.7, 0.55):
        for label, kw in policies.items():
            rng = random.Random(seed)
            kw = {**kw, "tracker": tracker_for(d, 3)}  # fresh per row: each row starts from the warm-up default
            votes_used = 0
            same = correct = fixed_correct = 0
            for _ in range(turns):
                truth, stream = synthetic_stream(rng, agreement, unparseable=unparseable, wrong_skew=wrong_skew)
                fixed = await _score(stream, policy="fixed", m=5, m_max=5)
                other = await _score(stream, min_valid=1, **kw)
                votes_used += other[2]
                same += (other[0], other[1]) == (fixed[0], fixed[1])
                correct += other[:2] == (truth, "ok")
                fixed_correct += fixed[:2] == (truth, "ok")
            mean = votes_used / turns
            print(
                f"{agreement:>9.2f} {label:>22} {mean:>10.2f} {mean / 5:>9.2f} {same / turns:>14.3f} "
                f"{correct / turns:>8.3f} {fixed_correct / turns:>14.3f}"
            )
            if kw["policy"] == "sequential":
                cap = 0.5 if agreement >= 0.85 else 1.0
                ok = mean / 5 <= cap and correct >= fixed_correct
                verdicts.append(
                    f"{label} agreement {agreement:.2f}: votes {mean / 5:.2f}x (target <= {cap:.2f}x), correct "
                    f"{correct / turns:.3f} vs fixed5 {fixed_correct / turns:.3f} -> {'PASS' if ok else 'MISS'}"
                )
    print(
        f"# sequential targets (m=5, m_max=9, first_round={d.sequential_first_round}, error_budget_share="
        f"{d.error_budget_share}, stop_prior={d.stop_prior})"
    )
    for line in verdicts:
        print(line)


async def bench_engine(m: int) -> None:
    from devkit.tiny_model import build_tiny_model
    from engine.chat import load_tokenizer, render_prompt_ids
    from engine.client import EngineClient
    from prompts import TokenCounter, load_template, render_judge_messages
    from tests.testkit.procs import start_dev_engine

    print(f"\n# part 2: one dev engine (tiny model), m={m} votes of one judge prompt")
    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        tok = load_tokenizer(str(model_dir))
        messages, _ = render_judge_messages(
            load_template(JudgeSettings(backend="rules").prm_template),
            context=[{"role": "user", "content": "Please rename report.txt to summary.txt in ~/docs."}],
            response={"content": "Renamed it.", "tool_calls": [{"function": {"name": "mv", "arguments": "{}"}}]},
            next_state=[{"role": "user", "content": "No, that is the wrong folder; use ~/work."}],
            counter=TokenCounter.from_tokenizer(tok),
            context_budget_tokens=2000,
            part_budget_tokens=1000,
        )
        ids = render_prompt_ids(tok, messages)
        engine = start_dev_engine(model_dir, log_dir=Path(tmp) / "logs")
        try:
            async with EngineClient(engine.url) as client:
                sp = {"temperature": 0.6, "max_new_tokens": 32}
                await client.generate_ids(ids, {**sp, "n": 1}, return_logprob=False)  # warm-up
                await client.flush_cache()  # both sides start cold: the prefix cache would hide the difference
                t0 = time.perf_counter()
                one = await client.generate_ids(ids, {**sp, "n": m}, return_logprob=False)
                t_one = time.perf_counter() - t0
                await client.flush_cache()
                t0 = time.perf_counter()
                sep = await asyncio.gather(
                    *(client.generate_ids(ids, {**sp, "n": 1}, return_logprob=False) for _ in range(m))
                )
                t_sep = time.perf_counter() - t0
        finally:
            engine.stop()
    # one shared prefill for the n samples; the m concurrent calls arrive together, so none finds another's KV
    prefill_one = (one[0].prompt_tokens or len(ids)) - int(one[0].meta_info.get("cached_tokens") or 0)
    prefill_sep = sum((g[0].prompt_tokens or len(ids)) - int(g[0].meta_info.get("cached_tokens") or 0) for g in sep)
    print(f"prompt length: {len(ids)} tokens")
    print(
        f"prompt tokens prefilled: n-in-one-call {prefill_one}, {m} separate calls {prefill_sep}, "
        f"ratio {prefill_sep / prefill_one:.2f}x"
    )
    print(
        f"wall clock: n-in-one-call {t_one * 1000:.0f} ms, {m} separate calls {t_sep * 1000:.0f} ms, "
        f"ratio {t_sep / t_one:.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--turns", type=int, default=20000)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--m", type=int, default=5)
    p.add_argument("--unparseable", type=float, default=0.05, help="share of unparseable votes")
    p.add_argument(
        "--wrong-skew",
        type=float,
        default=None,
        help="share of wrong votes that go to one fixed other verdict (default: uniform)",
    )
    p.add_argument("--no-engine", action="store_true")
    args = p.parse_args()
    asyncio.run(bench_policies(args.turns, args.seed, args.unparseable, args.wrong_skew))
    if not args.no_engine:
        asyncio.run(bench_engine(args.m))


if __name__ == "__main__":
    main()
