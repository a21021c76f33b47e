"""Process-reward scorer framework (AReaL contract) for Hindsight; see docs/SCORERS.md.

Public API::

    from judge_server.prm import BaseScorer, BaseTrajectoryScorer, PRMRunner, PRMScorerResult, PRMMetricObservation

The policy server builds one runner at startup (``await PRMRunner.create(load_prm_config(path))``), calls
``await score_session(runner, turns)`` when a session's turns are ready, exposes ``runner.metrics`` with
``register_prometheus(registry, runner.metrics)``, and ``await runner.aclose()`` in its lifespan shutdown.
"""

from judge_server.prm.cache import TurnCache
from judge_server.prm.config import (
    ActorConfig,
    PRMAdvantageShapingConfig,
    PRMConfig,
    PRMFileConfig,
    PRMScorerConfig,
    load_prm_config,
    parse_prm_config,
)
from judge_server.prm.errors import (
    PRMConfigError,
    PRMError,
    PRMInputError,
    PRMRejected,
    PRMRunnerClosed,
    PRMTrajectoryUnavailable,
)
from judge_server.prm.export import BranchScore, SessionScore, score_branches, score_session
from judge_server.prm.groups import (
    GroupResult,
    ReadyTrajectories,
    filter_mixed_or_penalized_all_wrong,
    filter_mixed_or_penalized_all_wrong_mask_no_eos,
    score_group,
)
from judge_server.prm.metrics import PRMMetrics, PRMStats, combine_stats, register_prometheus
from judge_server.prm.runner import PRMRunner
from judge_server.prm.scorer import BaseScorer, BaseTrajectoryScorer
from judge_server.prm.types import Interaction, PRMMetricObservation, PRMScorerResult, PRMTurnResult

__all__ = [
    "ActorConfig",
    "BaseScorer",
    "BaseTrajectoryScorer",
    "BranchScore",
    "GroupResult",
    "Interaction",
    "PRMAdvantageShapingConfig",
    "PRMConfig",
    "PRMConfigError",
    "PRMError",
    "PRMFileConfig",
    "PRMInputError",
    "PRMMetricObservation",
    "PRMMetrics",
    "PRMRejected",
    "PRMRunner",
    "PRMRunnerClosed",
    "PRMScorerConfig",
    "PRMScorerResult",
    "PRMStats",
    "PRMTrajectoryUnavailable",
    "PRMTurnResult",
    "ReadyTrajectories",
    "SessionScore",
    "TurnCache",
    "combine_stats",
    "filter_mixed_or_penalized_all_wrong",
    "filter_mixed_or_penalized_all_wrong_mask_no_eos",
    "load_prm_config",
    "parse_prm_config",
    "register_prometheus",
    "score_branches",
    "score_group",
    "score_session",
]
