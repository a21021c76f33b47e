"""``hindsight-policy``: run the policy server (every PolicySettings field is a flag; env HINDSIGHT_POLICY_*).

    hindsight-policy --model-path DIR --engine-url http://127.0.0.1:30010 --data-dir ./data \
        [--judge-url URL] [--teacher-url URL] [--mode rl|opd|combine] [--port 30000] ...

    hindsight-policy migrate [--store-url URL | --data-dir DIR]   # schema migrations only, then exit

Flags override environment variables. Boolean fields take a value (``--at-least-one false``).
Logging goes through engine.observability (request and session ids on every line, ``--log-json true`` for
JSON lines); the resolved settings, secrets redacted, are logged at start. SIGTERM shuts down gracefully
(policy_server.serving.shutdown) and exits 0.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys

import uvicorn

from engine.observability import configure_logging
from policy_server.settings import PolicySettings


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="hindsight-policy", description=__doc__.splitlines()[0])
    for name, field in PolicySettings.model_fields.items():
        # A bare boolean flag (--infer-sessions) means true; an explicit value (--infer-sessions false) still works.
        flag = {"nargs": "?", "const": "true"} if field.annotation is bool else {}
        parser.add_argument("--" + name.replace("_", "-"), dest=name, default=None, help=field.description or "",
                            **flag)
    return parser


def settings_from_args(argv: list[str] | None = None) -> PolicySettings:
    args = build_parser().parse_args(argv)
    given = {k: v for k, v in vars(args).items() if v is not None}
    return PolicySettings(**given)


def migrate(argv: list[str]) -> int:
    """``hindsight-policy migrate``: bring the store's schema to this release's version (a server applies the
    same migrations when it starts; this runs them ahead of a rolling upgrade of the replicas)."""
    import os

    from policy_server.store import LATEST_VERSION, SchemaError, open_store

    parser = argparse.ArgumentParser(prog="hindsight-policy migrate", description=migrate.__doc__)
    parser.add_argument("--store-url", default=os.environ.get("HINDSIGHT_POLICY_STORE_URL"))
    parser.add_argument("--data-dir", default=os.environ.get("HINDSIGHT_POLICY_DATA_DIR", "./hindsight-data"))
    args = parser.parse_args(argv)
    try:
        store = open_store(args.store_url, args.data_dir)
    except (SchemaError, ValueError) as exc:
        print(f"hindsight-policy migrate: {exc}", file=sys.stderr)  # noqa: T201
        return 2
    store.close()
    print(f"store schema at version {LATEST_VERSION}")  # noqa: T201
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["migrate"]:
        sys.exit(migrate(argv[1:]))
    try:
        settings = settings_from_args(argv)
    except ValueError as exc:
        print(f"hindsight-policy: invalid configuration:\n{exc}", file=sys.stderr)  # noqa: T201
        sys.exit(2)
    configure_logging(settings.log_level.upper(), json_logs=settings.log_json)  # request/session ids on every line
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine call is noise
    from policy_server.app import create_app
    from policy_server.serving.shutdown import DrainingServer

    app = create_app(settings)
    # log_config=None: uvicorn's loggers flow through configure_logging; the access line is the middleware's.
    config = uvicorn.Config(app, host=settings.host, port=settings.port, log_level=settings.log_level.lower(),
                            log_config=None, access_log=False, timeout_graceful_shutdown=5)
    # Hard bound on a stop: the chat grace, the judge drain, uvicorn's own 5 s and bounded store waits.
    hard_stop_s = settings.shutdown_grace_s + settings.shutdown_drain_s + 10 + 2 * settings.store_busy_timeout_s
    server = DrainingServer(config, app.state.drain, grace_s=settings.shutdown_grace_s, hard_stop_s=hard_stop_s)
    # uvicorn re-raises the signal that stopped it once it is done; this handler turns that into a normal
    # return, so a graceful SIGTERM shutdown exits 0 (policy_server.serving.shutdown).
    signal.signal(signal.SIGTERM, lambda *_: None)
    server.run()
    if not server.started:
        sys.exit(3)  # the lifespan startup failed (logged)


if __name__ == "__main__":
    main()
