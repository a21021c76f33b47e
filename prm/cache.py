"""A session's token-backed turns as a tree of ``Interaction``s, with branch-local token rewards.

Input turn dicts (what the policy server records; see docs/SCORERS.md)::

    {"session_id": str, "turn_index": int,
     "messages": [...],                     # the prompt context sent for this turn
     "response": {"content", "reasoning_content", "tool_calls"},
     "prompt_ids": [int], "response_ids": [int],   # exact engine ids; scoring needs both (token-backed)
     "parent_turn_index": int | None,       # optional; default: the previous turn_index (a linear chain)
     "next_state": [...]}                   # optional; default: the messages the child turn added after
                                            # this turn's assistant message (empty for a leaf)

Roots have no parent; leaves have no child; each root-to-leaf path is one exported branch. ``clone_chain``
copies one branch with its own reward slots, so shared ancestors get branch-local scores and this cache is
never modified by branch scoring.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import torch

from engine.records import SCORING_TURN_KEYS
from prm.errors import PRMInputError
from prm.types import Interaction, freeze


def interaction_id_for(session_id: str, turn_index: int) -> str:
    return f"{session_id}:{turn_index}"


class TurnCache:
    """Interactions keyed by id (insertion order kept) plus each one's committed token rewards."""

    def __init__(self, interactions: Iterable[Interaction], token_rewards: Mapping[str, torch.Tensor] | None = None):
        self._items: dict[str, Interaction] = {}
        for it in interactions:
            if it.interaction_id in self._items:
                raise PRMInputError(f"duplicate interaction id {it.interaction_id!r}")
            self._items[it.interaction_id] = it
        self._rewards: dict[str, torch.Tensor] = {k: v.clone() for k, v in (token_rewards or {}).items()}

    def __len__(self) -> int:
        return len(self._items)

    def __contains__(self, interaction_id: object) -> bool:
        return interaction_id in self._items

    def items(self) -> list[tuple[str, Interaction]]:
        return list(self._items.items())

    def get(self, interaction_id: str) -> Interaction:
        return self._items[interaction_id]

    def token_rewards(self, interaction_id: str) -> torch.Tensor | None:
        return self._rewards.get(interaction_id)

    def set_token_rewards(self, interaction_id: str, rewards: torch.Tensor) -> None:
        if interaction_id not in self._items:
            raise KeyError(interaction_id)
        self._rewards[interaction_id] = rewards

    def ordered(self) -> list[Interaction]:
        """Parent-before-child, stable (insertion order among ready turns); a cycle is an input error."""
        remaining = list(self._items.values())
        done: list[Interaction] = []
        while remaining:
            pending = {it.interaction_id for it in remaining}
            ready = [it for it in remaining if it.parent_id is None or it.parent_id not in pending]
            if not ready:
                raise PRMInputError("turn parent links contain a cycle: " + ", ".join(sorted(pending)))
            ready_ids = {it.interaction_id for it in ready}
            done.extend(ready)
            remaining = [it for it in remaining if it.interaction_id not in ready_ids]
        return done

    def leaf_ids(self) -> list[str]:
        parents = {it.parent_id for it in self._items.values()}
        return [it.interaction_id for it in self.ordered() if it.interaction_id not in parents]

    def clone_chain(self, leaf_id: str) -> TurnCache:
        """A new cache holding root..leaf only, with copies of their rewards."""
        chain: list[Interaction] = []
        seen: set[str] = set()
        cur: str | None = leaf_id
        while cur is not None and cur in self._items:
            if cur in seen:
                raise PRMInputError(f"turn parent links contain a cycle at {cur!r}")
            seen.add(cur)
            chain.append(self._items[cur])
            cur = self._items[cur].parent_id
        chain.reverse()
        ids = [it.interaction_id for it in chain]
        rewards = {iid: self._rewards[iid] for iid in ids if iid in self._rewards}
        return TurnCache(chain, rewards)

    @classmethod
    def from_turns(cls, turns: Sequence[Mapping[str, Any]]) -> TurnCache:
        """Validate policy-server turn dicts and build the tree (see module docstring)."""
        if not turns:
            raise PRMInputError("no turns to score")
        checked = [_check_turn(t, i) for i, t in enumerate(turns)]
        sessions = {t["session_id"] for t in checked}
        if len(sessions) != 1:
            raise PRMInputError(f"turns of one scoring call must share one session_id, got {sorted(sessions)}")
        checked.sort(key=lambda t: t["turn_index"])
        indices = [t["turn_index"] for t in checked]
        if len(set(indices)) != len(indices):
            raise PRMInputError(f"duplicate turn_index in session {checked[0]['session_id']!r}")
        by_index = {t["turn_index"]: t for t in checked}
        parents: dict[int, int | None] = {}
        for pos, t in enumerate(checked):
            if "parent_turn_index" in t:
                parent = t["parent_turn_index"]
                if parent is not None and parent not in by_index:
                    raise PRMInputError(f"turn {t['turn_index']} names unknown parent_turn_index {parent}")
            else:
                parent = checked[pos - 1]["turn_index"] if pos else None
            parents[t["turn_index"]] = parent
        first_child: dict[int, int] = {}
        for idx, parent in parents.items():
            if parent is not None:
                first_child.setdefault(parent, idx)
        sid = checked[0]["session_id"]
        interactions = []
        for t in checked:
            idx = t["turn_index"]
            if t.get("next_state") is not None:
                next_state = list(t["next_state"])
            elif idx in first_child:
                # The child's context = this context + this assistant message + what the user/tools said next.
                next_state = list(by_index[first_child[idx]]["messages"][len(t["messages"]) + 1 :])
            else:
                next_state = []
            parent = parents[idx]
            interactions.append(
                Interaction(
                    interaction_id=interaction_id_for(sid, idx),
                    session_id=sid,
                    turn_index=idx,
                    parent_id=None if parent is None else interaction_id_for(sid, parent),
                    messages=freeze(list(t["messages"])),
                    response=freeze(dict(t["response"])),
                    next_state=freeze(next_state),
                    prompt_ids=tuple(t["prompt_ids"]),
                    response_ids=tuple(t["response_ids"]),
                    extra=freeze({k: v for k, v in t.items() if k not in SCORING_TURN_KEYS}),
                )
            )
        return cls(interactions)


def _check_turn(turn: Mapping[str, Any], pos: int) -> Mapping[str, Any]:
    if not isinstance(turn, Mapping):
        raise PRMInputError(f"turn #{pos} must be a mapping, got {type(turn).__name__}")
    where = f"turn #{pos} (turn_index={turn.get('turn_index')!r})"
    if not isinstance(turn.get("session_id"), str) or not turn["session_id"]:
        raise PRMInputError(f"{where}: session_id must be a non-empty string")
    if not isinstance(turn.get("turn_index"), int) or isinstance(turn.get("turn_index"), bool):
        raise PRMInputError(f"{where}: turn_index must be an int")
    for key in ("prompt_ids", "response_ids"):
        ids = turn.get(key)
        if not isinstance(ids, list | tuple) or not ids or not all(isinstance(i, int) for i in ids):
            raise PRMInputError(f"{where}: scoring needs token-backed turns; {key} must be a non-empty list of ints")
    if not isinstance(turn.get("messages"), list | tuple):
        raise PRMInputError(f"{where}: messages must be a list of chat messages")
    if not isinstance(turn.get("response"), Mapping):
        raise PRMInputError(f"{where}: response must be a mapping with content/reasoning_content/tool_calls")
    return turn
