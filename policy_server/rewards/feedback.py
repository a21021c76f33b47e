"""An explicit feedback's value (``POST /v1/feedback``): ``up`` = +1, ``down`` = -1, or a number in [-1, 1].

Role: the route's value check (:func:`feedback_value`, a 400 otherwise). How the value then combines with the
judge's verdict, and when it applies to a sample, is the store's feedback rule
(policy_server.store.feedback_rule, applied by policy_server.store.feedback and by the dispatcher);
docs/REWARD_MODES.md ("Explicit feedback") is the user-facing contract.
"""

from __future__ import annotations

import math

VALUE_WORDS = {"up": 1.0, "down": -1.0}


class InvalidFeedback(ValueError):
    """A feedback value the route must answer with 400."""


def feedback_value(value: object) -> float:
    """``up`` / ``down`` or a finite number in [-1, 1] as a float; InvalidFeedback otherwise."""
    if isinstance(value, str):
        if value.strip().lower() in VALUE_WORDS:
            return VALUE_WORDS[value.strip().lower()]
        raise InvalidFeedback(f"value must be 'up', 'down' or a number in [-1, 1], got {value!r}")
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise InvalidFeedback(f"value must be 'up', 'down' or a number in [-1, 1], got {type(value).__name__}")
    v = float(value)
    if not math.isfinite(v) or not -1.0 <= v <= 1.0:
        raise InvalidFeedback(f"value must be in [-1, 1], got {value!r}")
    return v
