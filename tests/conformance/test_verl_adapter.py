"""verl adapter against the real verl 0.9.1: its own code consumes leased Hindsight samples, with hand-checked numbers.

tests/conformance/verl_check.py runs in verl's separate venv (tests/conformance/make_verl_venv.sh), with this
repository on its path and the seeded tiny model as the tokenizer verl's config names. It leases samples through
trainer.lease_client (a JSONL file source with the policy server's lease/ack semantics) with
trainer.adapters.verl_rollout.HindsightAgentLoopManager, built by verl's own ``AgentLoopManager.create`` from
verl's generated PPO config, and checks:

- the batch is verl's own (its ``AgentLoopOutput`` padded and stacked by its ``AgentLoopWorker``): prompts
  left-padded, responses right-padded, ``response_mask`` = our loss mask, ``rollout_log_probs``, ``rm_scores``
  = the reward on the last token plus process rewards, the staleness of each sample;
- samples the step cannot use (no reward in a reward step, longer than verl's lengths) are set aside and replaced,
  and every lease is acked when verl asks for the next step;
- verl's ``compute_advantage`` with GRPO (singleton and grouped uids) and REINFORCE++ gives the numbers computed
  by hand in plain Python;
- in a teacher step, verl's own unpadding and response slicing (the path its distillation losses read) return our
  teacher log-probs against the sampled ids, and its k1 estimator equals minus the lease client's OPD advantage;
- validation batches and repeated uids (rollout.n > 1) are refused with a message; a refused ack is logged.

``test_verl_leases_live_traffic`` does the same over HTTP with live traffic: scripted users -> policy server (rl)
-> rules judge -> ready samples, leased by the manager configured from its environment variables alone.
Both run in one verl_check.py process (the module's ``verl_run`` fixture): verl's imports are about 9 CPU-seconds.

When the verl venv is not there: skipped with the reason outside CI (locally run
``bash tests/conformance/make_verl_venv.sh`` once: minutes, about 2 GB, reused afterwards), failed in CI, which
builds it in .ci/run.
"""

from __future__ import annotations

import os
import re
import subprocess
from dataclasses import dataclass
from pathlib import Path

import pytest

from tests.testkit.servers import ADMIN_KEY as ADMIN
from tests.testkit.stack import ScriptedUser, start_stack
from tests.waiting import wait_until

HERE = Path(__file__).parent
REPO = HERE.parents[1]
EXPECTED_CHECKS = 58  # every check verl_check.py makes; fewer means a branch of it stopped running


def verl_venv() -> Path:
    return Path(os.environ.get("HINDSIGHT_VERL_VENV", Path.home() / ".cache" / "hindsight" / "verl-0.9.1"))


@pytest.fixture(scope="module")
def verl_python() -> Path:
    venv = verl_venv()
    if not (venv / ".complete").exists():
        failed = venv.with_name(venv.name + ".failed")
        why = failed.read_text().strip() if failed.exists() else "not built"
        reason = (
            f"verl 0.9.1 venv unavailable at {venv} ({why}); build it with: bash tests/conformance/make_verl_venv.sh"
        )
        if os.environ.get("CI") == "true":
            pytest.fail(f"{reason} (CI builds it in .ci/run: this test is how CI shows verl consumes our samples)")
        pytest.skip(reason)
    return venv / "bin" / "python"


@dataclass
class VerlRun:
    """What one verl_check.py process reported: the checks of the sample file and of the live step, and the
    number of ready samples the live step leased."""

    passed: int
    live_passed: int
    ready: int


@pytest.fixture(scope="module")
def verl_run(verl_python: Path, tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> VerlRun:
    """Scripted users -> policy server (rl) -> rules judge -> ready samples; then ONE verl_check.py process (verl's
    imports are about 9 CPU-seconds) runs the sample-file checks and the live step, whose manager, configured by
    its environment variables as in a verl run, leases those samples over HTTP into verl's batch and acks them."""
    work = tmp_path_factory.mktemp("verl")
    stack = start_stack(tiny_model_dir, work / "stack")
    try:
        user = ScriptedUser(stack.policy.url, lambda reply: "e" in reply, max_tokens=6)
        judged = len(user.run("verl", ["please read the file", "can you list it"], turns=2, seed=0))
        user.close()

        def settled() -> dict | None:
            counts = stack.stats()["samples"]
            done = counts.get("pending_judge", 0) == 0 and sum(counts.values()) >= judged
            return counts if done else None

        counts = wait_until(settled, timeout_s=120, interval_s=0.5, message="the judged turns did not settle")
        n = counts.get("ready", 0)
        assert n >= 2, counts  # empty replies are rejected; the rest are judged +1 / -1
        env = {
            "HINDSIGHT_POLICY_URL": stack.policy.url,
            "HINDSIGHT_ADMIN_KEY": ADMIN,
            "HINDSIGHT_REQUIRE": "reward",
            "HINDSIGHT_LEASE_WAIT_S": "5",
        }
        full_env = {**os.environ, "PYTHONPATH": str(REPO), "TOKENIZERS_PARALLELISM": "false", **env}
        proc = subprocess.run(
            [str(verl_python), "-W", "ignore", str(HERE / "verl_check.py"), str(stack.model_dir), str(work), str(n)],
            capture_output=True,
            text=True,
            timeout=400,  # verl's imports alone take about a minute on the loaded CI machine
            cwd=work,
            env=full_env,
        )
        assert proc.returncode == 0, proc.stdout[-1000:] + proc.stderr[-4000:]
        found = re.search(r"verl checks passed: (\d+)", proc.stdout)
        live = re.search(r"verl live checks passed: (\d+)", proc.stdout)
        assert found and live, proc.stdout[-2000:]
        return VerlRun(int(found.group(1)), int(live.group(1)), n)
    except Exception:
        print(stack.tails())
        raise
    finally:
        stack.stop()


@pytest.mark.slow
@pytest.mark.timeout(900)  # the module's stack and verl process (verl_run)
def test_verl_consumes_leased_samples(verl_run: VerlRun) -> None:
    assert verl_run.passed == EXPECTED_CHECKS


@pytest.mark.e2e
@pytest.mark.slow
@pytest.mark.timeout(900)
def test_verl_leases_live_traffic(verl_run: VerlRun) -> None:
    assert verl_run.live_passed == 4 + 7 * verl_run.ready  # 4 per step, 7 per row (verl_check.live_step)
