"""The policy server's running components, built once by the app's lifespan and read by every route.

Routes take this state from ``request.app.state.policy``; keeping its type here (not in the composition
root) lets the routes import it without importing the app that includes them.
"""

from __future__ import annotations

from dataclasses import dataclass

from engine.client import EngineClient
from policy_server.metrics import Metrics
from policy_server.rewards.dispatch import Dispatcher
from policy_server.rewards.modes import ModeState, RewardPipeline
from policy_server.rewards.scoring import PRMScoring
from policy_server.serving.canary import Canary
from policy_server.serving.deletion_tokens import DeletionTokens
from policy_server.serving.generation import Generator
from policy_server.serving.identity import SessionResolver
from policy_server.serving.secrets import SecretScanner
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.side_rules import SideRules
from policy_server.serving.versions import VersionControl
from policy_server.serving.weight_sync import WeightGate, WeightSync
from policy_server.settings import PolicySettings
from policy_server.store import SampleStore
from policy_server.store.ready_notifier import ReadyNotifier


@dataclass
class PolicyState:
    settings: PolicySettings
    store: SampleStore
    engine: EngineClient
    generator: Generator
    gate: WeightGate
    weight_sync: WeightSync
    sessions: SessionTracker
    dispatcher: Dispatcher
    metrics: Metrics
    mode_state: ModeState
    pipeline: RewardPipeline | None
    backlog_cache: list[float]  # [value, checked_at_monotonic]
    scoring: PRMScoring | None = None
    ready: ReadyNotifier | None = None  # wakes lease waiters when samples become ready
    resolver: SessionResolver | None = None  # every request's session (policy_server.serving.identity)
    side_rules: SideRules | None = None  # which header-less requests are side (policy_server.serving.side_rules)
    secrets: SecretScanner | None = None  # redacts secrets before the store (policy_server.serving.secrets)
    deletion_tokens: DeletionTokens | None = None  # clients delete their own sessions (serving.deletion_tokens)
    versions: VersionControl | None = None  # the weight-version ledger's pushes, promotions, rollbacks
    canary: Canary | None = None  # session pins, canary routing and the automatic decision (--safe-updates)
