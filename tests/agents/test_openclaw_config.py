"""``launch/dev.sh openclaw``: the OpenClaw config it writes for a running stack (pure parts and the command)."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from launch.openclaw import openclaw_config

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.unit
def test_config_is_one_custom_provider_without_headers():
    cfg = openclaw_config("http://127.0.0.1:1234/", "sk-x", context_window_tokens=65536)
    provider = cfg["models"]["providers"]["hindsight"]
    assert cfg["models"]["mode"] == "replace"
    assert (provider["baseUrl"], provider["apiKey"], provider["api"]) == (
        "http://127.0.0.1:1234/v1",
        "sk-x",
        "openai-completions",
    )
    assert "headers" not in provider and all("headers" not in m for m in provider["models"])
    (model,) = provider["models"]
    assert model["contextWindow"] == 65536 and model["compat"] == {"supportsPromptCacheKey": True}
    assert cfg["agents"]["defaults"]["model"]["primary"] == "hindsight/hindsight-policy"
    assert "gateway" not in cfg  # `openclaw agent --local` needs none


@pytest.mark.unit
def test_gateway_block_is_local_loopback_with_a_token():
    cfg = openclaw_config("http://127.0.0.1:1234", "sk-x", gateway_port=18789, gateway_token="t0k")
    assert cfg["gateway"] == {
        "mode": "local",
        "bind": "loopback",
        "port": 18789,
        "auth": {"mode": "token", "token": "t0k"},
    }
    with pytest.raises(ValueError, match="token"):
        openclaw_config("http://127.0.0.1:1234", "sk-x", gateway_port=18789)


def test_dev_sh_openclaw_writes_the_config_for_the_running_stack(tmp_path):
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({"max_position_embeddings": 65536}))
    endpoints = {"policy_url": "http://127.0.0.1:4321", "api_key": "sk-dev-1", "policy_model_path": str(model)}
    (tmp_path / "endpoints.json").write_text(json.dumps(endpoints))
    env = {**os.environ, "HINDSIGHT_RUN_DIR": str(tmp_path), "PYTHON": sys.executable, "PYTHONPATH": str(REPO)}
    res = subprocess.run(["bash", str(REPO / "launch/dev.sh"), "openclaw"], env=env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    path = tmp_path / "openclaw" / "openclaw.json"
    cfg = json.loads(path.read_text())
    assert cfg["models"]["providers"]["hindsight"]["baseUrl"] == "http://127.0.0.1:4321/v1"
    assert cfg["models"]["providers"]["hindsight"]["models"][0]["contextWindow"] == 65536
    assert stat.S_IMODE(path.stat().st_mode) == 0o600  # it holds the client key
    assert "openclaw agent --local" in res.stdout and "gateway" not in cfg
    # with a gateway port: a gateway block with a fresh token, and the gateway commands
    gw_env = {**env, "HINDSIGHT_OPENCLAW_GATEWAY_PORT": "18789"}
    res = subprocess.run(["bash", str(REPO / "launch/dev.sh"), "openclaw"], env=gw_env, capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    gateway = json.loads(path.read_text())["gateway"]
    assert gateway["port"] == 18789 and gateway["bind"] == "loopback" and len(gateway["auth"]["token"]) == 32
    assert "openclaw gateway run" in res.stdout and "openclaw agent --session-id" in res.stdout
    (tmp_path / "endpoints.json").unlink()
    res = subprocess.run(["bash", str(REPO / "launch/dev.sh"), "openclaw"], env=env, capture_output=True, text=True)
    assert res.returncode == 1 and "launch/dev.sh start" in res.stderr
