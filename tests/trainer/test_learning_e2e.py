"""The closed learning loop through the real stack: the policy learns what the judge rewards.

Stack (tests/testkit/stack.py): dev engine on a private copy of the tiny model <- policy server (mode rl) ->
judge server (rules backend). A scripted user (openai client) answers "Thanks, that worked." when the
assistant's reply contains the target and "No, that is wrong." otherwise, so the rules judge turns the target
into a deterministic +1 / -1 reward. Target: an uppercase letter in the reply, i.e. one of the tiny
tokenizer's ~13% tokens that carry one; with 3-token replies the random tiny model shows it in roughly a
third of its replies at the start (measured, not assumed: the test asserts the start lies in (0.1, 0.6)).

Each round: K sessions through the policy server -> wait until their paired turns are judged and ready ->
one ``train()`` step leasing exactly those samples over HTTP -> checkpoint, ack, POST /admin/weights/update
-> the engine serves the new weights. The target frequency is measured on held-out prompts straight from
the engine (n samples per prompt, fixed sampling seeds, temperature 1), so measurement traffic is never
recorded as training data. Asserted: the frequency ends clearly above its start (margin), the engine serves
the last trained version, and every paired turn was consumed by the trainer.
"""

from __future__ import annotations

import asyncio
import json

import pytest

from engine.chat import load_tokenizer, parse_assistant_output, render_prompt_ids
from engine.client import EngineClient
from tests.testkit.servers import ADMIN_KEY as ADMIN
from tests.testkit.stack import ScriptedUser, start_stack
from tests.waiting import wait_until
from trainer.settings import TrainConfig
from trainer.train import train

pytestmark = pytest.mark.e2e

MAX_TOKENS = 3
PROMPTS = [f"please {w} the file" for w in "read write open close list search find fix run check".split()]
HELD_OUT = [f"tell me about item {w}" for w in "red blue green gold".split()]
ROUNDS, SESSIONS, TURNS = 8, 8, 4  # 32 judged turns per round, one training step per round
MARGIN = 0.3


def has_target(text: str) -> bool:
    return any(c.isupper() for c in text)


def target_frequency(engine_url: str, tokenizer, n_per_prompt: int = 64) -> float:
    """Share of held-out replies (as the user sees them: parsed content) that contain the target."""

    async def go() -> float:
        client = EngineClient(engine_url)
        try:
            hits = total = 0
            for i, prompt in enumerate(HELD_OUT):
                ids = render_prompt_ids(tokenizer, [{"role": "user", "content": prompt}])
                sp = {"n": n_per_prompt, "temperature": 1.0, "max_new_tokens": MAX_TOKENS, "sampling_seed": 1000 + i}
                for g in await client.generate_ids(ids, sp, return_logprob=False):
                    text = tokenizer.decode(g.output_ids, skip_special_tokens=True)
                    hits += has_target(parse_assistant_output(text).content)
                    total += 1
            return hits / total
        finally:
            await client.aclose()

    return asyncio.run(go())


def wait_judged(stack, turns_sent: int, deadline_s: float = 30.0) -> dict:
    """Block until every turn sent so far has left ``pending_judge``; returns the sample counts by status.

    A paired turn is normally ``ready``; one whose reply has no content (the tiny model can stop at once)
    is rejected by the judge service (``judge_rejected``), never scored 0, so the count of ready samples
    per round is read back rather than assumed.
    """

    def judged() -> dict | None:
        samples = stack.stats()["samples"]
        return samples if samples.get("pending_judge", 0) == 0 and sum(samples.values()) >= turns_sent else None

    return wait_until(
        judged,
        timeout_s=deadline_s,
        interval_s=0.1,
        message=lambda: f"turns not judged: {stack.stats()['samples']} (sent {turns_sent})",
    )


@pytest.fixture(scope="module")
def stack(tiny_model_dir, tmp_path_factory):
    st = start_stack(tiny_model_dir, tmp_path_factory.mktemp("learning-e2e"))
    try:
        yield st
    finally:
        st.stop()


def test_policy_learns_the_judged_target_through_the_real_stack(stack, tmp_path):
    tokenizer = load_tokenizer(str(stack.model_dir))
    user = ScriptedUser(stack.policy.url, has_target, max_tokens=MAX_TOKENS)
    out = tmp_path / "train"
    freqs = [target_frequency(stack.engine.url, tokenizer)]
    assert 0.1 < freqs[0] < 0.6, f"the target must be emitted sometimes but not always at the start: {freqs[0]}"
    good_share, ready = [], []
    try:
        for rnd in range(ROUNDS):
            prompts = [PROMPTS[(rnd * SESSIONS + i) % len(PROMPTS)] for i in range(SESSIONS)]
            outcomes = user.run(f"r{rnd}", prompts, TURNS, seed=rnd * 100)
            good_share.append(sum(outcomes) / len(outcomes))
            ready.append(wait_judged(stack, (rnd + 1) * SESSIONS * (TURNS + 1))["ready"])
            assert ready[-1] >= SESSIONS * TURNS - 2, ready  # at most a couple of empty replies
            cfg = TrainConfig(
                model_path=str(stack.model_dir),
                out_dir=str(out),
                policy_url=stack.policy.url,
                admin_api_key=ADMIN,
                steps=rnd + 1,
                batch_size=SESSIONS * TURNS,
                micro_batch_size=SESSIONS * TURNS,
                lr=2e-2,
                min_batch=1,
                lease_wait_s=5.0,
                sync_on_resume=False,
                keep_checkpoints=1,
                progress=False,
                seed=rnd,
            )
            assert train(cfg)["step"] == rnd + 1
            freqs.append(target_frequency(stack.engine.url, tokenizer))
    finally:
        user.close()
    print(
        f"target frequency per round: {[round(f, 3) for f in freqs]}; rewarded share of training turns: "
        f"{[round(g, 3) for g in good_share]}"
    )
    assert freqs[-1] >= freqs[0] + MARGIN, (freqs, good_share)
    metrics = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in metrics] == list(range(1, ROUNDS + 1))
    # every step trained a whole round of freshly judged turns, sampled by the weights of the previous step
    assert [m["n_samples"] for m in metrics] == [m["n_with_reward"] for m in metrics] == ready
    assert [m["weight_versions"] for m in metrics[1:]] == [[str(i)] for i in range(1, ROUNDS)]
    stats = stack.stats()
    assert stats["samples"]["consumed"] == sum(ready) and stats["samples"]["ready"] == 0
    assert str(stats["weight_version"]) == str(ROUNDS)
