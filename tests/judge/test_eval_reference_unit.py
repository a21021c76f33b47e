"""hindsight-judge-eval reproduces bench/data/agentprocessbench/README.md's reference table.

The table is parsed from the README (the published figures), the figures are computed from the dataset and the six
prediction files with judge_server.eval's loaders and metrics, and every cell (acc, macro-F1, F1(-1), kappa,
first-error acc) must match to 3 decimals. The README's cells are the 4-decimal figures rounded half away from zero
to 3 (Llama's kappa -0.00848 -> -0.0085 -> -0.009; Qwen3-4B's accuracy 0.64154 -> 0.6415 -> 0.642), so a cell is
compared that way (:func:`published`); every computed figure is also within 0.0006 of its cell.
"""

from __future__ import annotations

import re
from decimal import ROUND_HALF_UP, Decimal
from pathlib import Path

import pytest

from judge_server.eval.dataset import load_dataset, load_predictions
from judge_server.eval.metrics import Scores, constant_verdicts, score

pytestmark = pytest.mark.unit

DATA = Path(__file__).resolve().parents[2] / "bench" / "data" / "agentprocessbench"
# README judge names -> prediction file stems
FILES = {
    "Llama-3.1-8B-Instruct": "Llama-3.1-8B-Instruct",
    "Qwen3-8B (non-thinking)": "Qwen3-8B",
    "Qwen3-4B-Instruct-2507": "Qwen3-4B-Instruct-2507",
    "Qwen3-30B-A3B-Thinking-2507": "Qwen3-30B-A3B-Thinking-2507",
    "Gemini-3-Flash-Preview (thinking)": "Gemini-3-Flash-Preview-Thinking",
    "DeepSeek-V3.2": "DeepSeek-V3.2",
}
BASE = "always +1 (base rate)"


def reference_table() -> dict[str, tuple[float, ...]]:
    rows = {}
    for line in (DATA / "README.md").read_text(encoding="utf-8").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and all(re.fullmatch(r"-?\d+\.\d{3}", c) for c in cells[1:]):
            rows[cells[0]] = tuple(float(c) for c in cells[1:])
    return rows


def published(x: float) -> float:
    """``x`` as the README prints it: to 4 decimals, then to 3, halves away from zero."""
    return float(Decimal(f"{x:.4f}").quantize(Decimal("0.001"), rounding=ROUND_HALF_UP))


def figures(s: Scores) -> tuple[float, ...]:
    return (s.accuracy, s.macro_f1, s.f1_bad, s.kappa, s.first_error_accuracy)


def test_reference_table_is_reproduced() -> None:
    table = reference_table()
    assert set(table) == {BASE, *FILES}, table.keys()
    steps = load_dataset(DATA / "hotpotqa.dev.jsonl")
    assert len(steps) == 597
    computed = {BASE: figures(score(steps, constant_verdicts(steps, 1)))}
    for name, stem in FILES.items():
        computed[name] = figures(score(steps, load_predictions(DATA / "predictions" / f"{stem}.dev.jsonl").labels))
    mismatches = []
    for name, expected in table.items():
        for column, got, want in zip(
            ("acc", "macro-F1", "F1(-1)", "kappa", "first-err"), computed[name], expected, strict=True
        ):
            if published(got) != want or abs(got - want) > 0.0006:
                mismatches.append(f"{name} {column}: computed {got:.5f}, README {want:.3f}")
    assert not mismatches, "\n".join(mismatches)
