"""Settings of the judge service: one pydantic-settings class, env prefix ``HINDSIGHT_JUDGE_``.

Every field is also a flag of ``hindsight-judge`` and may be set in a ``--config`` file (engine.cli_settings):
flags > environment > config file > defaults. Built once in ``cli.main`` (or by a test) and passed to
``create_app(settings)``; never read at import.
Keyword lists of the rules backend are settings too (comma-separated or JSON lists in the environment), and so
is the guard configuration (``--guards tool_error=override,degenerate=quarantine``, env ``HINDSIGHT_JUDGE_GUARDS``).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import NoDecode, SettingsConfigDict

from engine.cli_settings import CliSettings
from engine.security import check_exposure
from judge_server import voting
from judge_server.guards import GUARD_RULES, parse_guard_actions

DEFAULT_POSITIVE = ["thanks", "thank you", "worked", "works", "great", "perfect", "correct"]
DEFAULT_NEGATIVE = ["wrong", "not what", "redo", "incorrect", "error", "failed", "no,"]


class JudgeSettings(CliSettings):
    """Resolved configuration of the judge service; names carry units (``_s``, ``_tokens``, ``_chars``)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_JUDGE_", extra="ignore")

    # --- service
    host: str = Field("127.0.0.1", description="address to listen on; beyond loopback an api_key is required")
    port: int = Field(30200, description="port to listen on (launch/judge.sh's JUDGE_PORT)")
    api_key: str | None = Field(
        None, description="bearer key for /v1/*, /get_reward and /slime/*; /health, /ready and /metrics stay open"
    )
    backend: Literal["llm", "openai", "rules"] = Field(
        "llm",
        description="llm (votes of an SGLang judge engine's /generate), openai (any OpenAI-compatible "
        "/v1/chat/completions: --base-url, --model) or rules (keyword matching, no engine; for development)",
    )
    allow_unauthenticated: bool = Field(
        False, description="serve a non-loopback host without an API key (only behind an authenticating gateway)"
    )

    # --- judge engine (an SGLang engine or sglang-router)
    engine_url: str | None = Field(None, description="judge engine or its sglang-router (needed by backend llm)")
    engine_api_key: str | None = Field(None, description="bearer key of the judge engine")
    tokenizer_path: str | None = Field(
        None,
        description="judge tokenizer folder (default: the engine's "
        "model_info tokenizer_path when local; else text mode)",
    )
    # --- OpenAI-compatible judge endpoint (backend openai; docs/JUDGE_BACKENDS.md)
    base_url: str | None = Field(
        None, description="backend openai: the endpoint's base URL (with or without the trailing /v1)"
    )
    model: str | None = Field(None, description="backend openai: the judge model's name at that endpoint")
    api_key_file: str | None = Field(
        None, description="backend openai: file holding the endpoint's API key (never on argv; also --engine-api-key)"
    )
    openai_n: Literal["auto", "on", "off"] = Field(
        "auto", description="backend openai: k votes as one request with n=k (on), k requests (off) or detect (auto)"
    )
    openai_constraint: Literal["auto", "regex", "structured_outputs", "guided_regex", "none"] = Field(
        "auto",
        description="backend openai, with --constrain-output: how the verdict regex is sent (regex: SGLang; "
        "structured_outputs: vLLM >= 0.10; guided_regex: older vLLM; auto: regex, dropped if refused)",
    )
    openai_reask_max: int = Field(
        1, ge=0, le=3, description="backend openai: re-asks of a vote whose answer does not parse"
    )
    engine_connect_timeout_s: float = Field(5.0, description="connect timeout of one engine call")
    engine_read_timeout_s: float = Field(300.0, description="read timeout of one engine call")
    engine_max_attempts: int = Field(4, description="tries of one engine call before it fails")
    engine_initial_backoff_s: float = Field(0.2, description="first backoff between engine call retries")
    engine_max_backoff_s: float = Field(2.0, description="longest backoff between engine call retries")

    # --- prompts and sampling
    prm_template: str = Field("prm_eval_v2", description="PRM prompt template name (prompts/templates)")
    hint_template: str = Field("hint_extract_v2", description="hint prompt template name (prompts/templates)")
    templates_dir: str | None = Field(None, description="folder searched for templates before the built-in ones")
    temperature: float = Field(0.6, description="sampling temperature of the judge votes")
    top_p: float = Field(1.0, description="nucleus sampling top_p of the judge votes")
    max_new_tokens: int = Field(2048, description="most tokens one vote may generate")
    # Engines seed all n samples of one call alike, so a fixed seed makes the votes of a round identical.
    sampling_seed: int | None = Field(
        None,
        description="reproducibility only (rounds use seed + round "
        "index); a fixed seed makes a round's votes identical: leave unset to vote",
    )
    constrain_output: bool = Field(False, description="send the <template>.regex.txt constraint with every judge call")
    reasoning_max_chars: int = Field(1500, description="longest reasoning the output constraint allows a vote")
    hint_max_chars: int = Field(600, description="longest hint the output constraint allows a vote")
    include_reasoning: bool = Field(False, description="show the judged turn's reasoning_content to the judge")
    context_budget_tokens: int = Field(3000, description="tokens of conversation context shown to the judge")
    part_budget_tokens: int = Field(2000, description="tokens of any one message part shown to the judge")
    prefill_shared_prefix: bool = Field(
        True,
        description="prefill the PRM and hint prompts' common prefix once before both tasks run (one prefill per turn)",
    )
    shared_prefix_min_tokens: int = Field(
        64,
        description="shortest common prefix worth that extra engine call (below it the call costs more than it saves)",
    )

    # --- voting
    m: int = Field(3, description="votes per task and turn (the fixed policy's budget)")
    policy: Literal["fixed", "adaptive", "sequential"] = Field(
        "fixed",
        description="voting policy: fixed (m votes), adaptive (stop once the outcome is settled; a split"
        "result escalates up to m_max) or sequential (stop early by sequential_stop_rule)",
    )
    m_max: int = Field(7, description="most votes the adaptive policy escalates to")
    min_valid: int = Field(
        voting.MIN_VALID, description="fewest parseable votes for a verdict; fewer gives no_valid_votes (score 0)"
    )
    escalate_step: int = Field(voting.ESCALATE_STEP, description="votes added per adaptive escalation")
    # sequential policy. error_budget: stop at the fewest expected votes whose expected error, under the vote
    # noise estimated online from this service's own turns, is at most error_budget_share times fixed m-vote
    # voting's (vote_model.py). change_prob: stop once P(the votes left of the m-vote budget change the
    # result) < stop_change_prob, under a symmetric Dirichlet(stop_prior) belief over the verdict shares.
    sequential_stop_rule: voting.StopRule = Field(
        voting.STOP_RULE,
        description="sequential policy's stop rule: error_budget (expected error within "
        "error_budget_share of m-vote voting's) or change_prob (remaining votes unlikely to change the result)",
    )
    error_budget_share: float = Field(
        default=voting.ERROR_BUDGET_SHARE,
        gt=0,
        le=1,
        description="error_budget rule: allowed expected error as a share of fixed m-vote voting's",
    )
    # The vote-noise estimate (agreement, unparseable share, wrong-vote concentration) from the last
    # agreement_window_turns turns per task, blended with this warm-up default (symmetric wrong votes) worth
    # agreement_prior_turns turns, so a new instance starts at the default; 5000 turns keep a skew test's
    # standard error near 0.01.
    default_agreement: float = Field(
        default=0.85, gt=0.5, lt=1, description="warm-up vote agreement of the vote-noise estimate"
    )
    default_unparseable: float = Field(
        default=0.05, ge=0, lt=0.9, description="warm-up share of unparseable votes of the vote-noise estimate"
    )
    agreement_prior_turns: int = Field(
        default=50, ge=1, description="turns the warm-up defaults weigh in the vote-noise estimate"
    )
    agreement_window_turns: int = Field(
        default=5000, ge=1, description="recent turns per task the vote-noise estimate is measured on"
    )
    stop_change_prob: float = Field(
        default=voting.STOP_CHANGE_PROB,
        gt=0,
        le=1,
        description="change_prob rule: stop once the remaining votes change the result with less than this probability",
    )
    stop_prior: float = Field(
        default=voting.STOP_PRIOR,
        gt=0,
        description="change_prob rule: symmetric Dirichlet prior over the verdict shares",
    )
    sequential_first_round: int = Field(
        default=voting.FIRST_ROUND, ge=1, description="votes of the sequential policy's first round"
    )
    hint_min_chars: int = Field(10, description="an accepted hint is strictly longer than this")
    hint_require_majority: bool = Field(False, description="take a hint only when the vote result is ok with score 1")

    # --- limits
    max_concurrent_engine_calls: int = Field(32, description="engine calls in flight at once")
    request_deadline_s: float = Field(120.0, description="total time one judge request may take")
    max_batch_items: int = Field(256, description="most items in one batch request (413 beyond)")
    max_context_messages: int = Field(512, description="most messages in one judged context (413 beyond)")
    max_request_chars: int = Field(
        1_000_000,
        description="largest request body in characters (of its UTF-8 text) on any route; 413 while "
        "reading beyond 4 bytes a character, else once counted, before parsing or auth (engine.http_guard)",
    )
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted in a body (400 beyond)")
    max_in_flight_requests: int = Field(
        512, ge=1, description="requests in flight at once (probes exempt); 429 with Retry-After beyond it"
    )
    max_m: int = Field(16, description="largest m a request may ask for")

    # --- reward-client routes (/get_reward, /slime/reward)
    compat_failed_reward: float | None = Field(
        default=None,
        allow_inf_nan=False,
        description="reward of a judge_failed item on /get_reward and "
        "/slime/reward, flagged judge_failed (default: answer 503 so the client retries)",
    )

    # --- rules backend keywords (case-insensitive; matched on word boundaries where the keyword starts/ends
    # with a letter)
    rules_positive: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_POSITIVE),
        description="rules backend: keywords of a satisfied user (comma-separated or a JSON list)",
    )
    rules_negative: Annotated[list[str], NoDecode] = Field(
        default_factory=lambda: list(DEFAULT_NEGATIVE),
        description="rules backend: keywords of a dissatisfied user (comma-separated or a JSON list)",
    )

    # --- deterministic guards (judge_server.guards): run beside the votes on every request
    guards: Annotated[dict[str, str], NoDecode] = Field(
        default_factory=lambda: {r: str(a) for r, a in parse_guard_actions(None).items()},
        description="guard actions as rule=action items over the measured defaults (rules: "
        + ", ".join(GUARD_RULES)
        + "; actions: override, abstain, quarantine, off; a bare rule takes its natural action), "
        "e.g. tool_error=override,degenerate=quarantine",
    )

    log_level: str = Field("info", description="log level (debug, info, warning, error)")
    log_json: bool = Field(False, description="JSON log lines (engine.observability) instead of plain text")

    @field_validator("rules_positive", "rules_negative", mode="before")
    @classmethod
    def _split_csv(cls, v: object) -> object:
        if isinstance(v, str):
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @field_validator("guards", mode="before")
    @classmethod
    def _parse_guards(cls, v: object) -> object:
        # An unknown rule or action is a startup error naming it (parse_guard_actions' ValueError).
        if v is None or isinstance(v, str | dict):
            return dict(parse_guard_actions(v))
        return v

    @model_validator(mode="after")
    def _check(self) -> JudgeSettings:
        if self.backend == "openai" and not (self.base_url and self.model):
            raise ValueError("backend 'openai' needs base_url and model (--base-url, --model)")
        if self.backend == "llm" and not self.engine_url:
            raise ValueError("backend 'llm' needs engine_url (--engine-url / HINDSIGHT_JUDGE_ENGINE_URL)")
        if not 1 <= self.m <= self.max_m or not self.m <= self.m_max:
            raise ValueError(f"need 1 <= m <= m_max and m <= max_m (m={self.m}, m_max={self.m_max})")
        if self.min_valid < 1:
            raise ValueError("min_valid must be >= 1")
        check_exposure("hindsight-judge", self.host, self.api_key, allow_unauthenticated=self.allow_unauthenticated)
        return self
