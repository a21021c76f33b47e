"""``hindsight-judge``: run the judge service with uvicorn on 127.0.0.1.

    hindsight-judge --engine-url http://127.0.0.1:30000 [--engine-api-key K] [--host 127.0.0.1] [--port N]
                    [--api-key K] [--backend llm|rules] [--tokenizer-path DIR] [--m 3] [--policy fixed|adaptive|sequential]
                    [--constrain-output] [--log-level info] [--log-json]

Every flag is also an environment variable ``HINDSIGHT_JUDGE_<FLAG>`` (flags win); any other setting of
JudgeSettings (settings.py) is set through its environment variable. Logging is configured here, once
(engine.observability: request and session ids on every line, JSON lines with ``--log-json``).
"""

from __future__ import annotations

import argparse
import os

import uvicorn

from engine.observability import configure_logging
from judge_server.app import create_app
from judge_server.settings import JudgeSettings


def _env_flag(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def parse_cli(argv: list[str] | None = None) -> tuple[dict[str, object], str, bool]:
    """(settings overrides, log level, JSON logs?)."""
    p = argparse.ArgumentParser(prog="hindsight-judge", description=__doc__.split("\n\n")[0])
    p.add_argument("--engine-url")
    p.add_argument("--engine-api-key")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key")
    p.add_argument("--allow-unauthenticated", action="store_true", default=None,
                   help="serve a non-loopback host without an API key (an authenticating gateway is in front)")
    p.add_argument("--backend", choices=["llm", "rules"])
    p.add_argument("--tokenizer-path")
    p.add_argument("--m", type=int)
    p.add_argument("--policy", choices=["fixed", "adaptive", "sequential"])
    p.add_argument("--constrain-output", action="store_true", default=None)
    p.add_argument("--max-new-tokens", type=int)
    p.add_argument("--request-deadline-s", type=float)
    p.add_argument("--compat-failed-reward", type=float,
                   help="reward of a judge_failed item on /get_reward and /slime/reward (default: answer 503)")
    p.add_argument("--log-level", default=os.environ.get("HINDSIGHT_JUDGE_LOG_LEVEL", "info"))
    p.add_argument("--log-json", action="store_true", default=_env_flag("HINDSIGHT_JUDGE_LOG_JSON"))
    ns = vars(p.parse_args(argv))
    log_level = str(ns.pop("log_level"))
    log_json = bool(ns.pop("log_json"))
    return {k: v for k, v in ns.items() if v is not None}, log_level, log_json


def parse_args(argv: list[str] | None = None) -> tuple[dict[str, object], str]:
    overrides, log_level, _ = parse_cli(argv)
    return overrides, log_level


def main(argv: list[str] | None = None) -> None:
    overrides, log_level, log_json = parse_cli(argv)
    configure_logging(log_level, json_logs=log_json)
    try:
        settings = JudgeSettings(**overrides)  # env vars fill whatever the flags leave unset
    except ValueError as exc:
        raise SystemExit(f"hindsight-judge: invalid settings: {exc}") from None
    # log_config=None: uvicorn's loggers use the handler above; the middleware writes the access lines.
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=log_level,
                log_config=None, access_log=False)


if __name__ == "__main__":
    main()
