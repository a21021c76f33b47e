"""Process-reward scorer framework (AReaL contract) for Hindsight; see docs/SCORERS.md.

Public API::

    from prm import BaseScorer, BaseTrajectoryScorer, PRMRunner, PRMScorerResult, PRMMetricObservation

The policy server builds one runner at startup (``await PRMRunner.create(load_prm_config(path))``), calls
``await score_session(runner, turns)`` when a session's turns are ready, exposes ``runner.metrics`` with
``register_prometheus(registry, runner.metrics)``, and ``await runner.aclose()`` in its lifespan shutdown.
"""

from prm.cache import TurnCache
from prm.config import (
    ActorConfig,
    PRMAdvantageShapingConfig,
    PRMConfig,
    PRMFileConfig,
    PRMScorerConfig,
    load_prm_config,
    parse_prm_config,
)
from prm.errors import (
    PRMConfigError,
    PRMError,
    PRMInputError,
    PRMRejected,
    PRMRunnerClosed,
    PRMTrajectoryUnavailable,
)
from prm.export import BranchScore, SessionScore, score_branches, score_session
from prm.groups import (
    GroupResult,
    ReadyTrajectories,
    filter_mixed_or_penalized_all_wrong,
    filter_mixed_or_penalized_all_wrong_mask_no_eos,
    score_group,
)
from prm.metrics import PRMMetrics, PRMStats, combine_stats, register_prometheus
from prm.runner import PRMRunner
from prm.scorer import BaseScorer, BaseTrajectoryScorer
from prm.types import Interaction, PRMMetricObservation, PRMScorerResult, PRMTurnResult

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
