"""``hindsight-dev-engine``: serve a local Hugging Face model over SGLang 0.5.23's HTTP protocol on the CPU.

    hindsight-dev-engine --model-path DIR [--host 127.0.0.1] [--port N] [--api-key KEY]
                         [--admin-api-key KEY] [--served-model-name NAME] [--seed N] [--log-json] [--config FILE]
    python -m devkit.dev_server.cli ...   (what devkit.engine_procs.start_dev_engine runs)

The command line comes from DevEngineSettings (engine.cli_settings): every setting is a flag and an
environment variable ``HINDSIGHT_DEV_ENGINE_<NAME>``, and may be set in a ``--config`` file; flags >
environment > file > defaults; an invalid configuration exits 2.
"""

from __future__ import annotations

from devkit.dev_server.settings import DevEngineSettings
from engine.cli_settings import parse_cli
from engine.observability import configure_logging

PROG = "hindsight-dev-engine"
DESCRIPTION = "Serve a local Hugging Face model over SGLang's HTTP protocol on the CPU (development engine)."


def parse_args(argv: list[str] | None = None) -> DevEngineSettings:
    """DevEngineSettings from the command line (exits 2 when invalid)."""
    return parse_cli(DevEngineSettings, argv, prog=PROG, description=DESCRIPTION)


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_logging(settings.log_level, json_logs=settings.log_json)
    import uvicorn

    from devkit.dev_server.app import create_app

    # log_config=None: uvicorn's own loggers go through the handler above (request ids, JSON when asked).
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level,
        log_config=None,
        access_log=False,
        timeout_graceful_shutdown=2,
    )


if __name__ == "__main__":
    main()
