"""One configuration mechanism for every console script: a pydantic-settings class is its command line.

A service's settings class derives from ``CliSettings``; ``parse_cli(cls, argv, prog=...)`` turns it into
the script's command line:

- one flag per field, ``--kebab-case`` of the field name, with the field's ``description`` as its help
  line (a field without one is a programming error: the parser refuses to build);
- typed values: an ``int`` field's flag parses as an int, a ``float`` as a float; ``Literal`` and
  ``OneOf`` fields show their choices; everything else is validated by the model;
- a ``bool`` field takes ``--flag`` (true), ``--flag VALUE`` (true/false/1/0/yes/no/on/off) or ``--no-flag``;
- a field annotated ``Positional()`` is a positional argument; one annotated ``EnvOnly()`` is no flag at
  all (a secret that must not travel on argv: environment or config file only);
- ``--config FILE`` (JSON, TOML or YAML, by suffix) may set any field, by snake or kebab name.

Precedence: flags > environment (the class's ``env_prefix``) > config file > defaults. Bad flags or values
exit 2 with the reason on stderr (argparse's convention); ``parse_settings`` raises ``ValueError`` instead,
for callers and tests that want the exception.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib
import types
from collections.abc import Callable, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import Any, Literal, TypeVar, Union, get_args, get_origin

import yaml
from pydantic import ValidationError
from pydantic.fields import FieldInfo
from pydantic_core import core_schema
from pydantic_settings import BaseSettings, InitSettingsSource, PydanticBaseSettingsSource

from engine.validation import FALSE_WORDS, TRUE_WORDS, bool_word, describe_error

S = TypeVar("S", bound="CliSettings")

# The config file of the settings being built; set only for the duration of one ``parse_settings`` call.
_config_values: ContextVar[dict[str, Any] | None] = ContextVar("config_values", default=None)


class Positional:
    """Field marker (``Annotated[T, Positional()]``): a positional argument instead of a flag."""


class EnvOnly:
    """Field marker: settable from the environment or the config file only, never on argv (secrets)."""


class OneOf:
    """Field marker and validator: the value must be one of ``choices`` (choices kept in one tuple elsewhere)."""

    def __init__(self, choices: Sequence[str]) -> None:
        self.choices = tuple(choices)

    def __get_pydantic_core_schema__(self, source: Any, handler: Callable[[Any], Any]) -> Any:
        return core_schema.no_info_after_validator_function(self._check, handler(source))

    def _check(self, value: str) -> str:
        if value not in self.choices:
            raise ValueError(f"invalid choice {value!r} (choose from {', '.join(self.choices)})")
        return value


class CliSettings(BaseSettings):
    """Base of every console script's settings: adds the config file below the environment."""

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        values = _config_values.get()
        file_source = () if values is None else (InitSettingsSource(settings_cls, init_kwargs=values),)
        return (init_settings, env_settings, dotenv_settings, *file_source, file_secret_settings)


def flag_name(field_name: str) -> str:
    return "--" + field_name.replace("_", "-")


def parse_bool(text: str) -> bool:
    value = bool_word(text)
    if value is None:
        raise argparse.ArgumentTypeError(f"expected one of {'/'.join(TRUE_WORDS + FALSE_WORDS)}, got {text!r}")
    return value


def _has(field: FieldInfo, marker: type) -> bool:
    return any(isinstance(m, marker) for m in field.metadata)


def _scalar(annotation: Any) -> Any:
    """The annotation without ``| None``."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        return args[0] if len(args) == 1 else annotation
    return annotation


def _help(cls: type[CliSettings], name: str, field: FieldInfo) -> str:
    if not field.description:
        raise TypeError(f"{cls.__name__}.{name} has no description: every setting needs a help line")
    text = field.description
    if not field.is_required() and field.default_factory is None and field.default not in (None, "", False):
        text += f" (default: {field.default})"
    prefix = cls.model_config.get("env_prefix", "")
    if prefix and field.validation_alias is None:
        text += f" [env {prefix}{name.upper()}]"
    return text.replace("%", "%%")  # argparse formats help strings with %


def build_parser(cls: type[CliSettings], prog: str, description: str | None = None) -> argparse.ArgumentParser:
    """The argparse parser of ``cls``; only flags given on the command line appear in its namespace."""
    env_only = [
        f"{name} ({_help(cls, name, field)})" for name, field in cls.model_fields.items() if _has(field, EnvOnly)
    ]
    epilog = "set in the environment or the config file only: " + "; ".join(env_only) if env_only else None
    # No abbreviations: a removed flag must fail, not turn into a longer one (--admin-api-key would
    # otherwise be read as --admin-api-key-file and the secret taken for a path).
    parser = argparse.ArgumentParser(
        prog=prog, description=description, epilog=epilog, allow_abbrev=False, argument_default=argparse.SUPPRESS
    )
    parser.add_argument(
        "--config",
        metavar="FILE",
        type=Path,
        help="JSON, TOML or YAML file setting any of the options below (flags and environment win)",
    )
    for name, field in cls.model_fields.items():
        help_text = _help(cls, name, field)
        if _has(field, EnvOnly):
            continue
        annotation = _scalar(field.annotation)
        kw: dict[str, Any] = {"help": help_text}
        if annotation is bool:
            parser.add_argument(
                flag_name(name), dest=name, nargs="?", const=True, type=parse_bool, metavar="BOOL", **kw
            )
            parser.add_argument(
                "--no-" + name.replace("_", "-"), dest=name, action="store_const", const=False, help=argparse.SUPPRESS
            )
            continue
        if annotation is int:
            kw.update(type=int, metavar="N")
        elif annotation is float:
            kw.update(type=float, metavar="X")
        elif not _has(field, Positional):
            kw["metavar"] = "LIST" if get_origin(annotation) is list else "TEXT"
        choices = next((m.choices for m in field.metadata if isinstance(m, OneOf)), None)
        if get_origin(annotation) is Literal:
            choices = tuple(str(c) for c in get_args(annotation))
        if choices:
            kw["metavar"] = "{" + ",".join(choices) + "}"
        if _has(field, Positional):
            if not field.is_required():
                kw["nargs"] = "?"
            parser.add_argument(name, **kw)
        else:
            parser.add_argument(flag_name(name), dest=name, **kw)
    return parser


def load_config_file(cls: type[CliSettings], path: Path) -> dict[str, Any]:
    """Field values from a JSON, TOML or YAML file (keys: field names, snake or kebab case)."""
    text = path.read_text(encoding="utf-8")
    suffix = path.suffix.lower()
    if suffix == ".json":
        raw = json.loads(text)
    elif suffix == ".toml":
        raw = tomllib.loads(text)
    elif suffix in (".yaml", ".yml"):
        raw = yaml.safe_load(text) or {}
    else:
        raise ValueError(f"config file {path}: unknown format (use .json, .toml, .yaml or .yml)")
    if not isinstance(raw, dict):
        raise ValueError(f"config file {path}: expected a mapping of settings")
    values = {str(k).replace("-", "_"): v for k, v in raw.items()}
    unknown = sorted(set(values) - set(cls.model_fields))
    if unknown:  # a misspelt key must not be silently ignored
        raise ValueError(f"config file {path}: unknown settings {', '.join(unknown)}")
    return values


def parse_settings(
    cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None, description: str | None = None
) -> S:
    """``cls`` from flags > environment > ``--config`` file > defaults. Raises ``ValueError`` (a pydantic
    ``ValidationError`` or a config file error) for invalid values; argparse exits 2 on unknown flags."""
    parser = build_parser(cls, prog or cls.__name__, description)
    given = vars(parser.parse_args(list(sys.argv[1:] if argv is None else argv)))
    config_path = given.pop("config", None)
    try:
        file_values = load_config_file(cls, config_path) if config_path is not None else None
    except OSError as exc:
        raise ValueError(f"config file {config_path}: {exc.strerror or exc}") from None
    token = _config_values.set(file_values)
    try:
        return cls(**given)
    finally:
        _config_values.reset(token)


def parse_cli(
    cls: type[S], argv: Sequence[str] | None = None, prog: str | None = None, description: str | None = None
) -> S:
    """``parse_settings`` for a ``main()``: an invalid configuration exits 2 with the reason on stderr."""
    try:
        return parse_settings(cls, argv, prog, description)
    except ValidationError as exc:
        _exit_invalid(prog or cls.__name__, "\n".join(f"  {describe_error(err)}" for err in exc.errors()))
    except ValueError as exc:
        _exit_invalid(prog or cls.__name__, str(exc))
    raise AssertionError("unreachable")  # _exit_invalid exits


def _exit_invalid(prog: str, reason: str) -> None:
    print(f"{prog}: invalid configuration:\n{reason}", file=sys.stderr)  # noqa: T201
    sys.exit(2)
