"""Bench: judge prefill tokens per turn, shared-prefix layout (v2 + one prefix prefill) vs instructions-first (v1).

Run:  python -m bench.judge_prefix [--context-tokens 2000] [--turns 3]

One CPU dev engine (tiny model, prefix cache on) and the judge core in-process (judge_server.judge.JudgeService
with the judge's real EngineClient and tokenizer). Each turn is a fresh conversation of ``--context-tokens``
tokens (counted by the judge tokenizer), judged with both tasks (m=1, few new tokens: this measures prefill).
Printed per layout: tokens the engine prefilled per turn (usage prompt_tokens - cached_tokens, as the engine
reports them in meta_info) against the sum of both rendered prompts, and the judge wall time per turn; then
the ratios, measured side by side in one run (the engine's cache is flushed between layouts).
"""

from __future__ import annotations

import argparse
import asyncio
import random
import tempfile
import time
from pathlib import Path

from tests.long_context import long_context


def make_turn(rng: random.Random, tok, context_tokens: int, tag: str) -> dict:
    context, _ = long_context(tok, context_tokens, rng, tag)
    return {
        "context": context,
        "response": {"content": "Renamed it."},
        "next_state": [{"role": "user", "content": "No, that is the wrong folder; use ~/work."}],
        "tasks": ["prm", "hint"],
        "m": 1,
    }


async def run_layout(url: str, model_dir: Path, tok, turns: list[dict], *, v2: bool) -> tuple[float, float, float]:
    import httpx

    from engine.client import EngineClient
    from engine.records import STATUS_FAILED
    from judge_server.judge import JudgeService
    from judge_server.metrics import JudgeMetrics
    from judge_server.schemas import JudgeRequest
    from judge_server.settings import JudgeSettings

    settings = JudgeSettings(
        engine_url=url,
        tokenizer_path=str(model_dir),
        max_new_tokens=4,
        m=1,
        context_budget_tokens=4000,
        prm_template="prm_eval_v2" if v2 else "prm_eval_v1",
        hint_template="hint_extract_v2" if v2 else "hint_extract_v1",
        prefill_shared_prefix=v2,
    )
    async with httpx.AsyncClient(trust_env=False, timeout=30) as http:
        (await http.post(f"{url}/flush_cache")).raise_for_status()
    prefilled = whole = wall = 0.0
    async with EngineClient(url) as client:
        service = JudgeService(settings, JudgeMetrics(), client=client, tokenizer=tok)
        for body in turns:
            req = JudgeRequest.model_validate(body)
            whole += sum(len(p["input_ids"]) for p in service.engine_prompts(req).values())
            t0 = time.perf_counter()
            out = await service.judge(req)
            wall += time.perf_counter() - t0
            assert out.prm is not None and out.hint is not None and out.usage is not None, out
            assert out.prm.status != STATUS_FAILED and out.hint.status != STATUS_FAILED, out
            prefilled += out.usage.prompt_tokens - out.usage.cached_tokens
    n = len(turns)
    return prefilled / n, whole / n, wall / n


async def main_async(args: argparse.Namespace) -> None:
    from devkit.tiny_model import build_tiny_model
    from engine.chat import load_tokenizer
    from tests.testkit.procs import start_dev_engine

    with tempfile.TemporaryDirectory() as tmp:
        model_dir = build_tiny_model(Path(tmp) / "tiny", seed=0)
        tok = load_tokenizer(str(model_dir))
        rng = random.Random(args.seed)
        engine = start_dev_engine(model_dir, log_dir=Path(tmp) / "logs")
        try:
            rows = {}
            for v2 in (False, True):  # fresh conversations per layout: no cross-layout cache hits
                turns = [
                    make_turn(rng, tok, args.context_tokens, f"{'v2' if v2 else 'v1'}-{i}") for i in range(args.turns)
                ]
                await run_layout(engine.url, model_dir, tok, turns[:1], v2=v2)  # warm-up (first-call costs)
                rows[v2] = await run_layout(engine.url, model_dir, tok, turns[1:] if len(turns) > 1 else turns, v2=v2)
        finally:
            engine.stop()
    print(
        f"# judge prefill per turn, PRM + hint, context ~{args.context_tokens} tokens, {args.turns} turns, dev engine"
    )
    print(f"{'layout':>34} {'prefilled/turn':>14} {'both prompts':>12} {'share':>6} {'wall ms/turn':>12}")
    for v2, label in ((False, "v1 instructions first"), (True, "v2 turn first + 1 prefix prefill")):
        pre, whole, wall = rows[v2]
        print(f"{label:>34} {pre:>14.0f} {whole:>12.0f} {pre / whole:>6.2f} {wall * 1000:>12.0f}")
    print(
        f"ratio v1/v2 prefilled tokens: {rows[False][0] / rows[True][0]:.2f}x; "
        f"v2 prefills {rows[True][0] / rows[True][1]:.2f} of the sum of both prompts; "
        f"wall time v1/v2: {rows[False][2] / rows[True][2]:.2f}x"
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context-tokens", type=int, default=2000)
    p.add_argument("--turns", type=int, default=3, help="turns per layout; the first is a warm-up")
    p.add_argument("--seed", type=int, default=0)
    asyncio.run(main_async(p.parse_args()))


if __name__ == "__main__":
    main()
