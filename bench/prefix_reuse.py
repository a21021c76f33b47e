"""Policy-engine prefix reuse over a 10-turn session through the policy server and the CPU dev engine.

    python -m bench.prefix_reuse [--model-dir DIR] [--turns 10] [--system-tokens 1500] [--max-tokens 24]

One session: a long system prompt, then ``--turns`` turns, each answered by the dev engine (its prefix cache
plays SGLang's radix cache: a finished request leaves the KV of its prompt and reply) and continued with
a short user message. Printed per turn: ``cached_tokens / prompt_tokens`` as the engine reported them
(``usage.prompt_tokens_details.cached_tokens``), and how the prompt was made (the policy server's
``hindsight_policy_prompt_renders_total``). Two runs over the tiny model's own template, Qwen3's: thinking on
(its default) and thinking off (``reasoning_effort: none``, whose generation prompt opens an empty think block
the template drops from past replies). Qwen3's template rewrites history either way, so with the policy's
default ``--history sampled`` every continuing turn keeps the previous prompt and the sampled ids
(``continued_over_rewrite``); the cache then reaches the new messages. The target is >= 0.95 from turn 2 on.
"""

from __future__ import annotations

import argparse
import random
import re
import tempfile
from pathlib import Path

import httpx

from devkit.tiny_model import build_tiny_model
from engine.chat import load_tokenizer
from tests.long_context import WORDS
from tests.testkit.procs import start_dev_engine
from tests.testkit.servers import CLIENT_KEY, start_policy


def _renders(url: str) -> dict[str, float]:
    text = httpx.get(url + "/metrics", trust_env=False, timeout=10).text
    pattern = r'^hindsight_policy_prompt_renders_total\{reason="(\w+)"\} (\S+)$'
    return {m[0]: float(m[1]) for m in re.findall(pattern, text, re.M)}


def session(http: httpx.Client, url: str, system: str, turns: int, max_tokens: int, **extra) -> list[float]:
    rng = random.Random(1)
    messages = [{"role": "system", "content": system}, {"role": "user", "content": "list the report folder"}]
    headers = {"Authorization": f"Bearer {CLIENT_KEY}", "X-Session-Id": f"reuse-{extra or 'default'}"}
    ratios = []
    for k in range(turns):
        before = _renders(url)
        r = http.post(
            "/v1/chat/completions",
            json={"messages": messages, "max_tokens": max_tokens, "seed": k, **extra},
            headers=headers,
        )
        r.raise_for_status()
        body = r.json()
        usage = body["usage"]
        cached = usage.get("prompt_tokens_details", {}).get("cached_tokens", 0)
        ratio = cached / usage["prompt_tokens"]
        after = _renders(url)
        how = [k2 for k2 in after if after[k2] > before.get(k2, 0)]
        ratios.append(ratio)
        print(
            f"  turn {k + 1:2d}: prompt {usage['prompt_tokens']:5d}  cached {cached:5d}  ratio {ratio:.3f}  ({how[0]})"
        )
        reply = body["choices"][0]["message"]
        messages += [
            {"role": "assistant", "content": reply.get("content") or ""},
            {"role": "user", "content": " ".join(rng.choice(WORDS.split()) for _ in range(12))},
        ]
    return ratios


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model-dir", type=Path)
    ap.add_argument("--turns", type=int, default=10)
    ap.add_argument("--system-tokens", type=int, default=1500)
    ap.add_argument("--max-tokens", type=int, default=24)
    a = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="hs-reuse-"))
    model_dir = a.model_dir or build_tiny_model(work / "tiny", seed=0)
    tok = load_tokenizer(str(model_dir))
    rng = random.Random(0)
    system = ""
    while len(tok.encode(system, add_special_tokens=False)) < a.system_tokens:
        system += " ".join(rng.choice(WORDS.split()) for _ in range(50)) + "\n"
    eng = start_dev_engine(model_dir, log_dir=work, extra_args=["--seed", "0", "--prefix-cache-max-tokens", "65536"])
    pol = start_policy(model_dir, eng.url, work / "data", work, extra=["--session-idle-timeout-s", "600"])
    try:
        with httpx.Client(base_url=pol.url, timeout=300, trust_env=False) as http:
            for label, extra in (
                ("thinking on (the template's default)", {}),
                ("thinking off (reasoning_effort: none)", {"reasoning_effort": "none"}),
            ):
                print(f"{label}:")
                ratios = session(http, pol.url, system, a.turns, a.max_tokens, **extra)
                later = ratios[1:]
                print(f"  cached/prompt from turn 2 on: min {min(later):.3f}  mean {sum(later) / len(later):.3f}")
    finally:
        pol.stop()
        eng.stop()


if __name__ == "__main__":
    main()
