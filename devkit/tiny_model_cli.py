"""``hindsight-tiny-model``: build (or copy from the model cache) a tiny seeded model for the CPU dev stack.

    hindsight-tiny-model OUT_DIR [--seed N]
    hindsight-tiny-model OUT_DIR --teacher-of STUDENT_DIR --prefer-text TEXT [--seed N]

The first form builds a tiny Qwen3-architecture policy with its own tokenizer and Qwen3's chat template; the second
fine-tunes a copy of STUDENT_DIR into a teacher that clearly prefers TEXT (devkit.tiny_model). By default
the build is taken from devkit.model_cache, built there once: the same inputs give the same bytes. The
command line lives apart from the builders so that editing it does not change the cache keys.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from devkit import tiny_model
from engine.cli_settings import CliSettings, Positional, parse_cli


class TinyModelSettings(CliSettings):
    """``hindsight-tiny-model``'s command line (env prefix ``HINDSIGHT_TINY_MODEL_``)."""

    model_config = SettingsConfigDict(env_prefix="HINDSIGHT_TINY_MODEL_", extra="ignore")

    out_dir: Annotated[str, Positional()] = Field(..., description="folder to write the model to")
    seed: int = Field(0, description="seed of the weights (and of the teacher's fine-tuning)")
    teacher_of: str | None = Field(
        None, description="student model folder to derive a teacher from (with --prefer-text)"
    )
    prefer_text: str | None = Field(None, description="text the teacher should prefer (with --teacher-of)")
    hidden_size: int = Field(64, description="hidden size of a new model")
    layers: int = Field(2, description="decoder layers of a new model")
    max_position_embeddings: int = Field(
        4096,
        ge=64,
        description="context length of a new model in tokens (a teacher keeps its student's); a real agent's "
        "prompt (OpenClaw: about 31k tokens with this tokenizer) needs 32768 or more",
    )
    cache: bool = Field(
        True,
        description="copy an identical earlier build from the model cache ($HINDSIGHT_MODEL_CACHE, else "
        "~/.cache/hindsight/tiny-models; keyed by every input and this builder's source), building it there "
        "once; --no-cache builds in OUT_DIR directly",
    )

    @model_validator(mode="after")
    def _teacher_pair(self) -> TinyModelSettings:
        if bool(self.teacher_of) != bool(self.prefer_text):
            raise ValueError("--teacher-of and --prefer-text go together")
        return self


def main(argv: list[str] | None = None) -> None:
    args = parse_cli(TinyModelSettings, argv, prog="hindsight-tiny-model", description=__doc__.split("\n\n")[0])
    options: dict[str, Any] = {
        "hidden_size": args.hidden_size,
        "num_layers": args.layers,
        "max_position_embeddings": args.max_position_embeddings,
    }
    if args.cache:
        from devkit import model_cache

        if args.teacher_of and args.prefer_text:
            entry = model_cache.tiny_teacher(Path(args.teacher_of), args.prefer_text, seed=args.seed)
        else:
            entry = model_cache.tiny_policy(seed=args.seed, **options)
        path = model_cache.copy_of(entry, Path(args.out_dir))
    elif args.teacher_of and args.prefer_text:
        path = tiny_model.build_teacher(args.teacher_of, args.out_dir, args.prefer_text, seed=args.seed)
    else:
        path = tiny_model.build_tiny_model(args.out_dir, seed=args.seed, **options)
    print(path)


if __name__ == "__main__":
    main()
