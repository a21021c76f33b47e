"""Settings of the policy server: one pydantic-settings class, env prefix ``HINDSIGHT_POLICY_``.

Every field is also a CLI flag of ``hindsight-policy`` (``--model-path`` for ``model_path``; see
policy_server.cli), CLI values win over environment variables. Built once in ``main()`` (or by a
test) and passed to ``create_app(settings)``; never instantiated at import time.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.security import check_exposure


class PolicySettings(BaseSettings):
    """Resolved configuration; names carry units (``_s``, ``_bytes``)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_POLICY_", extra="ignore")

    # --- upstreams
    model_path: str = Field(..., description="policy tokenizer + chat template folder (HF layout)")
    engine_url: str = Field(..., description="policy engine or its sglang-router")
    engine_worker_urls: Annotated[list[str], NoDecode] = Field(default_factory=list,
                                          description="engines that get pause/update/continue (default: engine_url)")
    engine_api_key: str | None = None
    engine_admin_api_key: str | None = None
    judge_url: str | None = Field(None, description="judge service; without it no turn is judged (stays pending)")
    judge_api_key: str | None = None
    teacher_url: str | None = Field(None, description="teacher engine for opd/combine")
    teacher_api_key: str | None = None
    served_model_name: str = "hindsight-policy"

    # --- storage and reward modes
    data_dir: str = "./hindsight-data"
    mode: Literal["rl", "opd", "combine"] = "rl"
    w_rl: float = 1.0
    w_opd: float = 1.0
    prm_config: str | None = Field(None, description="PRM scorer YAML (docs/SCORERS.md): token_rewards for "
                                   "every accepted turn; see policy_server.rewards.scoring")
    prm_scope: Literal["turn", "session"] = Field(
        "turn", description="PRM scoring unit: turn (each accepted turn scored alone as soon as judged) or "
        "session (accepted turns held as pending_score until the session ends, then the whole session is "
        "scored at once with score_session); see policy_server.rewards.scoring")
    judge_m: int | None = None
    at_least_one: bool = True
    teacher_top_k: int = 0
    teacher_temperature: float = 1.0
    teacher_max_concurrency: int = 4
    teacher_deadline_s: float | None = None

    # --- serving
    host: str = "127.0.0.1"
    port: int = 30000
    api_key: str | None = None
    admin_api_key: str | None = None
    infer_sessions: bool = Field(False, description="continue the open session whose recorded transcript a "
                                 "request without a session id extends (policy_server.serving.session_inference)")
    allow_unauthenticated: bool = Field(False, description="serve a non-loopback host without an API key "
                                        "(only behind an authenticating gateway)")
    allow_client_key_for_admin: bool = Field(False, description="with an api_key and no admin_api_key, let the "
                                             "client key (held by every agent) open the admin routes; without "
                                             "this opt-out that configuration refuses to start")
    default_turn_type: Literal["main", "side"] = "main"
    session_idle_timeout_s: float = 600.0
    idle_sweep_interval_s: float = 1.0
    max_body_bytes: int = Field(8 * 1024 * 1024, description="largest request body on any route; 413 while "
                                "reading beyond it (engine.http_guard), before parsing or auth")
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted in a body (400 beyond)")
    default_max_tokens: int = 1024
    max_prompt_tokens: int | None = Field(None, ge=1, description="the engine's context length in tokens: a prompt "
                                          "that cannot fit is a 400 before it is rendered (default: the model's "
                                          "max_position_embeddings from config.json; no check when unknown)")
    default_temperature: float = Field(1.0, ge=0.0, le=2.0, description="temperature when the client sends none "
                                       "(OpenAI's default); always sent to the engine and recorded with the sample")
    max_concurrent_requests: int = Field(256, ge=1, description="requests in flight at once (probes exempt); "
                                         "429 with Retry-After beyond it; also sizes the engine connection pool")
    engine_deadline_s: float = 120.0
    engine_max_attempts: int = 5
    max_resumes: int = 8

    # --- weight sync
    pause_mode: Literal["abort", "retract", "in_place"] = "abort"
    gate_timeout_s: float = 120.0
    weight_update_deadline_s: float = 600.0

    # --- sample store / dispatch
    store_url: str | None = Field(
        None, description="sqlite:///DIR (default: the data dir's SQLite file, one process) or "
        "postgresql://user@host:port/db (shared by several replicas; see docs/SCALING.md)")
    store_pool_size: int = Field(8, ge=1, description="PostgreSQL connections per replica")
    replica_id: str | None = Field(
        None, description="name of this replica in judge work claims (default: host:port:pid)")
    dispatch_claim_s: float = Field(
        30.0, gt=0, description="how long a replica's claim on judge work lasts without renewal; a replica "
        "that died loses its claims after this and another replica finishes the work")
    store_synchronous: Literal["normal", "full"] = Field(
        "normal", description="SQLite WAL sync: normal survives a killed server process, full also an OS "
        "crash or power loss (fsync per commit); see policy_server.store")
    store_busy_timeout_s: float = Field(
        5.0, gt=0, description="longest wait for the store (its lock, or SQLite's write lock held by another "
        "connection); then the request is a 503 with Retry-After and /ready reports the store busy")
    lease_timeout_s: float = 600.0
    max_lease_size: int = 4096
    max_lease_wait_s: float = 60.0
    max_unconsumed_samples: int = 1_000_000
    dispatch_concurrency: int = 8
    dispatch_retry_initial_s: float = 0.5
    dispatch_retry_max_s: float = 30.0

    # --- shutdown (policy_server.serving.shutdown)
    shutdown_grace_s: float = Field(30.0, description="on SIGTERM, how long chat requests in flight may run on "
                                    "while new ones get 503")
    shutdown_drain_s: float = Field(10.0, description="then how long the dispatcher may keep judging; what is "
                                    "left stays pending_judge for the next start")

    log_level: str = "INFO"
    log_json: bool = Field(False, description="JSON log lines (engine.observability) instead of plain text")

    @field_validator("engine_worker_urls", mode="before")
    @classmethod
    def _split_urls(cls, v: object) -> object:
        if isinstance(v, str):
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("sqlite://", "postgresql://", "postgres://")):
            raise ValueError("store_url must start with sqlite:// or postgresql://")
        return v or None

    @field_validator("engine_url", "judge_url", "teacher_url")
    @classmethod
    def _strip_slash(cls, v: str | None) -> str | None:
        return v.rstrip("/") if v else v

    @model_validator(mode="after")
    def _defaults(self) -> PolicySettings:
        if not self.engine_worker_urls:
            self.engine_worker_urls = [self.engine_url]
        for name in ("session_idle_timeout_s", "gate_timeout_s", "lease_timeout_s", "engine_deadline_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        if self.max_body_bytes < 1024:
            raise ValueError("max_body_bytes must be >= 1024")
        check_exposure("hindsight-policy", self.host, self.api_key, allow_unauthenticated=self.allow_unauthenticated)
        if self.api_key and not self.admin_api_key and not self.allow_client_key_for_admin:
            raise ValueError("an api_key without an admin_api_key would let every agent's client key lease samples, "
                             "change the mode and load weights: set --admin-api-key (or pass "
                             "--allow-client-key-for-admin true to accept that)")
        return self
