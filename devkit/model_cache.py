"""A build-once cache of the tiny models, keyed by everything their builders read.

Building the tiny policy takes seconds and the tiny teacher minutes (it is fine-tuned), yet the same seed
always gives the same weights: tests, benches and the dev stack take them from
``$HINDSIGHT_MODEL_CACHE`` (default ``~/.cache/hindsight/tiny-models``) instead of rebuilding them.

Contract: :func:`cached_build` returns a folder that a builder produced from exactly these inputs. The
key hashes the builder's name and keyword inputs, the source of ``devkit/tiny_model.py`` and of the chat
template, and the torch / transformers / tokenizers versions, so any change to what the builder does gives
a new entry (stale entries are never read, only left behind). An entry is built in a private temporary
folder and renamed into place with a completion marker, so a crash mid-build never exposes a half-written
model. Builders of one key take turns on an advisory lock file beside the entry (``flock``, released by
the kernel when a builder dies): parallel test workers, benches and the dev stack that miss the same entry
build it once, the others wait and read it. Entries are read-only by convention: callers that write into a
model folder copy it first (:func:`copy_of`).
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.metadata as metadata
import inspect
import json
import os
import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

CACHE_ENV = "HINDSIGHT_MODEL_CACHE"
_COMPLETE = ".hindsight-complete"


def cache_root() -> Path:
    """Where entries live: ``$HINDSIGHT_MODEL_CACHE``, else ``~/.cache/hindsight/tiny-models``."""
    configured = os.environ.get(CACHE_ENV)
    return Path(configured) if configured else Path.home() / ".cache" / "hindsight" / "tiny-models"


def cache_key(kind: str, inputs: dict[str, Any]) -> str:
    """``kind-<hash>`` of the builder's inputs, its source and the libraries that shape its output."""
    from devkit import tiny_model

    digest = hashlib.sha256()
    digest.update(Path(tiny_model.__file__).read_bytes())
    digest.update(tiny_model.CHAT_TEMPLATE_PATH.read_bytes())
    # The installed versions (each package's own __version__ string) without importing the packages: a cache hit
    # then costs no torch import, which is most of what copying a model folder would cost otherwise.
    versions = [metadata.version(name) for name in ("torch", "transformers", "tokenizers")]
    digest.update(json.dumps({"kind": kind, "inputs": inputs, "versions": versions}, sort_keys=True).encode())
    return f"{kind}-{digest.hexdigest()[:16]}"


def cached_build(kind: str, inputs: dict[str, Any], build: Callable[[Path], Path], *, root: Path | None = None) -> Path:
    """The cached folder for ``(kind, inputs)``, calling ``build(folder)`` once when it is missing."""
    base = root or cache_root()
    final = base / cache_key(kind, inputs)
    if (final / _COMPLETE).is_file():
        return final
    base.mkdir(parents=True, exist_ok=True)
    with (base / f".{final.name}.lock").open("a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # blocks while another process builds this key
        if (final / _COMPLETE).is_file():  # it did: read its build
            return final
        work = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=base))
        try:
            build(work)
            (work / _COMPLETE).write_text(json.dumps({"kind": kind, "inputs": inputs}, sort_keys=True))
            try:
                work.rename(final)
            except OSError:
                # A builder that does not take the lock (an older checkout) renamed its identical build first.
                if not (final / _COMPLETE).is_file():
                    raise
        finally:
            shutil.rmtree(work, ignore_errors=True)
    return final


def tiny_policy(*, seed: int = 0, root: Path | None = None, **options: Any) -> Path:
    """The cached :func:`devkit.tiny_model.build_tiny_model` output for ``seed`` and ``options``."""
    from devkit.tiny_model import build_tiny_model

    # Every keyword the builder takes is in the key, defaults included: a caller that names a default and
    # one that leaves it out get the same entry.
    defaults = {
        name: param.default
        for name, param in inspect.signature(build_tiny_model).parameters.items()
        if param.kind is inspect.Parameter.KEYWORD_ONLY
    }
    inputs = {**defaults, "seed": seed, **options}
    return cached_build("policy", inputs, lambda out: build_tiny_model(out, seed=seed, **options), root=root)


def tiny_teacher(student: Path, prefer_text: str, *, seed: int = 0, root: Path | None = None) -> Path:
    """The cached :func:`devkit.tiny_model.build_teacher` output; the key covers the student's files (any
    folder: a cache entry, a copy of one, or a model built elsewhere)."""
    from devkit.tiny_model import build_teacher

    inputs = {"student": folder_digest(Path(student)), "prefer_text": prefer_text, "seed": seed}
    return cached_build("teacher", inputs, lambda out: build_teacher(student, out, prefer_text, seed=seed), root=root)


def folder_digest(folder: Path) -> str:
    """A hash of every file's relative name and bytes under ``folder`` (the completion marker left out, so a
    cache entry and its copy agree)."""
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file() and p.name != _COMPLETE):
        digest.update(str(path.relative_to(folder)).encode() + b"\0")
        digest.update(hashlib.sha256(path.read_bytes()).digest())
    return digest.hexdigest()[:16]


# The tool policy's logits are scaled by this factor after training: agents sample at temperature 1, and the
# trained decision to call (about 97 % on OpenClaw's real prompt, so one run in 30 answered in text) must hold
# every time. Scaled by 4, a margin of 3.4 nats becomes 13.6: a miss about once in a million runs.
TOOL_POLICY_LOGIT_SCALE = 4.0


def tiny_tool_policy(student: Path, *, seed: int = 0, root: Path | None = None) -> Path:
    """The cached :func:`devkit.tiny_tool_model.build_tool_policy` output (a policy trained to call a tool on a
    trigger word), its logits scaled by :data:`TOOL_POLICY_LOGIT_SCALE`. Like the teacher's, the trained entry's
    key covers the student's files and also that builder's own source; the scaled entry's covers the trained
    files and the scale, so changing the scale never retrains."""
    from devkit import tiny_tool_model

    builder = hashlib.sha256(Path(tiny_tool_model.__file__).read_bytes()).hexdigest()[:16]
    inputs = {"student": folder_digest(Path(student)), "seed": seed, "builder": builder}
    trained = cached_build(
        "tool-policy", inputs, lambda out: tiny_tool_model.build_tool_policy(student, out, seed=seed), root=root
    )
    scale = TOOL_POLICY_LOGIT_SCALE
    return cached_build(
        "tool-policy-scaled",
        {"trained": folder_digest(trained), "logit_scale": scale},
        lambda out: scale_logits(trained, out, scale),
        root=root,
    )


def scale_logits(model_dir: Path, out: Path, scale: float) -> Path:
    """A copy of the Qwen3-style model at ``model_dir`` whose logits are ``scale`` times the original's: the
    final RMSNorm's weight is scaled, which feeds only the (tied) output head, never the input embeddings.
    Sampling it at temperature T is sampling the original at T / ``scale``."""
    from safetensors.numpy import load_file, save_file

    copy_of(model_dir, out)
    weights = load_file(str(out / "model.safetensors"))
    weights["model.norm.weight"] = weights["model.norm.weight"] * scale
    save_file(weights, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def copy_of(entry: Path, dest: Path) -> Path:
    """A private, writable copy of a cache entry (tests and engines may write into their model folder); files
    already in ``dest`` with the same names are overwritten."""
    shutil.copytree(entry, dest, ignore=shutil.ignore_patterns(_COMPLETE), dirs_exist_ok=True)
    return dest
