"""Opting out of training, per request or per session: ``X-Hindsight-Train`` and OpenClaw's incognito sessions.

Role: decide, for one request, whether its conversation may become training data (pure). Values of the
``X-Hindsight-Train`` header (case-insensitive; a header that is sent must say one of them, else a 400):

- ``on`` (the default): served, recorded, judged and trained as usual;
- ``off``: served and never judged or trained. The exchange is kept as a side turn with rule ``opt_out``
  (operators see it; side-turn retention purges it; a session deletion removes it);
- ``none`` (store nothing): served, and no text of it is kept anywhere: no turn, no side turn, no stored
  Responses answer. Only the session's activity time is touched.

Per session: a client opts a whole session out by sending the header on every request of it (the header is
static in most agents' provider config, e.g. OpenClaw's ``models.providers.<id>.headers``). A request that is
opted out pairs nothing: it is not the next state of the session's awaiting turn, so its text is never
judged either.

OpenClaw incognito: OpenClaw 2026.9.x names an incognito session by its session KEY,
``agent:<agent>:(dashboard|subagent|internal-session-effects):incognito-<id>`` (its ``isIncognitoSessionKey``).
A request whose session key has that shape is treated as ``none``. Stock OpenClaw does not put the key on the
wire: ``prompt_cache_key`` and the affinity headers carry its session id (a UUID), so an incognito session of a
stock OpenClaw is indistinguishable from any other on the wire; such users add ``X-Hindsight-Train: none`` to the
provider's ``headers`` (docs/USERS_DATA.md).
"""

from __future__ import annotations

import re
from collections.abc import Mapping

TRAIN_HEADER = "x-hindsight-train"
ON, OFF, NONE = "on", "off", "none"
OPT_OUT_RULE = "opt_out"  # the side rule an ``off`` request is recorded under
_WORDS = {"on": ON, "true": ON, "yes": ON, "1": ON, "off": OFF, "false": OFF, "no": OFF, "0": OFF, "none": NONE}
# OpenClaw's INCOGNITO_SESSION_RE (dist/session-key-*.mjs), matched on the lower-cased, trimmed key as it does.
OPENCLAW_INCOGNITO = re.compile(r"^agent:[^:]+:(?:dashboard|subagent|internal-session-effects):incognito-[^:]+$")


class BadTrainHeader(ValueError):
    """An ``X-Hindsight-Train`` value that is none of the documented words."""


def train_choice(headers: Mapping[str, str], session_key: str | None) -> str:
    """``on``, ``off`` or ``none`` for a request with these headers and session key (pure); BadTrainHeader for a
    header value that is not one of the words of the module docstring."""
    choice = ON
    raw = headers.get(TRAIN_HEADER)
    if raw is not None:
        word = _WORDS.get(raw.strip().lower())
        if word is None:
            raise BadTrainHeader("X-Hindsight-Train must be on, off or none")
        choice = word
    if session_key is not None and is_incognito(session_key):
        return NONE
    return choice


def is_incognito(session_key: str) -> bool:
    """Whether ``session_key`` names an OpenClaw incognito session (pure)."""
    return bool(OPENCLAW_INCOGNITO.match(session_key.strip().lower()))
