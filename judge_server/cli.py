"""``hindsight-judge``: run the judge service with uvicorn.

    hindsight-judge --engine-url http://127.0.0.1:31100 [--engine-api-key K] [--host 127.0.0.1] [--port N]
                    [--api-key K] [--backend llm|rules] [--tokenizer-path DIR] [--m 3]
                    [--policy fixed|adaptive|sequential] [--constrain-output] [--log-level info] [--log-json] [--config FILE]

The command line comes from JudgeSettings (engine.cli_settings): every setting is a flag and an
environment variable ``HINDSIGHT_JUDGE_<NAME>``, and may be set in a ``--config`` file; flags >
environment > file > defaults; ``--help`` lists them all; an invalid configuration exits 2. Logging is
configured here, once (engine.observability: request and session ids on every line, JSON lines with
``--log-json``).
"""

from __future__ import annotations

import uvicorn

from engine.cli_settings import parse_cli
from engine.observability import configure_logging
from judge_server.settings import JudgeSettings

PROG = "hindsight-judge"
DESCRIPTION = "Run the Hindsight judge service (majority-vote PRM and hint verdicts from a judge engine)."


def main(argv: list[str] | None = None) -> None:
    settings = parse_cli(JudgeSettings, argv, prog=PROG, description=DESCRIPTION)
    configure_logging(settings.log_level, json_logs=settings.log_json)
    from judge_server.app import create_app

    # log_config=None: uvicorn's loggers use the handler above; the middleware writes the access lines.
    uvicorn.run(
        create_app(settings),
        host=settings.host,
        port=settings.port,
        log_level=settings.log_level.lower(),
        log_config=None,
        access_log=False,
    )


if __name__ == "__main__":
    main()
