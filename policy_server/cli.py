"""``hindsight-policy``: run the policy server (every PolicySettings field is a flag; env HINDSIGHT_POLICY_*).

    hindsight-policy --model-path DIR --engine-url http://127.0.0.1:30001 --data-dir ./data \
        [--judge-url URL] [--teacher-url URL] [--mode rl|opd|combine] [--port 30000] [--config FILE] ...

    hindsight-policy migrate [--store-url URL | --data-dir DIR]   # schema migrations (and file upgrade), then exit

The command line comes from PolicySettings (engine.cli_settings): flags > environment > ``--config`` file
> defaults; ``--help`` lists every setting. Boolean flags: ``--infer-sessions``, ``--at-least-one false`` or
``--no-at-least-one``; an invalid configuration exits 2.
Logging goes through engine.observability (request and session ids on every line, ``--log-json true`` for
JSON lines); the resolved settings, secrets redacted, are logged at start. SIGTERM shuts down gracefully
(policy_server.serving.shutdown) and exits 0.
"""

from __future__ import annotations

import logging
import signal
import sys

import uvicorn
from pydantic_settings import SettingsConfigDict

from engine.cli_settings import CliSettings, parse_cli, parse_settings
from engine.observability import configure_logging
from policy_server.settings import PolicySettings

PROG = "hindsight-policy"
DESCRIPTION = (
    "Run the Hindsight policy server (an OpenAI-compatible proxy that records turns and samples). "
    "`hindsight-policy migrate --help`: the store's schema migrations alone."
)


def settings_from_args(argv: list[str] | None = None) -> PolicySettings:
    """PolicySettings from flags > env > ``--config`` file > defaults; raises ``ValueError`` when invalid."""
    return parse_settings(PolicySettings, argv, prog=PROG, description=DESCRIPTION)


class MigrateSettings(CliSettings):
    """``hindsight-policy migrate``: where the store is (the same settings and env vars as the server's)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_POLICY_", extra="ignore")

    # The server's own fields (default, description, validation), so the two commands cannot drift apart.
    store_url: str | None = PolicySettings.model_fields["store_url"]  # type: ignore[assignment]
    data_dir: str = PolicySettings.model_fields["data_dir"]  # type: ignore[assignment]


def migrate(argv: list[str]) -> int:
    """Bring the store's schema to this release's version (a server applies the same migrations when it
    starts; this runs them ahead of a rolling upgrade of the replicas), and upgrade a SQLite file created without
    incremental auto-vacuum (one VACUUM: run it with the server stopped)."""
    from policy_server.store import LATEST_VERSION, SchemaError, open_store

    args = parse_cli(MigrateSettings, argv, prog=PROG + " migrate", description=migrate.__doc__)
    try:
        store = open_store(args.store_url, args.data_dir)
    except (SchemaError, ValueError) as exc:
        print(f"hindsight-policy migrate: {exc}", file=sys.stderr)
        return 2
    try:
        upgraded = store.upgrade_file()
    finally:
        store.close()
    print(f"store schema at version {LATEST_VERSION}")
    if upgraded:
        print(upgraded)
    return 0


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["migrate"]:
        sys.exit(migrate(argv[1:]))
    settings = parse_cli(PolicySettings, argv, prog=PROG, description=DESCRIPTION)
    configure_logging(settings.log_level.upper(), json_logs=settings.log_json)  # request/session ids on every line
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one INFO line per engine call is noise
    from policy_server.app import create_app
    from policy_server.serving.shutdown import DrainingServer

    app = create_app(settings)
    # log_config=None: uvicorn's loggers flow through configure_logging; the access line is the middleware's.
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=5,
    )
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
