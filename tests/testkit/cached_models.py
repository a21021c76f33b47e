"""Every tiny model the suite uses, from the build-once cache (devkit.model_cache), in one list.

The session fixtures and the tests that need a model take it from here (each call returns the cache entry,
building it on first use); ``python -m tests.testkit.cached_models`` builds every entry that is missing and says
how long each took. CI runs it before the timed suite, as it installs its venvs: on a warm cache it takes a
second or two; on a cold one, the builds (minutes, the tool policy's the longest) happen there instead of inside
the first test that needs them.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path

from devkit.model_cache import tiny_policy, tiny_teacher, tiny_tool_policy
from launch.devstack import DEV_CONTEXT_TOKENS, DEV_POLICY_LAYERS, TEACHER_PREFERRED_TEXT


def policy() -> Path:
    """The seeded tiny policy most tests serve and train (Qwen3 architecture and chat template)."""
    return tiny_policy(seed=0)


def other_policy() -> Path:
    """A second policy with other weights (seed 1) and the same tokenizer: a weight update that changes outputs."""
    return tiny_policy(seed=1)


def teacher() -> Path:
    """A teacher with the policy's tokenizer that clearly prefers TEACHER_PREFERRED_TEXT."""
    return tiny_teacher(policy(), TEACHER_PREFERRED_TEXT, seed=0)


def dev_policy() -> Path:
    """What ``launch/dev.sh start`` builds for the dev stack's policy (hindsight-tiny-model with its flags)."""
    return tiny_policy(seed=0, max_position_embeddings=DEV_CONTEXT_TOKENS, num_layers=DEV_POLICY_LAYERS)


def dev_teacher() -> Path:
    return tiny_teacher(dev_policy(), TEACHER_PREFERRED_TEXT, seed=0)


def long_context_policy() -> Path:
    """The two-layer policy at the dev stack's context: the tool policy's student."""
    return tiny_policy(seed=0, max_position_embeddings=DEV_CONTEXT_TOKENS)


def tool_policy() -> Path:
    """The policy trained to call OpenClaw's ``read`` tool on a trigger word (devkit.tiny_tool_model)."""
    return tiny_tool_policy(long_context_policy(), seed=0)


def long_context_teacher() -> Path:
    return tiny_teacher(long_context_policy(), TEACHER_PREFERRED_TEXT, seed=0)


ALL: tuple[Callable[[], Path], ...] = (
    policy,
    other_policy,
    teacher,
    dev_policy,
    dev_teacher,
    long_context_policy,
    long_context_teacher,
    tool_policy,
)


def main() -> None:
    for build in ALL:
        t0 = time.monotonic()
        entry = build()
        print(f"{build.__name__:22s} {time.monotonic() - t0:7.1f} s  {entry}", flush=True)


if __name__ == "__main__":
    main()
