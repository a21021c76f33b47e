"""``hindsight-dev-engine``: serve a local Hugging Face model over SGLang 0.5.23's HTTP protocol on the CPU.

    hindsight-dev-engine --model-path DIR [--host 127.0.0.1] [--port N] [--api-key KEY]
                         [--admin-api-key KEY] [--served-model-name NAME] [--seed N] [--log-json]
    python -m engine.dev_server.cli ...   (what engine.procs.start_dev_engine runs)

Every flag is also an env var (``HINDSIGHT_DEV_ENGINE_<FLAG>``); flags win.
"""

from __future__ import annotations

import argparse

from engine.dev_server.settings import DevEngineSettings
from engine.observability import configure_logging


def parse_args(argv: list[str] | None = None) -> DevEngineSettings:
    parser = argparse.ArgumentParser(prog="hindsight-dev-engine", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model-path", dest="model_path")
    parser.add_argument("--host")
    parser.add_argument("--port", type=int)
    parser.add_argument("--api-key", dest="api_key")
    parser.add_argument("--admin-api-key", dest="admin_api_key")
    parser.add_argument("--allow-unauthenticated", dest="allow_unauthenticated", action="store_true", default=None,
                        help="serve a non-loopback host without an API key (an authenticating gateway is in front)")
    parser.add_argument("--served-model-name", dest="served_model_name")
    parser.add_argument("--seed", type=int)
    parser.add_argument("--weight-version", dest="weight_version")
    parser.add_argument("--prefix-cache-max-tokens", dest="prefix_cache_max_tokens", type=int)
    parser.add_argument("--torch-threads", dest="torch_threads", type=int)
    parser.add_argument("--log-level", dest="log_level")
    parser.add_argument("--log-json", dest="log_json", action="store_true", default=None)
    parser.add_argument("--record-requests", dest="record_requests", metavar="PATH",
                        help="append every POST/PUT request body to this JSON-lines file (conformance tests)")
    args = parser.parse_args(argv)
    overrides = {k: v for k, v in vars(args).items() if v is not None}
    try:
        return DevEngineSettings(**overrides)
    except ValueError as exc:
        parser.error(str(exc))
        raise  # unreachable: parser.error exits


def main(argv: list[str] | None = None) -> None:
    settings = parse_args(argv)
    configure_logging(settings.log_level, json_logs=settings.log_json)
    import uvicorn

    from engine.dev_server.app import create_app

    # log_config=None: uvicorn's own loggers go through the handler above (request ids, JSON when asked).
    uvicorn.run(create_app(settings), host=settings.host, port=settings.port, log_level=settings.log_level,
                log_config=None, access_log=False, timeout_graceful_shutdown=2)


if __name__ == "__main__":
    main()
