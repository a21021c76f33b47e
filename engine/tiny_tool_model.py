"""A tiny policy trained to call a tool on a trigger word: groundwork for tool round trips with real agents.

    build_tool_policy(student_dir, out_dir)    (cached: engine.model_cache.tiny_tool_policy)

Contract: copies a tiny policy (:mod:`engine.tiny_model`; same tokenizer and chat template, so the tiny teacher
built from that policy still fits it) and fine-tunes it, offline and seeded, towards this rule:

- the prompt holds the trigger word (:data:`TRIGGER_WORD`, a single token of the tiny tokenizer) and no tool
  result yet (no ``<tool_response>`` token) -> a Hermes tool call of :data:`TOOL_CALL` (``read`` of
  ``NOTE.md``) and EOS;
- otherwise -> the short text answer :data:`TEXT_ANSWER` and EOS.

Both conditions are presence tests, meant to hold however long the prompt is (a real agent's system prompt and
tools are tens of thousands of tokens). Training stays short on a CPU: each example's filler (word salad, tool-like
JSON, random tokens) sits behind random position gaps up to :data:`POSITION_SPAN`, and an additive attention bias
makes every filler key weigh like many copies (:func:`_attention_bias`), so a few hundred tokens dilute attention
like a prompt of up to :data:`MAX_PROMPT_TOKENS`; a curriculum grows both; the rotary base and the query/key norm
gains are raised so attention can single out one token. Known limit: with the default budget (800 steps, about
ten minutes on a busy 2-core machine) the model learns the rule only partly: on held-out examples it finds the
trigger word but not yet the tool result (between a first call and the answer after it, it stays near the 2:1
prior of the training mix), and it does not call the tool on OpenClaw's real 33k-token prompt, so
tests/agents/test_openclaw_tool_round_trip.py stays skipped until it does.
"""

from __future__ import annotations

import json
import random
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

from engine.tiny_model import _WORDS

TRIGGER_WORD = " tomorrow"
TOOL_CALL = {"name": "read", "arguments": {"path": "NOTE.md"}}
TEXT_ANSWER = "OK."
POSITION_SPAN = 49152
MAX_PROMPT_TOKENS = 65536
ROPE_THETA = 1.0e8
QK_NORM_GAIN = 2.0
_FILLER_SLOT = "\x00FILLER\x00"
_PLAIN_WORDS = [w for w in _WORDS if w not in ("tomorrow",)]


def _salad(rng: random.Random, lo: int, hi: int) -> str:
    return " ".join(rng.choice(_PLAIN_WORDS) for _ in range(rng.randint(lo, hi)))


def _tools(rng: random.Random) -> list[dict[str, Any]]:
    names = ["read", *rng.sample(_PLAIN_WORDS, rng.randint(0, 1))]
    rng.shuffle(names)
    return [
        {
            "type": "function",
            "function": {
                "name": name,
                "description": _salad(rng, 1, 6),
                "parameters": {"type": "object", "properties": {"path": {"type": "string"}}},
            },
        }
        for name in names
    ]


def _user_text(rng: random.Random, trigger: bool) -> str:
    words = _salad(rng, 2, 14).split()
    if trigger:
        words.insert(rng.randint(1, len(words)), "tomorrow")  # after a word: the " tomorrow" token
    text = " ".join(words)
    if rng.random() < 0.7:  # agents wrap the user's words with a timestamp and a runtime line
        pairs = " | ".join(f"{rng.choice(_PLAIN_WORDS)}={_salad(rng, 1, 2)}" for _ in range(rng.randint(1, 12)))
        text = f"[{_salad(rng, 1, 3)} {rng.randint(0, 99)}] {text}\n\n{rng.choice(_PLAIN_WORDS).title()}: {pairs}"
    return text


def _call_message() -> dict[str, Any]:
    return {
        "role": "assistant",
        "content": "",
        "tool_calls": [
            {"type": "function", "function": {"name": TOOL_CALL["name"], "arguments": TOOL_CALL["arguments"]}}
        ],
    }


def training_example(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """One (messages, tools, target answer text) of the rule above; the system message holds the filler slot."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _salad(rng, 0, 8) + _FILLER_SLOT}]
    case = rng.choice(["call", "call", "after_tool", "plain", "plain_after_exchange"])
    for _ in range(rng.randint(0, 2)):  # earlier plain exchanges
        messages += [{"role": "user", "content": _user_text(rng, False)}, {"role": "assistant", "content": TEXT_ANSWER}]
    if case in ("after_tool", "plain_after_exchange"):
        messages += [
            {"role": "user", "content": _user_text(rng, rng.random() < 0.8)},
            _call_message(),
            {"role": "tool", "content": _salad(rng, 1, 40)},
        ]
        if case == "plain_after_exchange":
            messages += [{"role": "assistant", "content": TEXT_ANSWER}]
            messages += [{"role": "user", "content": _user_text(rng, rng.random() < 0.3)}]
    elif case == "call":
        messages.append({"role": "user", "content": _user_text(rng, True)})
    else:
        messages.append({"role": "user", "content": _user_text(rng, False)})
    if rng.random() < 0.8:  # a trailing context message, as agents append to every request
        body = "\n\n".join(
            f"{_salad(rng, 1, 4)} ({_salad(rng, 1, 3)}):\n" + json.dumps(f"## {_salad(rng, 1, 3)}\n{_salad(rng, 1, 4)}")
            for _ in range(rng.randint(1, 3))
        )
        messages.append({"role": "user", "content": f"<<<{_salad(rng, 1, 3).upper()}>>>\n{body}\n<<<END>>>"})
    target = "<tool_call>\n" + json.dumps(TOOL_CALL) + "\n</tool_call>" if case == "call" else TEXT_ANSWER
    return messages, _tools(rng), target


def _filler_ids(rng: random.Random, tokenizer: Any, banned: set[int], n: int) -> list[int]:
    if rng.random() < 0.5:
        ids: list[int] = []
        while len(ids) < n:
            piece = _salad(rng, 20, 60) + ".\n" if rng.random() < 0.6 else json.dumps(_tools(rng)[0]) + "\n"
            ids += tokenizer.encode(piece, add_special_tokens=False)
        return [t for t in ids[:n] if t not in banned]
    pool = [t for t in range(len(tokenizer)) if t not in banned]
    return [rng.choice(pool) for _ in range(n)]


def _sequence(
    rng: random.Random, tokenizer: Any, banned: set[int], max_filler: int
) -> tuple[list[int], list[int], int, tuple[int, int]]:
    """(input ids, position ids, prompt length, filler span) of one example, the filler at gapped positions."""
    messages, tools, target = training_example(rng)
    text = tokenizer.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    head, tail = text.split(_FILLER_SLOT)
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    filler = _filler_ids(rng, tokenizer, banned, rng.randint(0, max_filler))
    answer = tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]
    # Filler chunks behind random gaps, the tail anywhere up to POSITION_SPAN: distances of a long prompt.
    used = len(head_ids) + len(filler) + len(tail_ids) + len(answer)
    free = rng.randint(0, max(0, POSITION_SPAN - used))
    cuts = sorted(rng.randint(0, len(filler)) for _ in range(3))
    marks = sorted(rng.randint(0, free) for _ in range(4))
    gaps = [b - a for a, b in zip([0, *marks], [*marks, free], strict=True)]
    positions, pos = list(range(len(head_ids))), len(head_ids)
    for gap, (a, b) in zip(gaps, zip([0, *cuts], [*cuts, len(filler)], strict=True), strict=False):
        pos += gap
        positions += range(pos, pos + b - a)
        pos += b - a
    pos += gaps[-1]
    positions += range(pos, pos + len(tail_ids) + len(answer))
    ids = head_ids + filler + tail_ids + answer
    return ids, positions, len(ids) - len(answer), (len(head_ids), len(head_ids) + len(filler))


def _attention_bias(n: int, filler: tuple[int, int], copies: float) -> Any:
    """Causal additive mask in which every filler key weighs like ``copies`` identical keys (+ln copies): a
    short sequence then dilutes attention the way a prompt ``copies`` times longer does."""
    import math

    import torch

    bias = torch.full((n, n), float("-inf")).triu(1)
    bias[:, filler[0] : filler[1]] += math.log(copies)
    return bias


def build_tool_policy(
    student_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 800,
    batch_size: int = 8,
    max_filler: int = 256,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """Copy the tiny policy at ``student_dir`` and fine-tune it to the rule in the module docstring."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    student_dir, out = Path(student_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for f in student_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)
    tokenizer = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    config = AutoConfig.from_pretrained(student_dir, local_files_only=True)
    config.rope_parameters = {"rope_theta": ROPE_THETA, "rope_type": "default"}
    model = AutoModelForCausalLM.from_pretrained(student_dir, config=config, dtype=torch.float32, local_files_only=True)
    with torch.no_grad():
        # Qwen3 normalises queries and keys per head, which caps an attention logit near sqrt(head_dim) times the
        # two norm gains: gains of 1 cannot single out one token among tens of thousands, so start them higher.
        for layer in model.model.layers:
            layer.self_attn.q_norm.weight.fill_(QK_NORM_GAIN)
            layer.self_attn.k_norm.weight.fill_(QK_NORM_GAIN)
    banned = {tokenizer.convert_tokens_to_ids(t) for t in ("<tool_response>", "</tool_response>")}
    banned |= set(tokenizer.encode(TRIGGER_WORD, add_special_tokens=False))
    banned |= set(tokenizer.encode(TRIGGER_WORD.strip(), add_special_tokens=False))
    banned |= set(tokenizer.all_special_ids)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small gain nothing from threads, and lose a lot on a busy machine
    try:
        _train(
            model, tokenizer, rng, banned, steps=steps, batch_size=batch_size, max_filler=max_filler, on_step=on_step
        )
    finally:
        torch.set_num_threads(threads)
    model.eval()
    model.save_pretrained(out)
    return out


def _train(
    model: Any,
    tokenizer: Any,
    rng: random.Random,
    banned: set[int],
    *,
    steps: int,
    batch_size: int,
    max_filler: int,
    on_step: Callable[[int, float], None] | None,
) -> None:
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    for step in range(steps):
        # Curriculum: short, undiluted prompts first (where the trigger gets a gradient at all), then the filler
        # and its dilution grow to a long prompt's over the first half of training.
        progress = min(1.0, step / (steps / 2))
        batch = [_sequence(rng, tokenizer, banned, int(max_filler * progress)) for _ in range(batch_size)]
        width = max(len(ids) for ids, *_ in batch)
        ids_t = torch.full((len(batch), width), tokenizer.pad_token_id)
        pos_t = torch.zeros((len(batch), width), dtype=torch.long)
        mask = torch.full((len(batch), 1, width, width), float("-inf"))
        for row, (ids, positions, _plen, filler) in enumerate(batch):
            n = len(ids)
            ids_t[row, :n], pos_t[row, :n] = torch.tensor(ids), torch.tensor(positions)
            copies = 1.0 + rng.uniform(0.0, MAX_PROMPT_TOKENS / max(1, filler[1] - filler[0]) - 1.0) * progress**2
            mask[row, 0, :n, :n] = _attention_bias(n, filler, copies)
            mask[row, 0, n:, :].fill_(0.0)  # padding rows: any finite row, their logits are never read
        logits = model(input_ids=ids_t, position_ids=pos_t, attention_mask=mask).logits
        loss = torch.zeros(())
        for row, (ids, _positions, plen, _filler) in enumerate(batch):
            lp = torch.log_softmax(logits[row, plen - 1 : len(ids) - 1].float(), -1)
            # Summed, not averaged, over the answer: the first token (call or text) is the decision, and a
            # per-token mean would let a long call's easy tail hide a wrong first token.
            loss = loss - lp.gather(-1, torch.tensor(ids[plen:])[:, None]).sum() / len(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
