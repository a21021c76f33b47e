"""What the serving layer reads of the policy server's running components: :class:`ServingState`.

The app's ``policy_server.state.PolicyState`` (built by the lifespan) has every field below; the serving
modules (chat_turn, undelivered) take this narrower view instead, so serving depends on its own parts and
the shared leaves (settings, metrics, store), never on the state that assembles serving, rewards and the API.
"""

from __future__ import annotations

from typing import Protocol

from policy_server.metrics import Metrics
from policy_server.serving.canary import Canary
from policy_server.serving.deletion_tokens import DeletionTokens
from policy_server.serving.generation import Generator
from policy_server.serving.identity import SessionResolver
from policy_server.serving.secrets import SecretScanner
from policy_server.serving.sessions import SessionTracker
from policy_server.serving.side_rules import SideRules
from policy_server.serving.weight_sync import WeightSync
from policy_server.settings import PolicySettings
from policy_server.store import SampleStore


class ServingState(Protocol):
    """The components one chat turn uses (policy_server.state.PolicyState's fields of the same names)."""

    settings: PolicySettings
    store: SampleStore
    generator: Generator
    weight_sync: WeightSync
    sessions: SessionTracker
    metrics: Metrics
    backlog_cache: list[float]  # [value, checked_at_monotonic]: the backlog check's once-a-second cache
    resolver: SessionResolver | None
    side_rules: SideRules | None
    secrets: SecretScanner | None
    deletion_tokens: DeletionTokens | None
    canary: Canary | None  # pins sessions to a weight version, routes them while a canary runs
