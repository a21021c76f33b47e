"""Small in-memory models for tests of attention behaviour (no files, no cache): built in milliseconds, seeded."""

from __future__ import annotations

from typing import Any


def windowed_qwen3(window: int, *, layers: int = 2, vocab_size: int = 97, seed: int = 0) -> Any:
    """A random Qwen3ForCausalLM (eval mode) whose every layer attends through a ``window``-token sliding window.

    Not devkit.tiny_model.build_tiny_model (the same kind of config): that one saves a folder with a trained
    tokenizer for servers to load; this one lives in memory with a 97-token vocabulary for tests of the attention
    arithmetic alone."""
    import torch
    from transformers import Qwen3Config, Qwen3ForCausalLM

    config = Qwen3Config(
        vocab_size=vocab_size,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=layers,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        use_sliding_window=True,
        sliding_window=window,
        max_window_layers=0,
        layer_types=["sliding_attention"] * layers,
    )
    torch.manual_seed(seed)
    return Qwen3ForCausalLM(config).eval()
