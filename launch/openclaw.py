"""Point a stock OpenClaw agent at a running Hindsight stack: write its config, print how to run it.

    python launch/openclaw.py [--out DIR] [--gateway-port N]     (normally `launch/dev.sh openclaw`)

Contract: reads ``$HINDSIGHT_RUN_DIR/endpoints.json`` (written by ``launch/dev.sh start``) and writes
``DIR/openclaw.json`` (default ``$HINDSIGHT_RUN_DIR/openclaw``, mode 0600: it holds the client key) with one
custom provider, ``hindsight``, whose ``baseUrl`` is the policy server's ``/v1`` and whose ``api`` is
``openai-completions``; ``models.mode: replace`` drops OpenClaw's built-in providers and the agent's primary
model is ``hindsight/<served model>``. Nothing in OpenClaw is patched and no header is configured: the policy
server identifies sessions from what stock OpenClaw sends (its session id as ``prompt_cache_key``, enabled
here by the model's ``compat.supportsPromptCacheKey``, else the transcript) and recognises its heartbeat and
memory-flush runs as side turns (policy_server.serving.identity, policy_server.serving.side_rules).
"""

from __future__ import annotations

import argparse
import json
import os
import secrets
import sys
from pathlib import Path
from typing import Any

PROVIDER_ID = "hindsight"


def openclaw_config(
    policy_url: str,
    api_key: str,
    *,
    model_id: str = "hindsight-policy",
    context_window_tokens: int = 65536,
    max_reply_tokens: int = 256,
    workspace: str | None = None,
    gateway_port: int | None = None,
    gateway_token: str | None = None,
) -> dict[str, Any]:
    """The OpenClaw config (``openclaw.json``) for a policy server at ``policy_url`` (pure). With ``gateway_port``
    it also configures ``openclaw gateway run``: local mode on loopback at that port, clients authenticated by
    ``gateway_token`` (required then); ``openclaw agent`` without ``--local`` then runs its turns there."""
    model = {
        "id": model_id,
        "name": "Hindsight policy",
        "reasoning": False,
        "input": ["text"],
        "cost": {"input": 0, "output": 0, "cacheRead": 0, "cacheWrite": 0},
        "contextWindow": context_window_tokens,
        "maxTokens": max_reply_tokens,
        # OpenClaw then sends its session id as prompt_cache_key: the session's identity, no header needed.
        "compat": {"supportsPromptCacheKey": True},
    }
    defaults: dict[str, Any] = {"model": {"primary": f"{PROVIDER_ID}/{model_id}"}}
    if workspace:
        defaults["workspace"] = workspace
    config: dict[str, Any] = {
        "models": {
            "mode": "replace",
            "providers": {
                PROVIDER_ID: {
                    "baseUrl": policy_url.rstrip("/") + "/v1",
                    "apiKey": api_key,
                    "api": "openai-completions",
                    "models": [model],
                }
            },
        },
        "agents": {"defaults": defaults},
    }
    if gateway_port is not None:
        if not gateway_token:
            raise ValueError("a gateway needs a token: its clients authenticate with it")
        auth = {"mode": "token", "token": gateway_token}
        config["gateway"] = {"mode": "local", "bind": "loopback", "port": gateway_port, "auth": auth}
    return config


def write_config(out_dir: Path, endpoints: dict[str, Any], **kwargs: Any) -> Path:
    """Write ``out_dir/openclaw.json`` for the stack in ``endpoints``; returns its path."""
    out_dir.mkdir(parents=True, exist_ok=True)
    path = out_dir / "openclaw.json"
    config = openclaw_config(endpoints["policy_url"], endpoints["api_key"], **kwargs)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(config, indent=2) + "\n")
    os.chmod(tmp, 0o600)
    tmp.replace(path)
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="launch/dev.sh openclaw", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", help="folder of the OpenClaw state and config (default: $HINDSIGHT_RUN_DIR/openclaw)")
    parser.add_argument(
        "--gateway-port",
        type=int,
        default=os.environ.get("HINDSIGHT_OPENCLAW_GATEWAY_PORT") or None,
        help="also configure `openclaw gateway run` on this loopback port, with a fresh token "
        "[env HINDSIGHT_OPENCLAW_GATEWAY_PORT]",
    )
    args = parser.parse_args(argv)
    run_dir = Path(os.environ.get("HINDSIGHT_RUN_DIR", ".hindsight/dev")).resolve()
    try:
        endpoints = json.loads((run_dir / "endpoints.json").read_text())
    except FileNotFoundError:
        print(f"error: no running dev stack in {run_dir}: run `launch/dev.sh start` first", file=sys.stderr)
        return 1
    out = Path(args.out).resolve() if args.out else run_dir / "openclaw"
    from policy_server.serving.prompt_size import context_length

    # OpenClaw budgets its prompt (and compacts at about 3/4) from the window it is told: the engine's real one.
    window = context_length(endpoints["policy_model_path"]) or 65536
    gateway = {"gateway_port": args.gateway_port, "gateway_token": secrets.token_hex(16)} if args.gateway_port else {}
    path = write_config(out, endpoints, workspace=str(out / "workspace"), context_window_tokens=window, **gateway)
    env = f"OPENCLAW_STATE_DIR={out} OPENCLAW_CONFIG_PATH={path}"
    print(f"wrote {path}")
    print("run a turn (OpenClaw needs Node >= 24; repeat with the same --session-id to continue):")
    print(f"  {env} openclaw agent --local --session-id demo-1 --thinking off --message 'hello'")
    if gateway:
        print(f"or start its gateway (port {args.gateway_port}) and run turns through it:")
        print(f"  {env} openclaw gateway run &")
        print(f"  {env} openclaw agent --session-id demo-1 --thinking off --message 'hello'")
    return 0


if __name__ == "__main__":
    sys.exit(main())
