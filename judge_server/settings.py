"""Settings of the judge service: one pydantic-settings class, env prefix ``HINDSIGHT_JUDGE_``.

Built once in ``cli.main`` (or by a test) and passed to ``create_app(settings)``; never read at import.
Keyword lists of the rules backend are settings too (comma-separated or JSON lists in the environment).
"""

from __future__ import annotations

import json
from typing import Annotated, Literal

from pydantic import Field, field_validator, model_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from engine.security import check_exposure

DEFAULT_POSITIVE = ["thanks", "thank you", "worked", "works", "great", "perfect", "correct"]
DEFAULT_NEGATIVE = ["wrong", "not what", "redo", "incorrect", "error", "failed", "no,"]


class JudgeSettings(BaseSettings):
    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_JUDGE_", extra="ignore")

    # --- service
    host: str = "127.0.0.1"
    port: int = 8100
    api_key: str | None = None  # Bearer key for /v1/*, /get_reward, /slime/*; /health, /ready, /metrics stay open
    backend: Literal["llm", "rules"] = "llm"
    allow_unauthenticated: bool = False  # explicit opt-out of the key requirement on non-loopback hosts

    # --- judge engine (an SGLang engine or sglang-router)
    engine_url: str | None = None
    engine_api_key: str | None = None
    tokenizer_path: str | None = None  # judge tokenizer; else model_info's tokenizer_path if local; else text mode
    engine_connect_timeout_s: float = 5.0
    engine_read_timeout_s: float = 300.0
    engine_max_attempts: int = 4
    engine_initial_backoff_s: float = 0.2
    engine_max_backoff_s: float = 2.0

    # --- prompts and sampling
    prm_template: str = "prm_eval_v2"
    hint_template: str = "hint_extract_v2"
    templates_dir: str | None = None
    temperature: float = 0.6
    top_p: float = 1.0
    max_new_tokens: int = 2048
    # Reproducibility only; rounds use seed + round index. Beware: engines seed all n samples of one call
    # alike, so a fixed seed makes the votes of a round identical (no noise control): leave unset to vote.
    sampling_seed: int | None = None
    constrain_output: bool = False  # send the <template>.regex.txt constraint with every judge call
    reasoning_max_chars: int = 1500
    hint_max_chars: int = 600
    include_reasoning: bool = False  # show the judged turn's reasoning_content to the judge
    context_budget_tokens: int = 3000
    part_budget_tokens: int = 2000
    # One prefill per turn: prefill the PRM and hint prompts' common prefix once before both tasks run.
    prefill_shared_prefix: bool = True
    shared_prefix_min_tokens: int = 64  # below this the extra engine call costs more than it saves

    # --- voting
    m: int = 3
    policy: Literal["fixed", "adaptive", "sequential"] = "fixed"
    m_max: int = 7
    min_valid: int = 1
    escalate_step: int = 2
    # sequential policy. error_budget (default): stop at the fewest expected votes whose expected error, under
    # the vote noise estimated online from this service's own turns, is at most error_budget_share times fixed
    # m-vote voting's (vote_model.py). change_prob: stop once P(the votes left of the m-vote budget change the
    # result) < stop_change_prob, under a symmetric Dirichlet(stop_prior) belief over the verdict shares.
    sequential_stop_rule: Literal["error_budget", "change_prob"] = "error_budget"
    error_budget_share: float = Field(default=1.0, gt=0, le=1)
    # the vote-noise estimate (agreement, unparseable share, wrong-vote concentration) from the last
    # agreement_window_turns turns per task, blended with this warm-up default (symmetric wrong votes) worth
    # agreement_prior_turns turns, so a new instance starts at the default; 5000 turns keep a skew test's
    # standard error near 0.01
    default_agreement: float = Field(default=0.85, gt=0.5, lt=1)
    default_unparseable: float = Field(default=0.05, ge=0, lt=0.9)
    agreement_prior_turns: int = Field(default=50, ge=1)
    agreement_window_turns: int = Field(default=5000, ge=1)
    stop_change_prob: float = Field(default=0.1, gt=0, le=1)
    stop_prior: float = Field(default=0.5, gt=0)
    sequential_first_round: int = Field(default=2, ge=1)
    hint_min_chars: int = 10  # prior rule: accepted hint strictly longer than this
    hint_require_majority: bool = False

    # --- limits
    max_concurrent_engine_calls: int = 32
    request_deadline_s: float = 120.0
    max_batch_items: int = 256
    max_context_messages: int = 512
    max_request_chars: int = Field(1_000_000, description="largest request body in bytes on any route; 413 while "
                                   "reading beyond it, before parsing or auth (engine.http_guard)")
    max_json_depth: int = Field(64, ge=4, le=512, description="deepest JSON nesting accepted in a body (400 beyond)")
    max_in_flight_requests: int = Field(512, ge=1, description="requests in flight at once (probes exempt); "
                                        "429 with Retry-After beyond it")
    max_m: int = 16

    # --- reward-client routes (/get_reward, /slime/reward): the reward of a judge_failed item. None (default):
    # answer 503 so the client retries; a number: answer it, flagged judge_failed (a documented fallback).
    compat_failed_reward: float | None = Field(default=None, allow_inf_nan=False)

    # --- rules backend keywords (case-insensitive; matched on word boundaries where the keyword starts/ends
    # with a letter)
    rules_positive: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(DEFAULT_POSITIVE))
    rules_negative: Annotated[list[str], NoDecode] = Field(default_factory=lambda: list(DEFAULT_NEGATIVE))

    @field_validator("rules_positive", "rules_negative", mode="before")
    @classmethod
    def _split_csv(cls, v: object) -> object:
        if isinstance(v, str):
            if v.lstrip().startswith("["):
                return json.loads(v)
            return [x.strip() for x in v.split(",") if x.strip()]
        return v

    @model_validator(mode="after")
    def _check(self) -> JudgeSettings:
        if self.backend == "llm" and not self.engine_url:
            raise ValueError("backend 'llm' needs engine_url (--engine-url / HINDSIGHT_JUDGE_ENGINE_URL)")
        if not 1 <= self.m <= self.max_m or not self.m <= self.m_max:
            raise ValueError(f"need 1 <= m <= m_max and m <= max_m (m={self.m}, m_max={self.m_max})")
        if self.min_valid < 1:
            raise ValueError("min_valid must be >= 1")
        check_exposure("hindsight-judge", self.host, self.api_key, allow_unauthenticated=self.allow_unauthenticated)
        return self
