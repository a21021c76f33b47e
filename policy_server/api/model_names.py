"""The model names the policy server answers to: the served name and its aliases.

Contract: a request naming any other model is a 404 with code ``model_not_found`` whose message lists the
served names (as OpenAI and vLLM answer it); a request without a model uses the served model. ``/v1/models``
lists every accepted name, and ``/v1/models/{id}`` answers one of them (404 ``model_not_found`` otherwise).
Aliases (``--model-aliases``) exist for clients that insist on a model name of their own.
"""

from __future__ import annotations

from engine.chat_families import ChatFamily
from engine.validation import clip
from policy_server.api.response_models import ModelCard
from policy_server.errors import NotFound
from policy_server.settings import PolicySettings


def served_models(settings: PolicySettings) -> list[str]:
    names = [settings.served_model_name]
    return names + [a for a in settings.model_aliases if a not in names]


def check_model(settings: PolicySettings, name: str | None) -> None:
    """404 ``model_not_found`` naming the served models, unless ``name`` is one of them (or absent)."""
    if name is None or name in served_models(settings):
        return
    raise NotFound(
        f"the model {clip(name)} does not exist; this server serves {', '.join(map(repr, served_models(settings)))}",
        param="model",
        code="model_not_found",
    )


def model_card(
    settings: PolicySettings, name: str, created_s: int, weight_version: str | None, family: ChatFamily
) -> ModelCard:
    """One ``model`` object of ``/v1/models``; ``root`` is the served model an alias stands for; the chat
    format (history mode, the parsers chosen for the template) says how turns are rendered and read."""
    return ModelCard(
        id=name,
        object="model",
        created=created_s,
        owned_by="hindsight",
        root=settings.served_model_name,
        weight_version=weight_version,
        history=settings.history,
        tool_call_parser=family.tool_call_parser,
        reasoning_parser=family.reasoning_parser,
        reasoning_switch=family.reasoning_switch,
    )
