"""What engine calls return: one sampled Generation, or a ScoredSequence of given ids.

``parse_generation`` turns one ``/generate`` JSON object into a Generation and checks the protocol
invariants the services rely on (one log-prob per output id, same ids, no null log-prob for a sampled
token); a violation is an EngineBadResponse, never a silently padded list.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.errors import EngineBadResponse


@dataclass
class Generation:
    """One sample of ``/generate``: exactly the sampled ids with one log-prob each (stop token included)."""

    output_ids: list[int]
    output_logprobs: list[float] | None
    text: str
    finish_reason: dict[str, Any]
    weight_version: str | None
    prompt_tokens: int | None
    meta_info: dict[str, Any] = field(repr=False, default_factory=dict)
    # [len(output_ids)][K] (logprob, token_id) pairs when top_logprobs_num > 0
    output_top_logprobs: list[list[tuple[float, int]]] | None = None

    @property
    def aborted(self) -> bool:
        return self.finish_reason.get("type") == "abort"


@dataclass
class ScoredSequence:
    """Log-probs of given response ids after a prompt; ``logprobs[i]`` belongs to ``token_ids[i]``."""

    token_ids: list[int]
    logprobs: list[float]
    top_ids: list[list[int]] | None = None  # [T][K]
    top_logprobs: list[list[float]] | None = None  # [T][K]
    weight_version: str | None = None


def parse_generation(item: Any, *, return_logprob: bool, url: str | None = None) -> Generation:
    """Turn one ``/generate`` JSON object into a :class:`Generation`, checking the protocol invariants."""
    if not isinstance(item, dict) or "meta_info" not in item:
        raise EngineBadResponse("generate: item without meta_info", url=url)
    meta = item["meta_info"]
    output_ids = item.get("output_ids")
    if not isinstance(output_ids, list):
        raise EngineBadResponse("generate: output_ids missing", url=url)
    finish = meta.get("finish_reason") or {}
    if isinstance(finish, str):  # tolerate older engines that send a bare string
        finish = {"type": finish}
    logprobs: list[float] | None = None
    top: list[list[tuple[float, int]]] | None = None
    if return_logprob:
        entries = meta.get("output_token_logprobs")
        if entries is None:
            entries = []
        if len(entries) != len(output_ids):
            raise EngineBadResponse(f"generate: {len(output_ids)} output ids but {len(entries)} log-probs", url=url)
        if [int(e[1]) for e in entries] != [int(t) for t in output_ids]:
            raise EngineBadResponse("generate: log-prob token ids differ from output_ids", url=url)
        if any(e[0] is None for e in entries):
            raise EngineBadResponse("generate: null log-prob for a sampled token", url=url)
        logprobs = [float(e[0]) for e in entries]
        rows = meta.get("output_top_logprobs")
        if rows:
            top = [[(float(t[0]), int(t[1])) for t in (row or [])] for row in rows]
    return Generation(
        output_ids=[int(t) for t in output_ids],
        output_logprobs=logprobs,
        text=item.get("text", ""),
        finish_reason=finish,
        weight_version=meta.get("weight_version"),
        prompt_tokens=meta.get("prompt_tokens"),
        meta_info=meta,
        output_top_logprobs=top,
    )
