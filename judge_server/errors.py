"""The judge service's error tree, mapped to HTTP in one place (app.py's exception handlers).

    JudgeError
    ├── InvalidRequest        bad input we can name (-> 400, or 413 for oversized input)
    ├── Unauthorized          missing / wrong Bearer key (-> 401)
    ├── RewardUnavailable     a reward-client route (OpenRLHF, slime) whose judge failed (-> 503, so they retry)
    ├── JudgeUnavailable      (client side) the judge service could not be reached after retries
    ├── JudgeRequestRejected  (client side) the judge answered 4xx: retrying cannot help
    └── JudgeBadResponse      (client side) the judge answered 2xx with a body off the JudgeVerdicts schema

Engine failures (engine.errors.EngineError) are NOT raised to the caller of /v1/judge: they end as a
task with status ``judge_failed`` inside a 200 response (see judge.py). Pydantic validation errors are
answered 422 with the field messages.
"""

from __future__ import annotations


class JudgeError(Exception):
    status_code = 500

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message


class InvalidRequest(JudgeError):
    status_code = 400

    def __init__(self, message: str, status_code: int = 400):
        super().__init__(message)
        self.status_code = status_code


class Unauthorized(JudgeError):
    status_code = 401


class RewardUnavailable(JudgeError):
    """A /get_reward or /slime/reward item has no verdict: 503 runs the client's own retry path."""

    status_code = 503


class JudgeUnavailable(JudgeError):
    """Raised by JudgeClient when the judge service itself cannot be reached (after retries)."""

    status_code = 503


class JudgeRequestRejected(JudgeError):
    """Raised by JudgeClient when the judge service answers 4xx (bad input: retrying cannot help)."""

    def __init__(self, message: str, status_code: int):
        super().__init__(message)
        self.status_code = status_code


class JudgeBadResponse(JudgeError):
    """Raised by JudgeClient when a 2xx answer is not a ``JudgeVerdicts`` (engine.records): a judge of another
    version or a proxy in between. Not retried: the same request would get the same answer."""

    status_code = 502
