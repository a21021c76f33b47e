"""Settings of the CPU dev engine: one pydantic-settings class, env prefix ``HINDSIGHT_DEV_ENGINE_``.

Every field is also a flag of ``hindsight-dev-engine`` (``--model-path`` for ``model_path``) and may be set
in a ``--config`` file (engine.cli_settings): flags > environment > config file > defaults. Built in
``cli.main`` (or by a test) and passed to ``create_app``.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from engine.cli_settings import CliSettings
from engine.security import check_exposure


class DevEngineSettings(CliSettings):
    """Resolved configuration of the dev engine; the flags mirror SGLang's where SGLang has one."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_DEV_ENGINE_", extra="ignore")

    model_path: str = Field(..., description="Hugging Face model folder to serve (weights, config, tokenizer)")
    host: str = Field("127.0.0.1", description="address to listen on; beyond loopback an api_key is required")
    port: int = Field(default=31000, ge=0, le=65535, description="port to listen on (launch's POLICY_ENGINE_BASE_PORT)")
    api_key: str | None = Field(None, description="bearer key of every route but the probes")
    admin_api_key: str | None = Field(
        None, description="bearer key of the control routes (pause, weight update); default: api_key"
    )
    allow_unauthenticated: bool = Field(
        False, description="serve a non-loopback host without an API key (only behind an authenticating gateway)"
    )
    # SGLang's default served name is the model path; the router uses it as model_id.
    served_model_name: str | None = Field(
        None, description="model name in /v1/models and model_info (default: the model path, as SGLang)"
    )
    seed: int = Field(0, description="seed of the sampler (a request's own seed wins)")
    weight_version: str = Field("default", description="weight version reported until the first update")
    # One torch thread: the tiny model is overhead-bound and the CI box has 2 cores shared by many processes.
    torch_threads: int = Field(default=1, ge=1, description="torch intra-op threads")
    prefix_cache_max_tokens: int = Field(
        default=16384,
        ge=0,
        description="prompt tokens of KV held for reuse by later prompts (SGLang's radix cache); 0 disables it",
    )
    max_running_requests: int = Field(
        default=64, ge=1, description="requests generating at once (SGLang --max-running-requests)"
    )
    max_body_bytes: int = Field(
        default=64 * 1024 * 1024,
        ge=1024,
        description="largest request body; 413 while reading beyond it (engine.http_guard)",
    )
    max_json_depth: int = Field(
        default=64, ge=4, le=512, description="deepest JSON nesting accepted in a body (400 beyond)"
    )
    max_in_flight_requests: int = Field(
        default=1024, ge=1, description="requests in flight at once (probes exempt); 429 beyond it"
    )
    update_wait_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="how long update_weights_from_disk waits for running (un-paused) requests before failing",
    )
    reasoning_parser: bool = Field(
        True, description="parse <think> blocks into reasoning_content in chat responses (SGLang --reasoning-parser)"
    )
    tool_call_parser: bool = Field(
        True, description="parse <tool_call> blocks into tool_calls in chat responses (SGLang --tool-call-parser)"
    )
    log_level: str = Field("info", description="log level (debug, info, warning, error)")
    log_json: bool = Field(False, description="JSON log lines (engine.observability) instead of plain text")
    record_requests: str | None = Field(
        None, description="append every POST/PUT request body to this JSON-lines file (conformance tests)"
    )

    @model_validator(mode="after")
    def _check_exposure(self) -> DevEngineSettings:
        check_exposure(
            "hindsight-dev-engine", self.host, self.api_key, allow_unauthenticated=self.allow_unauthenticated
        )
        return self
