"""engine.cli_settings: every console script's command line comes from its pydantic-settings class.

Contract (module docstring of engine/cli_settings.py): one ``--kebab-case`` flag per field with the field's
description as help; int/float flags parse typed; bool flags take ``--x``, ``--x VALUE`` and ``--no-x``;
``--config FILE`` (JSON/TOML/YAML) sets any field; precedence flags > env > file > defaults; unknown flags
and invalid values exit 2. The trainer's admin key never travels on argv. Everything runs in-process.
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from pydantic import Field

from devkit.dev_server.cli import main as dev_engine_main
from devkit.dev_server.settings import DevEngineSettings
from devkit.tiny_model_cli import TinyModelSettings
from devkit.tiny_model_cli import main as tiny_model_main
from engine.cli_settings import CliSettings, EnvOnly, build_parser, parse_cli, parse_settings
from judge_server.cli import main as judge_main
from judge_server.settings import JudgeSettings
from policy_server.cli import MigrateSettings, settings_from_args
from policy_server.cli import main as policy_main
from policy_server.settings import PolicySettings
from trainer.cli import main as train_main
from trainer.cli import parse_config
from trainer.report.cli import ReportSettings
from trainer.report.cli import main as report_main
from trainer.settings import UNBOUNDED_STEPS, TrainConfig

pytestmark = pytest.mark.unit

POLICY_REQUIRED = ["--model-path", "m", "--engine-url", "http://e:1"]
TRAIN_REQUIRED = ["--model-path", "m", "--out-dir", "o"]

SCRIPTS: list[tuple[str, Callable[[list[str]], Any], type[CliSettings]]] = [
    ("hindsight-policy", policy_main, PolicySettings),
    ("hindsight-judge", judge_main, JudgeSettings),
    ("hindsight-dev-engine", dev_engine_main, DevEngineSettings),
    ("hindsight-train", train_main, TrainConfig),
    ("hindsight-report", report_main, ReportSettings),
    ("hindsight-tiny-model", tiny_model_main, TinyModelSettings),
]


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("HINDSIGHT_"):
            monkeypatch.delenv(name)


def _exit_code(main: Callable[[list[str]], Any], argv: list[str]) -> int:
    with pytest.raises(SystemExit) as exc:
        main(argv)
    return int(exc.value.code or 0)


# ----------------------------------------------------------------------------- help and unknown flags
@pytest.mark.parametrize(("prog", "main", "cls"), SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_help_has_a_line_for_every_setting(
    prog: str, main: Callable[[list[str]], Any], cls: type[CliSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(main, ["--help"]) == 0
    text = " ".join(capsys.readouterr().out.split())  # argparse wraps help lines
    assert text.startswith(f"usage: {prog} ")
    assert "--config FILE" in text
    for name, field in cls.model_fields.items():
        assert field.description, f"{cls.__name__}.{name} has no description"
        words = " ".join(field.description.split()[:4])
        assert words in text, f"{prog}: no help line for {name}"
        if any(isinstance(m, EnvOnly) for m in field.metadata):
            assert f"--{name.replace('_', '-')} " not in text  # a secret is never a flag
        elif name not in ("run_dir", "out_dir") or cls is TrainConfig:
            assert f"--{name.replace('_', '-')} " in text, f"{prog}: no flag for {name}"


@pytest.mark.parametrize(("prog", "main", "cls"), SCRIPTS, ids=[s[0] for s in SCRIPTS])
def test_unknown_flag_exits_2(
    prog: str, main: Callable[[list[str]], Any], cls: type[CliSettings], capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(main, ["/tmp", "--no-such-flag", "1"]) == 2  # a positional too, for the scripts that take one
    err = capsys.readouterr().err
    assert "unrecognized arguments:" in err and "--no-such-flag" in err


def test_a_field_without_description_cannot_become_a_cli() -> None:
    class Undocumented(CliSettings):
        size: int = Field(3)

    with pytest.raises(TypeError, match="Undocumented.size has no description"):
        build_parser(Undocumented, "x")


# ----------------------------------------------------------------------------- typed values
def test_flags_parse_typed_and_bools_take_three_forms() -> None:
    s = settings_from_args(
        [
            *POLICY_REQUIRED,
            "--port",
            "31234",
            "--w-rl",
            "0.25",
            "--infer-sessions",
            "--at-least-one",
            "false",
            "--log-json",
            "yes",
            "--no-allow-unauthenticated",
        ]
    )
    assert (s.port, s.w_rl) == (31234, 0.25)
    assert type(s.port) is int and type(s.w_rl) is float
    assert (s.infer_sessions, s.at_least_one, s.log_json, s.allow_unauthenticated) == (True, False, True, False)
    cfg = parse_config([*TRAIN_REQUIRED, "--no-weight-sync", "--progress", "false", "--normalize-advantages"])
    assert (cfg.weight_sync, cfg.progress, cfg.normalize_advantages) == (False, False, True)


@pytest.mark.parametrize("argv", [["--port", "12x"], ["--w-rl", "high"], ["--infer-sessions", "maybe"]])
def test_malformed_typed_values_exit_2(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert _exit_code(policy_main, [*POLICY_REQUIRED, *argv]) == 2
    assert f"argument {argv[0]}" in capsys.readouterr().err


def test_invalid_values_raise_for_callers_and_exit_2_for_scripts(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="pause_mode"):
        settings_from_args([*POLICY_REQUIRED, "--pause-mode", "bogus"])
    assert _exit_code(policy_main, [*POLICY_REQUIRED, "--pause-mode", "bogus"]) == 2
    assert "hindsight-policy: invalid configuration:" in capsys.readouterr().err
    assert _exit_code(train_main, [*TRAIN_REQUIRED, "--baseline", "median"]) == 2
    assert "invalid choice 'median'" in capsys.readouterr().err
    with pytest.raises(ValueError, match="model_path"):
        parse_settings(PolicySettings, ["--engine-url", "http://e:1"])  # a required field left unset


def test_list_and_positional_fields() -> None:
    s = settings_from_args([*POLICY_REQUIRED, "--engine-worker-urls", "http://a:1, http://b:2"])
    assert s.engine_worker_urls == ["http://a:1", "http://b:2"]
    t = parse_settings(TinyModelSettings, ["/tmp/out", "--hidden-size", "32"])
    assert (t.out_dir, t.hidden_size, t.layers) == ("/tmp/out", 32, 2)


# ----------------------------------------------------------------------------- env, config file, precedence
def _write(path: Path, text: str) -> Path:
    path.write_text(text, encoding="utf-8")
    return path


@pytest.mark.parametrize("suffix", [".json", ".toml", ".yaml"])
def test_config_file_sets_any_field(tmp_path: Path, suffix: str) -> None:
    body = {
        ".json": json.dumps({"max-new-tokens": 77, "rules_positive": ["yay", "ok"], "backend": "rules"}),
        ".toml": 'max-new-tokens = 77\nrules_positive = ["yay", "ok"]\nbackend = "rules"\n',
        ".yaml": "max-new-tokens: 77\nrules_positive: [yay, ok]\nbackend: rules\n",
    }[suffix]
    path = _write(tmp_path / f"judge{suffix}", body)
    s = parse_settings(JudgeSettings, ["--config", str(path)])
    assert (s.max_new_tokens, s.rules_positive, s.backend) == (77, ["yay", "ok"], "rules")


def test_precedence_flags_over_env_over_file_over_defaults(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = _write(
        tmp_path / "policy.yaml",
        "model_path: m\nengine_url: http://file:1\nport: 1001\nmax_resumes: 3\nteacher_top_k: 5\n",
    )
    monkeypatch.setenv("HINDSIGHT_POLICY_PORT", "2002")
    monkeypatch.setenv("HINDSIGHT_POLICY_MAX_RESUMES", "4")
    s = settings_from_args(["--config", str(path), "--port", "3003"])
    # port: flag > env > file; max_resumes: env > file; teacher_top_k: file > default; w_rl: default
    assert (s.port, s.max_resumes, s.teacher_top_k, s.w_rl, s.engine_url) == (3003, 4, 5, 1.0, "http://file:1")
    assert settings_from_args(["--config", str(path)]).port == 2002
    monkeypatch.delenv("HINDSIGHT_POLICY_PORT")
    assert settings_from_args(["--config", str(path)]).port == 1001
    assert PolicySettings(model_path="m", engine_url="http://e").port == 30000  # no file outside parse_settings


def test_config_file_errors_are_clear(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(ValueError, match="unknown settings mdoe"):
        parse_settings(PolicySettings, ["--config", str(_write(tmp_path / "a.json", '{"mdoe": "rl"}'))])
    with pytest.raises(ValueError, match="unknown format"):
        parse_settings(PolicySettings, ["--config", str(_write(tmp_path / "a.ini", "mode=rl"))])
    assert _exit_code(judge_main, ["--config", str(tmp_path / "missing.toml")]) == 2
    assert "missing.toml" in capsys.readouterr().err


def test_migrate_reads_the_servers_settings(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HINDSIGHT_POLICY_DATA_DIR", "/srv/data")
    m = parse_settings(MigrateSettings, ["--store-url", "sqlite:///x"])
    assert (m.store_url, m.data_dir) == ("sqlite:///x", "/srv/data")
    assert parse_settings(MigrateSettings, []).store_url is None


# ----------------------------------------------------------------------------- trainer specifics
def test_trainer_admin_key_never_on_argv(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    assert _exit_code(train_main, [*TRAIN_REQUIRED, "--admin-api-key", "k"]) == 2
    assert "unrecognized arguments: --admin-api-key" in capsys.readouterr().err
    monkeypatch.setenv("HINDSIGHT_TRAIN_ADMIN_API_KEY", "from-env")
    assert parse_config(TRAIN_REQUIRED).admin_api_key == "from-env"
    key_file = _write(tmp_path / "admin.key", "from-file\n")
    cfg = parse_config([*TRAIN_REQUIRED, "--admin-api-key-file", str(key_file)])
    assert cfg.admin_api_key == "from-file"  # the file wins over the environment
    assert cfg.to_dict()["admin_api_key"] == "***"
    assert _exit_code(train_main, [*TRAIN_REQUIRED, "--admin-api-key-file", str(tmp_path / "nope")]) == 2
    assert "admin_api_key_file" in capsys.readouterr().err


def test_trainer_defaults_typed_and_steps_zero_runs_until_stopped(monkeypatch: pytest.MonkeyPatch) -> None:
    cfg = parse_config(TRAIN_REQUIRED)
    assert (cfg.steps, cfg.batch_size, cfg.lr) == (10, 8, 1e-5)
    assert parse_config([*TRAIN_REQUIRED, "--steps", "0"]).steps == UNBOUNDED_STEPS
    monkeypatch.setenv("HINDSIGHT_TRAIN_BATCH_SIZE", "16")
    assert parse_config(TRAIN_REQUIRED).batch_size == 16
    with pytest.raises(Exception, match="frozen"):
        cfg.lr = 1.0  # type: ignore[misc]


def test_report_key_from_the_policy_servers_variable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HINDSIGHT_POLICY_ADMIN_API_KEY", "k1")
    r = parse_settings(ReportSettings, [str(tmp_path), "--policy-url", "http://p:1"])
    assert (r.run_dir, r.policy_url, r.admin_api_key) == (tmp_path, "http://p:1", "k1")
    with pytest.raises(SystemExit):
        parse_cli(ReportSettings, [str(tmp_path), "--admin-api-key", "k"])


def test_every_script_documents_its_env_prefix(capsys: pytest.CaptureFixture[str]) -> None:
    for prog, main, cls in SCRIPTS:
        _exit_code(main, ["--help"])
        prefix = str(cls.model_config.get("env_prefix"))
        assert re.match(r"HINDSIGHT_[A-Z_]+_$", prefix), prog
        assert f"[env {prefix}" in " ".join(capsys.readouterr().out.split()), prog
