"""Settings of the policy server: one pydantic-settings class, env prefix ``HINDSIGHT_POLICY_``.

Every field is also a flag of ``hindsight-policy`` (``--model-path`` for ``model_path``) and may be set
in a ``--config`` file (engine.cli_settings): flags > environment > config file > defaults. Built once in
``main()`` (or by a test) and passed to ``create_app(settings)``; never instantiated at import time.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from engine.cli_settings import CliSettings
from engine.sample_values import TEACHER_TEMPERATURE
from engine.security import check_exposure
from engine.sequential import DEFAULT_ALPHA, DEFAULT_MARGIN, DEFAULT_MIN_SESSIONS


class PolicySettings(CliSettings):
    """Resolved configuration; names carry units (``_s``, ``_bytes``)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_POLICY_", extra="ignore")

    # --- upstreams
    model_path: str = Field(..., description="policy tokenizer + chat template folder (HF layout)")
    engine_url: str = Field(..., description="policy engine or its sglang-router")
    engine_worker_urls: Annotated[list[str], NoDecode] = Field(
        default_factory=list, description="comma-separated engines that get pause/update/continue (default: engine_url)"
    )
    engine_api_key: str | None = Field(None, description="bearer key of the policy engine")
    engine_admin_api_key: str | None = Field(
        None, description="bearer key of the engine's admin routes (pause, weight update); default: engine_api_key"
    )
    judge_url: str | None = Field(None, description="judge service; without it no turn is judged (stays pending)")
    judge_api_key: str | None = Field(None, description="bearer key of the judge service")
    teacher_url: str | None = Field(
        None,
        description="teacher engine for opd/combine (e.g. the judge engines' router); without one their turns "
        "are rejected no_teacher",
    )
    teacher_api_key: str | None = Field(None, description="bearer key of the teacher engine")
    served_model_name: str = Field(
        "hindsight-policy", description="model name listed by /v1/models and echoed in responses"
    )
    model_aliases: Annotated[list[str], NoDecode] = Field(
        default_factory=list,
        description="comma-separated further model names accepted for the served model (clients that insist "
        "on a name of their own); any other name is a 404 model_not_found",
    )

    # --- storage and reward modes
    data_dir: str = Field("./hindsight-data", description="folder of the SQLite store and the persisted mode")
    mode: Literal["rl", "opd", "combine"] = Field(
        "rl", description="reward mode at first start (then the persisted one; /admin/mode changes it)"
    )
    w_rl: float = Field(1.0, description="weight of the RL (judge) term in combine mode")
    w_opd: float = Field(1.0, description="weight of the OPD (teacher) term in combine mode")
    prm_config: str | None = Field(
        None,
        description="PRM scorer YAML (docs/SCORERS.md): token_rewards for "
        "every accepted turn; see policy_server.rewards.scoring",
    )
    prm_scope: Literal["turn", "session"] = Field(
        "turn",
        description="PRM scoring unit: turn (each accepted turn scored alone as soon as judged) or "
        "session (accepted turns held as pending_score until the session ends, then the whole session is "
        "scored at once with score_session); see policy_server.rewards.scoring",
    )
    judge_m: int | None = Field(None, description="votes per judge call (default: the judge's own m)")
    at_least_one: bool = Field(
        True,
        description="include a neutral turn when its session has no included turn "
        "yet, so every session trains on at least one turn",
    )
    feedback_policy: Literal["override", "average", "gate"] = Field(
        "override",
        description="how explicit feedback (POST /v1/feedback) combines with the judge's verdict: override "
        "(reward = feedback), average ((judge + feedback) / 2) or gate (the judge's +-1 only when the "
        "feedback agrees); docs/REWARD_MODES.md",
    )
    feedback_hint: bool = Field(
        True, description="use a feedback's text as the turn's OPD hint (opd/combine) instead of extracting one"
    )
    # 200 pairs: near 0.8 agreement the share's standard error is 0.028, so a 10-point drift stands out at
    # about 3.5 sigma, while at tens of feedbacks an hour the window still turns over within a working day.
    feedback_agreement_window: int = Field(
        200,
        ge=1,
        description="judged turns with explicit feedback (the latest) over which /metrics reports the "
        "judge/feedback agreement (docs/OBSERVABILITY.md)",
    )
    teacher_top_k: int = Field(
        0, description="top-K teacher log-probs recorded per token (0: only the sampled token's)"
    )
    teacher_temperature: float = Field(
        1.0, description="temperature of the teacher's log-probs (only 1.0: the OPD term is derived at T = 1)"
    )
    teacher_max_concurrency: int = Field(4, description="teacher calls in flight at once")
    teacher_deadline_s: float | None = Field(
        None,
        description="total time one teacher call may take, retries included (default: none beyond the call timeouts)",
    )

    # --- serving
    host: str = Field("127.0.0.1", description="address to listen on; beyond loopback an api_key is required")
    port: int = Field(30000, description="port to listen on (launch's POLICY_PORT)")
    api_key: str | None = Field(None, description="bearer key agents send on /v1/*")
    admin_api_key: str | None = Field(None, description="bearer key of /admin/* and the sample lease routes")
    infer_sessions: bool = Field(
        True,
        description="continue the open session whose recorded transcript a request without any session id "
        "or hint extends (policy_server.serving.session_inference); off: such requests are not recorded",
    )
    split_diverged_sessions: bool = Field(
        True,
        description="a session key (header or client hint) names a family of sessions: a request that "
        "continues none of its open sessions starts a new one instead of rejecting a turn as history_mismatch "
        "(policy_server.serving.identity)",
    )
    side_rules_file: str | None = Field(
        None,
        description="JSON/YAML side-turn rules tried before the shipped ones (policy_server.serving.side_rules)",
    )
    secret_patterns_path: str | None = Field(
        None,
        description="YAML secret patterns redacted on top of the shipped ones (policy_server.serving.secrets)",
    )
    consumed_text_retention_s: float | None = Field(
        None,
        gt=0,
        description="seconds the raw text of a sample that will never be trained is kept once consumed or rejected, "
        "and of its session once all its samples are (None: kept; policy_server.store.retention)",
    )
    side_turn_retention_s: float | None = Field(
        None, gt=0, description="seconds a side turn (opt_out included) is kept (None: kept)"
    )
    retention_sweep_interval_s: float = Field(
        5.0, gt=0, description="seconds between retention sweeps (bench.retention; docs/USERS_DATA.md)"
    )
    allow_unauthenticated: bool = Field(
        False, description="serve a non-loopback host without an API key (only behind an authenticating gateway)"
    )
    allow_client_key_for_admin: bool = Field(
        False,
        description="with an api_key and no admin_api_key, let the "
        "client key (held by every agent) open the admin routes; without "
        "this opt-out that configuration refuses to start",
    )
    default_turn_type: Literal["main", "side"] = Field(
        "main", description="turn type of a request that sends no X-Turn-Type header (main or side)"
    )
    session_idle_timeout_s: float = Field(
        600.0, description="a session without a request for this long is closed and its last turn judged"
    )
    idle_sweep_interval_s: float = Field(1.0, description="how often idle sessions are looked for")
    max_body_bytes: int = Field(
        8 * 1024 * 1024,
        description="largest request body on any route; 413 while "
        "reading beyond it (engine.http_guard), before parsing or auth",
    )
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted in a body (400 beyond)")
    default_max_tokens: int = Field(1024, description="max_tokens when the client sends none")
    max_prompt_tokens: int | None = Field(
        None,
        ge=1,
        description="the engine's context length in tokens: a prompt "
        "that cannot fit is a 400 before it is rendered (default: the model's "
        "max_position_embeddings from config.json; no check when unknown)",
    )
    render_concurrency: int = Field(
        2,
        ge=1,
        le=64,
        description="chat prompts rendered and tokenized in worker threads at once (the rest wait, off the "
        "event loop); short prompts render inline",
    )
    default_temperature: float = Field(
        1.0,
        ge=0.0,
        le=2.0,
        description="temperature when the client sends none "
        "(OpenAI's default); always sent to the engine and recorded with the sample",
    )
    max_concurrent_requests: int = Field(
        256,
        ge=1,
        description="requests in flight at once (probes exempt); "
        "429 with Retry-After beyond it; also sizes the engine connection pool",
    )
    engine_deadline_s: float = Field(120.0, description="total time one engine call may take, retries included")
    engine_max_attempts: int = Field(5, description="tries of one engine call before it fails")
    max_resumes: int = Field(8, description="times a generation aborted by a weight update is resumed")
    history: Literal["sampled", "template"] = Field(
        "sampled",
        description="how a continuing turn's history reaches the model: sampled (every earlier turn exactly as it "
        "was sent and sampled, reasoning and tool-call markup included; only the new messages are rendered, in "
        "the template's format) or template (the chat template renders the whole conversation each turn, as "
        "the model card intends; it may drop earlier reasoning, so the sampled ids are re-tokenized). "
        "docs/LONG_SESSIONS.md",
    )
    chat_template: str | None = Field(
        None, description="a chat template file (.jinja) used instead of the one in model_path (SGLang --chat-template)"
    )
    tool_call_parser: (
        Literal["qwen25", "hermes", "llama3", "mistral", "deepseekv3", "deepseekv31", "kimi_k2", "gpt-oss"] | None
    ) = Field(
        None, description="markup of the model's tool calls (SGLang's names); default: detected from the template"
    )
    reasoning_parser: Literal["qwen3", "deepseek-r1", "gpt-oss", "none"] | None = Field(
        None,
        description="markup of the model's reasoning (SGLang's names; none: no reasoning split); default: detected",
    )
    render_verify_tokens_per_turn: int = Field(
        2048,
        ge=0,
        description="budget of the check of token-continued prompts against a full render of the template, in "
        "history tokens per turn: a turn is checked when the budget covers its history, so the check costs the "
        "same CPU per turn at any history length (0: never; a huge value: every turn). A mismatch turns that "
        "path off for that conversation shape: an append-only turn then continues over the rewrite (history "
        "sampled) or is rendered whole; a turn continued over a rewrite is rendered whole",
    )

    # --- weight sync
    pause_mode: Literal["abort", "retract", "in_place"] = Field(
        "abort", description="how engines pause for a weight update (SGLang pause_generation mode)"
    )
    gate_timeout_s: float = Field(120.0, description="longest a request waits at the gate while weights update")
    weight_update_deadline_s: float = Field(
        600.0, description="total time of one weight update (pause, load, continue on every worker)"
    )
    # Off by default so a pushed version goes live at once, as before the ledger; on, every push must prove
    # itself (docs/SAFE_UPDATES.md).
    safe_updates: bool = Field(
        False,
        description="a pushed weight version becomes canary, served to a share of new sessions (every session "
        "with one engine) until the sequential test or POST /admin/weights/promote|rollback decides; off: it "
        "goes live at once (the ledger records it either way)",
    )
    # The canary defaults: chosen by bench/canary_defaults.py (the rule and figures in docs/SAFE_UPDATES.md).
    canary_share: float = Field(
        0.2, gt=0, le=1, description="share of new sessions the canary engine serves (two or more engines)"
    )
    canary_alpha: float = Field(
        DEFAULT_ALPHA,
        gt=0,
        lt=1,
        description="error rate of the canary test: a not-worse canary is rolled back (and a "
        "canary worse by the margin promoted) with at most this probability, however long it runs",
    )
    canary_margin: float = Field(
        DEFAULT_MARGIN,
        ge=0,
        le=2,
        description="how much lower (reward in [-1, 1]) a canary may be and still count as not worse",
    )
    canary_min_sessions: int = Field(
        DEFAULT_MIN_SESSIONS, ge=1, description="judged canary sessions before a promotion"
    )
    canary_max_sessions: int | None = Field(
        None, ge=1, description="judged canary sessions after which an undecided canary is rolled back (none: no cap)"
    )
    canary_reference_sessions: int = Field(
        200, ge=1, description="with one engine: the live version's last sessions the canary is compared with"
    )
    canary_check_interval_s: float = Field(1.0, gt=0, description="how often the canary test looks at the rewards")
    canary_drain_s: float = Field(
        120.0,
        ge=0,
        description="after a decision, the longest the transition waits for the losing version's open sessions to "
        "close (new sessions already get the surviving version); sessions still open then change version",
    )

    # --- sample store / dispatch
    store_url: str | None = Field(
        None,
        description="sqlite:///DIR (default: the data dir's SQLite file, one process) or "
        "postgresql://user@host:port/db (shared by several replicas; see docs/SCALING.md)",
    )
    store_pool_size: int = Field(8, ge=1, description="PostgreSQL connections per replica")
    replica_id: str | None = Field(
        None, description="name of this replica in judge work claims (default: host:port:pid)"
    )
    dispatch_claim_s: float = Field(
        30.0,
        gt=0,
        description="how long a replica's claim on judge work lasts without renewal; a replica "
        "that died loses its claims after this and another replica finishes the work",
    )
    store_synchronous: Literal["normal", "full"] = Field(
        "normal",
        description="SQLite WAL sync: normal survives a killed server process, full also an OS "
        "crash or power loss (fsync per commit); see policy_server.store",
    )
    store_busy_timeout_s: float = Field(
        5.0,
        gt=0,
        description="longest wait for the store (its lock, or SQLite's write lock held by another "
        "connection); then the request is a 503 with Retry-After and /ready reports the store busy",
    )
    lease_timeout_s: float = Field(600.0, description="a leased sample not acked within this returns to the pool")
    max_lease_size: int = Field(4096, description="most samples one lease call may take")
    max_lease_wait_s: float = Field(60.0, description="longest wait_s a lease call may ask for")
    max_unconsumed_samples: int = Field(
        1_000_000, description="samples not yet consumed by the trainer before new main turns are refused (429)"
    )
    dispatch_concurrency: int = Field(8, description="judge calls in flight at once")
    dispatch_retry_initial_s: float = Field(0.5, description="first backoff after a failed judge call")
    dispatch_retry_max_s: float = Field(30.0, description="longest backoff between judge call retries")

    # --- shutdown (policy_server.serving.shutdown)
    shutdown_grace_s: float = Field(
        30.0, description="on SIGTERM, how long chat requests in flight may run on while new ones get 503"
    )
    shutdown_drain_s: float = Field(
        10.0,
        description="then how long the dispatcher may keep judging; what is "
        "left stays pending_judge for the next start",
    )

    log_level: str = Field("INFO", description="log level (DEBUG, INFO, WARNING, ERROR)")
    log_json: bool = Field(False, description="JSON log lines (engine.observability) instead of plain text")

    @field_validator("engine_worker_urls", "model_aliases", mode="before")
    @classmethod
    def _split_urls(cls, v: object) -> object:
        if isinstance(v, str):
            return [u.strip() for u in v.split(",") if u.strip()]
        return v

    @field_validator("chat_template")
    @classmethod
    def _template_file(cls, v: str | None) -> str | None:
        if v is not None and not Path(v).is_file():
            raise ValueError(f"chat_template {v!r} is not a file")
        return v

    @field_validator("store_url")
    @classmethod
    def _store_scheme(cls, v: str | None) -> str | None:
        if v and not v.startswith(("sqlite://", "postgresql://", "postgres://")):
            raise ValueError("store_url must start with sqlite:// or postgresql://")
        return v or None

    @field_validator("teacher_temperature")
    @classmethod
    def _teacher_t1(cls, v: float) -> float:
        # teacher - policy at T = 1 is the reverse-KL gradient towards the teacher itself; a tempered teacher
        # moves the target (docs/REWARD_MODES.md "Teacher temperature").
        if v != TEACHER_TEMPERATURE:
            raise ValueError(f"teacher_temperature must be {TEACHER_TEMPERATURE} (got {v})")
        return v

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
            raise ValueError(
                "an api_key without an admin_api_key would let every agent's client key lease samples, "
                "change the mode and load weights: set --admin-api-key (or pass "
                "--allow-client-key-for-admin true to accept that)"
            )
        return self
