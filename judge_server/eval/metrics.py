"""Step-level agreement of a verdict source with gold process labels: pure functions, no I/O.

Conventions (docs/JUDGE_EVAL.md; they reproduce bench/data/agentprocessbench/README.md's reference table):
- A verdict is 1, 0, -1 or None (no verdict: a missing label, a tie, a failed or skipped call). No verdict is
  always wrong and is counted in ``missing``.
- The confusion matrix has gold rows (1, 0, -1) and predicted columns (1, 0, -1, missing).
- Accuracy: the share of steps whose verdict equals the gold label.
- Per class c of (1, 0, -1): precision = predicted c and gold c / predicted c; recall = / gold c; F1 their
  harmonic mean; a zero denominator gives 0. Macro-F1 is the plain mean of the three F1s.
- Cohen's kappa over the four predicted categories (missing its own category, which gold never takes, so it adds
  disagreement but no chance agreement): (p_o - p_e) / (1 - p_e); 0 when p_e is 1 (no variation to agree on).
- First-error accuracy, per trajectory: the first step (message order) labelled -1 by gold, or none, equals the
  first step the source marks -1, or none; a missing verdict is not a -1 here.
- Bootstrap intervals resample whole trajectories with replacement (a trajectory's steps are not independent),
  seeded, and report the 2.5 and 97.5 percentiles of macro-F1 and kappa.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import numpy as np
import numpy.typing as npt

from engine.records import Interval

GOLD_LABELS: tuple[int, ...] = (1, 0, -1)
# The predicted columns: the three labels, then "missing" (no verdict).
PREDICTED_COLUMNS: tuple[str, ...] = ("1", "0", "-1", "missing")
_ROW = {1: 0, 0: 1, -1: 2}
_MISSING = 3

StepKey = tuple[int, int]
Verdict = int | None


class Labelled(Protocol):
    """A gold-labelled step: its trajectory, its message index and its label (dataset.LabelledStep is one)."""

    @property
    def trajectory_id(self) -> int: ...
    @property
    def message_index(self) -> int: ...
    @property
    def label(self) -> int: ...


@dataclass(frozen=True)
class GoldLabel:
    trajectory_id: int
    message_index: int
    label: int


@dataclass(frozen=True)
class ClassScores:
    precision: float
    recall: float
    f1: float
    support: int  # gold steps of the class


@dataclass(frozen=True)
class Scores:
    """A source's figures on one set of steps; ``confusion[g][p]`` as in the module contract."""

    steps: int
    trajectories: int
    accuracy: float
    macro_f1: float
    kappa: float
    first_error_accuracy: float
    missing: int
    classes: Mapping[int, ClassScores]
    confusion: tuple[tuple[int, ...], ...]

    @property
    def f1_bad(self) -> float:
        """F1 of the -1 class (a step that is wrong or leads the run astray)."""
        return self.classes[-1].f1


def _column(verdict: Verdict) -> int:
    return _MISSING if verdict is None else _ROW[verdict]


def confusion_matrix(gold: Sequence[Labelled], verdicts: Mapping[StepKey, Verdict]) -> npt.NDArray[np.int64]:
    """3 x 4 counts: gold rows (1, 0, -1), predicted columns (1, 0, -1, missing); absent keys are missing."""
    out = np.zeros((3, 4), dtype=np.int64)
    for step in gold:
        out[_ROW[step.label], _column(verdicts.get((step.trajectory_id, step.message_index)))] += 1
    return out


def _divide(num: npt.NDArray[np.float64], den: npt.NDArray[np.float64]) -> npt.NDArray[np.float64]:
    return np.divide(num, den, out=np.zeros_like(num), where=den > 0)


def _rates(conf: npt.NDArray[np.float64]) -> tuple[npt.NDArray[np.float64], ...]:
    """Accuracy, per-class precision/recall/F1 and kappa of confusion matrices (..., 3, 4), vectorised."""
    n = conf.sum(axis=(-2, -1))
    diag = conf[..., [0, 1, 2], [0, 1, 2]]
    gold_n = conf.sum(axis=-1)  # (..., 3)
    pred_n = conf[..., :3].sum(axis=-2)  # (..., 3): a missing verdict is no class's prediction
    accuracy = _divide(diag.sum(axis=-1), n)
    precision = _divide(diag, pred_n)
    recall = _divide(diag, gold_n)
    f1 = _divide(2 * precision * recall, precision + recall)
    chance = _divide((gold_n * pred_n).sum(axis=-1), n * n)
    kappa = _divide(accuracy - chance, 1 - chance)
    return accuracy, precision, recall, f1, kappa


def first_error_accuracy(gold: Sequence[Labelled], verdicts: Mapping[StepKey, Verdict]) -> float:
    """Share of trajectories whose first gold -1 step (or none) is the first step the source marks -1 (or none)."""
    by_trajectory: dict[int, list[Labelled]] = {}
    for step in gold:
        by_trajectory.setdefault(step.trajectory_id, []).append(step)
    if not by_trajectory:
        return 0.0
    found = 0
    for tid, steps in by_trajectory.items():
        ordered = sorted(steps, key=lambda s: s.message_index)
        gold_first = next((s.message_index for s in ordered if s.label == -1), None)
        source_first = next((s.message_index for s in ordered if verdicts.get((tid, s.message_index)) == -1), None)
        found += gold_first == source_first
    return found / len(by_trajectory)


def score(gold: Sequence[Labelled], verdicts: Mapping[StepKey, Verdict]) -> Scores:
    """Every figure of the module contract for ``verdicts`` on the ``gold`` steps (keys outside gold are ignored)."""
    conf = confusion_matrix(gold, verdicts)
    accuracy, precision, recall, f1, kappa = _rates(conf.astype(np.float64))
    classes = {
        label: ClassScores(float(precision[i]), float(recall[i]), float(f1[i]), int(conf[i].sum()))
        for i, label in enumerate(GOLD_LABELS)
    }
    return Scores(
        steps=len(gold),
        trajectories=len({s.trajectory_id for s in gold}),
        accuracy=float(accuracy),
        macro_f1=float(f1.mean()),
        kappa=float(kappa),
        first_error_accuracy=first_error_accuracy(gold, verdicts),
        missing=int(conf[:, _MISSING].sum()),
        classes=classes,
        confusion=tuple(tuple(int(x) for x in row) for row in conf),
    )


def bootstrap_intervals(
    gold: Sequence[Labelled], verdicts: Mapping[StepKey, Verdict], *, resamples: int, seed: int
) -> tuple[Interval, Interval] | None:
    """95% percentile intervals of (macro-F1, kappa) over ``resamples`` trajectory resamples; None for 0 resamples.

    Each resample draws as many trajectories as there are, with replacement; its confusion matrix is the sum of the
    drawn trajectories' matrices, so all resamples are one matrix product. The same seed gives the same intervals.
    """
    if resamples <= 0:
        return None
    by_trajectory: dict[int, list[Labelled]] = {}
    for step in gold:
        by_trajectory.setdefault(step.trajectory_id, []).append(step)
    per_trajectory = np.stack([confusion_matrix(steps, verdicts).ravel() for steps in by_trajectory.values()])
    rng = np.random.default_rng(seed)
    count = len(by_trajectory)
    draws = rng.multinomial(count, np.full(count, 1.0 / count), size=resamples)  # (resamples, trajectories)
    conf = (draws @ per_trajectory).reshape(resamples, 3, 4).astype(np.float64)
    _, _, _, f1, kappa = _rates(conf)
    macro = f1.mean(axis=-1)
    return (
        Interval(lo=float(np.percentile(macro, 2.5)), hi=float(np.percentile(macro, 97.5))),
        Interval(lo=float(np.percentile(kappa, 2.5)), hi=float(np.percentile(kappa, 97.5))),
    )


def constant_verdicts(gold: Sequence[Labelled], verdict: Verdict) -> dict[StepKey, Verdict]:
    """The same verdict on every step (``1``: the always-+1 base rate)."""
    return {(s.trajectory_id, s.message_index): verdict for s in gold}
