"""Settings of the CPU dev engine (one pydantic-settings class; every field is also an env var).

Env prefix ``HINDSIGHT_DEV_ENGINE_`` (e.g. ``HINDSIGHT_DEV_ENGINE_API_KEY``); the CLI flags of
``hindsight-dev-engine`` override the environment. Built in ``cli.main`` and passed to ``create_app``.
"""

from __future__ import annotations

from pydantic import Field, model_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from engine.security import check_exposure


class DevEngineSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_DEV_ENGINE_", extra="ignore")

    model_path: str
    host: str = "127.0.0.1"
    port: int = Field(default=30000, ge=0, le=65535)
    api_key: str | None = None
    admin_api_key: str | None = None
    allow_unauthenticated: bool = False  # explicit opt-out of the key requirement on non-loopback hosts
    # SGLang's default served name is the model path; the router uses it as model_id.
    served_model_name: str | None = None
    seed: int = 0
    weight_version: str = "default"
    # One torch thread: the tiny model is overhead-bound and the CI box has 2 cores shared by many processes.
    torch_threads: int = Field(default=1, ge=1)
    # Prefix cache (SGLang's radix cache stand-in): KV of recent prompts held for reuse, bounded by prompt
    # tokens; 0 disables it (SGLang --disable-radix-cache).
    prefix_cache_max_tokens: int = Field(default=16384, ge=0)
    max_running_requests: int = Field(default=64, ge=1)
    # Hostile-input guards (engine.http_guard): body size (413 while reading), JSON nesting (400), and the
    # requests in flight at once (429 beyond; probes exempt).
    max_body_bytes: int = Field(default=64 * 1024 * 1024, ge=1024)
    max_json_depth: int = Field(default=64, ge=4, le=512)
    max_in_flight_requests: int = Field(default=1024, ge=1)
    # How long update_weights_from_disk waits for running (un-paused) requests before failing.
    update_wait_timeout_s: float = Field(default=60.0, gt=0)
    # Parse <think> blocks and <tool_call> blocks in chat responses (SGLang --reasoning-parser / --tool-call-parser).
    reasoning_parser: bool = True
    tool_call_parser: bool = True
    log_level: str = "info"
    log_json: bool = False  # JSON-lines logs (engine.observability) instead of plain text
    record_requests: str | None = None  # append every POST/PUT body to this JSON-lines file (recording.py)

    @model_validator(mode="after")
    def _check_exposure(self) -> DevEngineSettings:
        check_exposure("hindsight-dev-engine", self.host, self.api_key, allow_unauthenticated=self.allow_unauthenticated)
        return self
