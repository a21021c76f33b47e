"""Labelled trajectories -> typed steps, and published judges' prediction files.

Contract:
- A dataset row (JSON line) holds ``total_index`` (the trajectory id), ``messages`` (OpenAI chat messages with
  ``tool_calls`` and ``tool`` results), optional ``tools`` and ``step_labels`` (``{"<message index>": 1|0|-1}``,
  each index an assistant message). Anything else in the row is ignored.
- Every labelled assistant message is one :class:`LabelledStep`, split as a (turn, next_state) pair: the
  messages before it are the ``context``; the message itself (content, reasoning_content, tool_calls) is the
  ``response``; the messages after it up to the next assistant message are the ``next_state``, with roles mapped
  onto the judge's ``user|tool`` rule (tool results stay ``tool`` with their ``name``/``tool_call_id``, anything
  else becomes ``user``). A step with no next-state text (the episode ended with it) has an empty next state.
- A prediction file has one JSON line per trajectory: ``index_in_dataset`` (== ``total_index``) and
  ``step_labels`` with values 1, 0, -1 or null (null or an absent step: no verdict). Its source name is the file
  name's stem without a trailing ``.dev``.
- Malformed input raises :class:`DatasetError` naming the file and line.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from engine.validation import describe_validation_errors
from judge_server.guards import GuardedStep, text_of

LABELS: tuple[int, ...] = (1, 0, -1)
# (trajectory id, message index of the assistant step)
StepKey = tuple[int, int]
# The message fields the judge reads; other fields of the dataset's messages (none today) are dropped.
_MESSAGE_FIELDS = ("role", "content", "reasoning_content", "tool_calls", "name", "tool_call_id")
_RESPONSE_FIELDS = ("content", "reasoning_content", "tool_calls")


class DatasetError(ValueError):
    """A dataset or prediction file that cannot be read as documented."""


@dataclass(frozen=True)
class LabelledStep:
    """One labelled assistant step as a (turn, next_state) pair; ``next_state`` empty: the episode ended here."""

    trajectory_id: int
    message_index: int
    label: int
    context: tuple[Mapping[str, Any], ...]
    response: Mapping[str, Any]
    next_state: tuple[Mapping[str, Any], ...]
    tools: tuple[Mapping[str, Any], ...] | None = None

    @property
    def key(self) -> StepKey:
        return (self.trajectory_id, self.message_index)

    @property
    def has_next_state(self) -> bool:
        """True when some next-state message has text (the judge needs one)."""
        return any(text_of(m.get("content")).strip() for m in self.next_state)

    def guarded(self) -> GuardedStep:
        """The step as the deterministic guards read it (the same split the judge gets)."""
        return GuardedStep(context=self.context, response=self.response, next_state=self.next_state, tools=self.tools)


@dataclass(frozen=True)
class PredictionSource:
    """A published judge's labels: ``labels[key]`` is 1, 0, -1 or None (no verdict); absent keys: no verdict."""

    name: str
    labels: Mapping[StepKey, int | None]


class _Row(BaseModel):
    model_config = ConfigDict(extra="ignore")

    total_index: int
    messages: list[dict[str, Any]] = Field(min_length=1)
    tools: list[dict[str, Any]] | None = None
    step_labels: dict[int, int]


class _PredictionRow(BaseModel):
    model_config = ConfigDict(extra="ignore")

    index_in_dataset: int
    step_labels: dict[int, int | None] | None = None


def _pick(message: Mapping[str, Any], fields: Sequence[str]) -> dict[str, Any]:
    return {k: message[k] for k in fields if message.get(k) is not None}


def _next_state_message(message: Mapping[str, Any]) -> dict[str, Any]:
    out = _pick(message, _MESSAGE_FIELDS)
    out.pop("tool_calls", None)
    out.pop("reasoning_content", None)
    # The judge's next state is what the agent saw after its step: tool results, else the user's side.
    out["role"] = "tool" if message.get("role") == "tool" else "user"
    out["content"] = text_of(message.get("content"))
    return out


def split_steps(
    trajectory_id: int,
    messages: Sequence[Mapping[str, Any]],
    labels: Mapping[int, int],
    tools: Sequence[Mapping[str, Any]] | None,
) -> list[LabelledStep]:
    """The labelled steps of one trajectory, in message order (see the module contract for the split)."""
    steps = []
    for index in sorted(labels):
        label = labels[index]
        if label not in LABELS:
            raise DatasetError(f"trajectory {trajectory_id}: step {index} has label {label!r}, not one of 1, 0, -1")
        if not 0 <= index < len(messages) or messages[index].get("role") != "assistant":
            raise DatasetError(f"trajectory {trajectory_id}: labelled message {index} is not an assistant message")
        after = []
        for message in messages[index + 1 :]:
            if message.get("role") == "assistant":
                break
            after.append(_next_state_message(message))
        steps.append(
            LabelledStep(
                trajectory_id=trajectory_id,
                message_index=index,
                label=label,
                context=tuple(_pick(m, _MESSAGE_FIELDS) for m in messages[:index]),
                response=_pick(messages[index], _RESPONSE_FIELDS),
                next_state=tuple(after),
                tools=tuple(tools) if tools is not None else None,
            )
        )
    return steps


def _json_lines(path: Path) -> list[tuple[int, Any]]:
    try:
        text = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise DatasetError(f"cannot read {path}: {exc.strerror or exc}") from exc
    out = []
    for number, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            out.append((number, json.loads(line)))
        except ValueError as exc:
            raise DatasetError(f"{path}:{number}: not JSON: {exc}") from exc
    return out


def load_dataset(path: Path) -> list[LabelledStep]:
    """Every labelled step of the dataset, in file order then message order."""
    steps: list[LabelledStep] = []
    seen: set[int] = set()
    for number, raw in _json_lines(path):
        try:
            row = _Row.model_validate(raw)
        except ValidationError as exc:
            raise DatasetError(f"{path}:{number}: {describe_validation_errors(exc.errors())}") from exc
        if row.total_index in seen:
            raise DatasetError(f"{path}:{number}: trajectory {row.total_index} appears twice")
        seen.add(row.total_index)
        try:
            steps += split_steps(row.total_index, row.messages, row.step_labels, row.tools)
        except DatasetError as exc:
            raise DatasetError(f"{path}:{number}: {exc}") from exc
    if not steps:
        raise DatasetError(f"{path}: no labelled steps")
    return steps


def source_name(path: Path) -> str:
    """``Qwen3-8B.dev.jsonl`` -> ``Qwen3-8B``."""
    stem = path.stem
    return stem[: -len(".dev")] if stem.endswith(".dev") else stem


def load_predictions(path: Path) -> PredictionSource:
    """One prediction file (see the module contract); a label outside 1/0/-1/null is a DatasetError."""
    labels: dict[StepKey, int | None] = {}
    for number, raw in _json_lines(path):
        try:
            row = _PredictionRow.model_validate(raw)
        except ValidationError as exc:
            raise DatasetError(f"{path}:{number}: {describe_validation_errors(exc.errors())}") from exc
        for index, label in (row.step_labels or {}).items():
            if label is not None and label not in LABELS:
                raise DatasetError(f"{path}:{number}: step {index} has label {label!r}, not 1, 0, -1 or null")
            labels[(row.index_in_dataset, index)] = label
    return PredictionSource(name=source_name(path), labels=labels)
