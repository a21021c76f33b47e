"""Errors of the process-reward scorer framework (``prm``).

One tree, so the policy server can map it to HTTP (or to a sample's ``reject_reason``) in one place:

    PRMError
    ├── PRMConfigError        the YAML / mapping config breaks a rule (-> 400 at startup, never at runtime)
    ├── PRMInputError         a turn handed to scoring is not scorable (not token-backed, bad parent link)
    ├── PRMRejected           a scorer rejected the trajectory (None, exception, bad shape, unknown id)
    ├── PRMRunnerClosed       ``run()`` after ``aclose()`` started
    └── PRMTrajectoryUnavailable  a group member is missing or was already consumed

``PRMRejected`` keeps the scorer's own exception as ``__cause__``; nothing rejected is ever turned into a
score of 0.
"""

from __future__ import annotations


class PRMError(Exception):
    """Base of every PRM framework failure."""


class PRMConfigError(PRMError, ValueError):
    """The PRM configuration is invalid; the message names the offending key."""


class PRMInputError(PRMError, ValueError):
    """A turn cannot be scored as given (missing token ids, broken parent links)."""


class PRMRejected(PRMError):
    """Scoring rejected the trajectory; the session's samples must not be trained on as scored."""

    def __init__(self, message: str, *, scorer: str | None = None):
        super().__init__(message)
        self.scorer = scorer


class PRMRunnerClosed(PRMError, RuntimeError):
    """The runner is closing or closed; no new scoring is admitted."""


class PRMTrajectoryUnavailable(PRMError):
    """A requested trajectory is missing, or was already consumed by an earlier export."""
