"""Fixtures of the reward-mode tests: real dev engines (tiny policy, tiny teacher) and real judge servers.

Everything runs on 127.0.0.1 ephemeral ports and is stopped by PID at the end of the session.
- ``teacher_engine``: the dev engine serving the ``teacher_model_dir`` checkpoint.
- ``policy_engine``: the dev engine serving ``tiny_model_dir``, one per test module.
- ``rules_judge`` (tests/conftest.py): the judge service with the deterministic keyword backend.
- ``broken_judge``: the judge service with the LLM backend pointed at a closed port, so every task
  ends ``judge_failed`` quickly (a real failing dependency, not a fake).
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from engine.chat import load_tokenizer, render_prompt_ids
from tests.testkit.procs import ManagedProcess, start_dev_engine
from tests.testkit.servers import start_failing_judge

HINT_MARKER = "[user's hint / instruction]"


@pytest.fixture(scope="session")
def modes_log_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("modes-logs")


@pytest.fixture(scope="session")
def teacher_engine(teacher_model_dir: Path, modes_log_dir: Path) -> Iterator[ManagedProcess]:
    mp = start_dev_engine(teacher_model_dir, log_dir=modes_log_dir, name="teacher-engine")
    yield mp
    mp.stop()


@pytest.fixture(scope="module")
def policy_engine(
    request: pytest.FixtureRequest, tiny_model_dir: Path, modes_log_dir: Path
) -> Iterator[ManagedProcess]:
    """The tiny policy on a dev engine of each test module's own (its log named after the module)."""
    name = f"policy-engine-{request.module.__name__.rpartition('.')[2]}"
    with start_dev_engine(tiny_model_dir, log_dir=modes_log_dir, name=name) as mp:
        yield mp


@pytest.fixture(scope="session")
def broken_judge(modes_log_dir: Path) -> Iterator[ManagedProcess]:
    with start_failing_judge(modes_log_dir, "judge-broken") as mp:
        yield mp


@pytest.fixture(scope="session")
def policy_tokenizer(tiny_model_dir: Path) -> Any:
    return load_tokenizer(str(tiny_model_dir))


@pytest.fixture(scope="session")
def teacher_logprobs_torch(teacher_model_dir: Path, policy_tokenizer: Any) -> Callable[..., Any]:
    """Independent recomputation of teacher log-probs: the hint is appended by hand to the last user
    message, the policy template renders the prompt, the response ids are appended, the teacher
    checkpoint runs in torch. Returns (per-token log-probs [T], top-k (values, indices) or None)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(str(teacher_model_dir), dtype=torch.float32).eval()

    def compute(messages: list[dict[str, Any]], tools: Any, response_ids: list[int], hint: str, top_k: int = 0):
        msgs = [dict(m) for m in messages]
        last_user = max(i for i, m in enumerate(msgs) if m["role"] == "user")
        msgs[last_user]["content"] = f"{msgs[last_user]['content']}\n\n{HINT_MARKER}\n{hint}"
        prompt = render_prompt_ids(policy_tokenizer, msgs, tools)
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + list(response_ids)])).logits[0]
        lp = torch.log_softmax(logits[len(prompt) - 1 : -1].double(), dim=-1)  # (T, V): row t predicts resp[t]
        token_lp = lp.gather(1, torch.tensor(response_ids)[:, None])[:, 0].tolist()
        return token_lp, (lp.topk(top_k, dim=-1) if top_k else None)

    return compute
