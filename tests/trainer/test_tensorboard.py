"""Training curves by default (trainer/metrics.py): TensorBoard event files next to metrics.jsonl.

Contract: rank 0's MetricsLogger always writes ``out_dir/tensorboard/events.out.tfevents.*`` (tensorboardX,
no optional install), one ``train/<key>`` scalar per finite numeric metric at its step; bools, strings,
lists and NaN/inf stay out of TensorBoard but are in metrics.jsonl; a disabled logger (other ranks)
writes nothing. The event file is read back here with a plain TFRecord reader, as TensorBoard would.
"""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
from tensorboardX.proto.event_pb2 import Event

from trainer.metrics import MetricsLogger

pytestmark = pytest.mark.unit


def read_scalars(tb_dir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of every event file under ``tb_dir``: TFRecord = u64 length, u32 crc, data, u32 crc."""
    out: dict[str, list[tuple[int, float]]] = {}
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            (n,) = struct.unpack("<Q", data[pos : pos + 8])
            ev = Event.FromString(data[pos + 12 : pos + 12 + n])
            pos += 12 + n + 4
            for v in ev.summary.value:
                out.setdefault(v.tag, []).append((ev.step, v.simple_value))
    return out


def test_scalars_written_per_step_without_optional_install(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    log = MetricsLogger(tmp_path, to_stdout=False)
    log.log(1, {"loss": 0.5, "n_tokens": 12, "reward_mean": float("nan"), "weight_versions": ["0"], "flag": True})
    log.log(2, {"loss": 0.25, "n_tokens": 20, "reward_mean": 1.0, "approx_kl": float("inf")})
    log.close()

    scalars = read_scalars(tmp_path / "tensorboard")
    assert scalars["train/loss"] == [(1, 0.5), (2, 0.25)]
    assert scalars["train/n_tokens"] == [(1, 12.0), (2, 20.0)]
    assert scalars["train/reward_mean"] == [(2, 1.0)]  # the NaN of step 1 is not a point
    assert set(scalars) == {"train/loss", "train/n_tokens", "train/reward_mean"}
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [m["step"] for m in lines] == [1, 2] and lines[0]["weight_versions"] == ["0"]
    assert "tensorboard is not installed" not in capsys.readouterr().err


def test_other_ranks_write_nothing(tmp_path: Path) -> None:
    log = MetricsLogger(tmp_path / "rank1", enabled=False)
    log.log(1, {"loss": 0.5})
    log.close()
    assert not (tmp_path / "rank1").exists()
