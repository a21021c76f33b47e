"""devkit.model_cache: one build per key (also when builders race), keys that change with every input, no
half-written entry exposed."""

from __future__ import annotations

import functools
import threading
import time
from pathlib import Path

import pytest

from devkit.model_cache import cache_key, cached_build, copy_of, folder_digest

pytestmark = pytest.mark.unit


def _entries(root: Path) -> list[str]:
    """What the cache root holds besides its per-key lock files."""
    return sorted(p.name for p in root.iterdir() if not p.name.endswith(".lock"))


def _writer(calls: list[Path], text: str):
    def build(out: Path) -> Path:
        calls.append(out)
        (out / "weights.txt").write_text(text)
        return out

    return build


def test_a_key_is_built_once_and_then_read(tmp_path):
    calls: list[Path] = []
    first = cached_build("policy", {"seed": 0}, _writer(calls, "w0"), root=tmp_path)
    again = cached_build("policy", {"seed": 0}, _writer(calls, "other"), root=tmp_path)
    assert first == again and len(calls) == 1
    assert (first / "weights.txt").read_text() == "w0"
    assert _entries(tmp_path) == [first.name], "the build folder was renamed, not left beside"


def test_every_input_and_the_kind_change_the_key():
    base = cache_key("policy", {"seed": 0, "hidden_size": 64})
    assert cache_key("policy", {"seed": 1, "hidden_size": 64}) != base
    assert cache_key("policy", {"seed": 0, "hidden_size": 32}) != base
    assert cache_key("teacher", {"seed": 0, "hidden_size": 64}) != base
    assert cache_key("policy", {"hidden_size": 64, "seed": 0}) == base  # order of the inputs is not an input


def test_a_failed_build_leaves_no_entry_and_is_retried(tmp_path):
    def broken(out: Path) -> Path:
        (out / "partial.bin").write_text("half")
        raise RuntimeError("killed mid-build")

    with pytest.raises(RuntimeError, match="mid-build"):
        cached_build("policy", {"seed": 0}, broken, root=tmp_path)
    assert _entries(tmp_path) == []
    calls: list[Path] = []
    entry = cached_build("policy", {"seed": 0}, _writer(calls, "w0"), root=tmp_path)
    assert len(calls) == 1 and (entry / "weights.txt").read_text() == "w0"


def test_racing_builders_of_one_key_build_it_once(tmp_path):
    """Two builders (threads here; processes alike: the lock is on the open file) miss the same key at once:
    the second waits for the first's build and reads it instead of building again."""
    calls: list[Path] = []
    first_building = threading.Event()

    def slow(out: Path) -> Path:
        calls.append(out)
        first_building.set()
        time.sleep(0.3)  # keeps the build in progress while the other builder arrives (it must not start one)
        (out / "weights.txt").write_text("w0")
        return out

    got: list[Path] = []
    first = threading.Thread(target=lambda: got.append(cached_build("policy", {"seed": 0}, slow, root=tmp_path)))
    first.start()
    assert first_building.wait(10)
    got.append(cached_build("policy", {"seed": 0}, _writer(calls, "other"), root=tmp_path))
    first.join(10)
    assert len(calls) == 1 and got[0] == got[1] and (got[1] / "weights.txt").read_text() == "w0"
    assert _entries(tmp_path) == [got[0].name]


def test_an_entry_that_lost_its_marker_is_rebuilt(tmp_path):
    calls: list[Path] = []
    entry = cached_build("policy", {"seed": 0}, _writer(calls, "w0"), root=tmp_path)
    (entry / ".hindsight-complete").unlink()
    # The half-entry is in the way of the rename: the new build fails loudly rather than serve it.
    with pytest.raises(OSError):
        cached_build("policy", {"seed": 0}, _writer(calls, "w1"), root=tmp_path)


def test_copies_are_private(tmp_path):
    entry = cached_build("policy", {"seed": 0}, _writer([], "w0"), root=tmp_path / "cache")
    mine = copy_of(entry, tmp_path / "mine")
    (mine / "weights.txt").write_text("trained")
    assert (entry / "weights.txt").read_text() == "w0"
    assert not (mine / ".hindsight-complete").exists()


def test_folder_digest_covers_names_and_bytes_not_the_marker(tmp_path):
    entry = cached_build("policy", {"seed": 0}, _writer([], "w0"), root=tmp_path / "cache")
    copy = copy_of(entry, tmp_path / "copy")
    assert folder_digest(entry) == folder_digest(copy), "an entry and its copy key a teacher alike"
    (copy / "weights.txt").write_text("w1")
    assert folder_digest(copy) != folder_digest(entry)
    (copy / "weights.txt").rename(copy / "other.txt")
    (copy / "other.txt").write_text("w0")
    assert folder_digest(copy) != folder_digest(entry)


def test_the_cli_copies_one_cached_build_into_each_folder(tmp_path, monkeypatch):
    """``hindsight-tiny-model`` builds into the cache once; a second folder gets a byte-identical copy without a
    build, and ``--no-cache`` builds afresh (same seed, same bytes)."""
    from devkit import tiny_model, tiny_model_cli

    monkeypatch.setenv("HINDSIGHT_MODEL_CACHE", str(tmp_path / "cache"))
    built: list[Path] = []
    real_build = tiny_model.build_tiny_model
    monkeypatch.setattr(tiny_model, "build_tiny_model", lambda out, **kw: built.append(out) or real_build(out, **kw))
    args = ["--hidden-size", "16", "--layers", "1", "--max-position-embeddings", "128"]
    tiny_model_cli.main([str(tmp_path / "a"), *args])
    tiny_model_cli.main([str(tmp_path / "b"), *args])
    assert len(built) == 1, "the second folder is a copy of the first build"
    tiny_model_cli.main([str(tmp_path / "c"), *args, "--no-cache"])
    assert len(built) == 2 and Path(built[1]) == tmp_path / "c"
    assert folder_digest(tmp_path / "a") == folder_digest(tmp_path / "b") == folder_digest(tmp_path / "c")


def test_naming_a_default_gives_the_same_entry(tmp_path, monkeypatch):
    from devkit import model_cache, tiny_model

    built: list[dict] = []

    @functools.wraps(tiny_model.build_tiny_model)  # the real signature: its defaults make the key
    def record(out, **kw):
        built.append(kw)
        return out

    monkeypatch.setattr(tiny_model, "build_tiny_model", record)
    plain = model_cache.tiny_policy(seed=3, root=tmp_path)
    named = model_cache.tiny_policy(seed=3, hidden_size=64, num_layers=2, root=tmp_path)
    other = model_cache.tiny_policy(seed=3, hidden_size=32, root=tmp_path)
    assert plain == named != other and len(built) == 2


def test_scaled_logits_are_the_originals_times_the_scale(tiny_model_dir, tmp_path):
    """What the tool policy's scaling step promises: the same model with every logit multiplied by the scale."""
    import torch
    from transformers import AutoModelForCausalLM

    from devkit.model_cache import scale_logits

    scaled = scale_logits(Path(tiny_model_dir), tmp_path / "scaled", 4.0)
    ids = torch.tensor([[1, 5, 9, 200, 31, 7]])
    with torch.no_grad():
        base = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)(input_ids=ids).logits
        out = AutoModelForCausalLM.from_pretrained(scaled, dtype=torch.float32)(input_ids=ids).logits
    # A power of two scales every product and partial sum exactly (no rounding), through the same kernels.
    assert torch.equal(out, base * 4.0)
    assert folder_digest(Path(tiny_model_dir)) != folder_digest(scaled)
    assert (scaled / "tokenizer.json").read_bytes() == (Path(tiny_model_dir) / "tokenizer.json").read_bytes()
