"""The verl command lines of the docs (docs/VERL_RAY.md, docs/TRAINERS.md) against verl 0.9.1's real config.

Each ``python -m verl.trainer.main_ppo`` block is taken from the doc as a user would copy it, and composed with
verl's own Hydra config (``ppo_trainer``) in verl's venv (tests/conformance/verl_compose_check.py): every override
must name a key verl has (or add one with ``+``), and the result must name our manager, ``rollout.n=1``, no
validation runs. The complete command of docs/VERL_RAY.md also passes verl's ``validate_config`` (what ``main_ppo``
runs before Ray starts; docs/TRAINERS.md's ends in ``...``). A misspelt key, a value of the wrong type or a
batch-size combination verl refuses fails here. Skipped when the venv is missing (failed in CI), as
tests/conformance/test_verl_adapter.py.
"""

from __future__ import annotations

import json
import re
import subprocess
from pathlib import Path

import pytest

from tests.conformance.test_verl_adapter import verl_python  # noqa: F401 - the venv fixture

ROOT = Path(__file__).resolve().parents[2]
MANAGER = "trainer.adapters.verl_rollout.HindsightAgentLoopManager"
DOCS = ["docs/VERL_RAY.md", "docs/TRAINERS.md"]


def main_ppo_overrides(markdown: str) -> list[list[str]]:
    """The overrides of every ``python -m verl.trainer.main_ppo`` command in ``markdown``'s bash blocks (pure):
    continuation lines joined, words after the module name; a trailing ``...`` (the doc's "and the rest") dropped."""
    commands = []
    for block in re.findall(r"```bash\n(.*?)```", markdown, re.DOTALL):
        text = block.replace("\\\n", " ")
        for line in text.splitlines():
            words = line.split()
            if words[:3] == ["python", "-m", "verl.trainer.main_ppo"]:
                commands.append([w for w in words[3:] if w != "..."])
    return commands


@pytest.mark.unit
def test_the_docs_hold_the_commands():
    for doc in DOCS:
        commands = main_ppo_overrides((ROOT / doc).read_text())
        assert len(commands) == 1 and len(commands[0]) >= 8, doc
        assert f"+actor_rollout_ref.rollout.agent.agent_loop_manager_class={MANAGER}" in commands[0], doc


@pytest.mark.e2e
def test_doc_commands_compose_with_verls_config(verl_python):  # noqa: F811 - the fixture
    commands = [main_ppo_overrides((ROOT / doc).read_text())[0] for doc in DOCS]
    broken = [*commands[0], "trainer.n_gpus_per_nodes=8"]  # a misspelt key must fail
    batch = [*commands[0], "actor_rollout_ref.actor.ppo_mini_batch_size=100"]  # more than a step holds: refused
    checks = [(commands[0], True), (commands[1], False), (broken, True), (batch, True)]
    arg = json.dumps([{"overrides": o, "validate": v} for o, v in checks])
    res = subprocess.run(
        [str(verl_python), str(Path(__file__).with_name("verl_compose_check.py")), arg],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 0, res.stderr[-3000:]
    results = [json.loads(line) for line in res.stdout.splitlines() if line.startswith("{")]
    assert len(results) == len(checks), res.stdout[-2000:] + res.stderr[-2000:]
    for doc, got in zip(DOCS, results[:2], strict=True):
        assert got["ok"], (doc, got)
        assert (got["manager"], got["n"], got["test_freq"], got["val_before_train"]) == (MANAGER, 1, -1, False), doc
    assert not results[2]["ok"] and "n_gpus_per_nodes" in results[2]["error"], results[2]
    assert not results[3]["ok"] and "ppo_mini_batch_size" in results[3]["error"], results[3]
