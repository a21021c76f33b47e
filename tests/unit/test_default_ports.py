"""The services' default ports are launch's (docs/LAUNCH.md section 2, the ``${NAME:=port}`` defaults of launch/*.sh)
and pairwise distinct: the policy server on POLICY_PORT, the judge on JUDGE_PORT, the dev engine (an SGLang stand-in)
on POLICY_ENGINE_BASE_PORT, where launch puts the first policy engine. So two services started with their defaults
on one host never collide, and a judge URL written from the docs reaches a judge started without ``--port``."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from devkit.dev_server.settings import DevEngineSettings
from judge_server.settings import JudgeSettings
from policy_server.settings import PolicySettings

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def launch_defaults() -> dict[str, int]:
    """Every ``: "${NAME:=PORT}"`` default of launch/*.sh (a name given in two scripts must agree)."""
    found: dict[str, int] = {}
    for script in sorted((ROOT / "launch").glob("*.sh")):
        for name, value in re.findall(r"\$\{([A-Z_]*PORT):=(\d+)\}", script.read_text(encoding="utf-8")):
            assert found.setdefault(name, int(value)) == int(value), f"{name} has two defaults in launch/"
    return found


def test_the_service_defaults_are_launchs_and_distinct() -> None:
    launch = launch_defaults()
    ports = {
        "policy": PolicySettings.model_fields["port"].default,
        "judge": JudgeSettings.model_fields["port"].default,
        "dev engine": DevEngineSettings.model_fields["port"].default,
    }
    assert ports == {
        "policy": launch["POLICY_PORT"],
        "judge": launch["JUDGE_PORT"],
        "dev engine": launch["POLICY_ENGINE_BASE_PORT"],
    }
    assert len(set(ports.values())) == len(ports), ports


def test_launch_doc_lists_the_same_defaults() -> None:
    doc = (ROOT / "docs" / "LAUNCH.md").read_text(encoding="utf-8")
    launch = launch_defaults()
    assert f"| `POLICY_PORT` | `{launch['POLICY_PORT']}` |" in doc
    assert f"| `{launch['JUDGE_PORT']}`, `{launch['JUDGE_ROUTER_PORT']}`, `{launch['JUDGE_ENGINE_BASE_PORT']}`" in doc
    assert f"| `{launch['POLICY_ROUTER_PORT']}`, `{launch['POLICY_ENGINE_BASE_PORT']}`" in doc
