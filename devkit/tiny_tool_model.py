"""A tiny policy trained to call a tool on a trigger word, whatever the length of the prompt before it.

    build_tool_policy(student_dir, out_dir)    (cached: devkit.model_cache.tiny_tool_policy)

Contract: copies a tiny policy (:mod:`devkit.tiny_model`; same tokenizer and chat template, so the tiny teacher
built from that policy still fits it), switches every layer to sliding-window attention of
:data:`WINDOW_TOKENS`, and fine-tunes it, offline and seeded, towards this rule:

- the request tail holds the trigger word (:data:`TRIGGER_WORD`, a single token of the tiny tokenizer) and no
  tool result (no ``<tool_response>`` token) -> a Hermes tool call of :data:`TOOL_CALL` (``read`` of
  ``NOTE.md``) and EOS;
- otherwise -> the short text answer :data:`TEXT_ANSWER` and EOS.

Why a window: a real agent's system prompt and tools run to tens of thousands of tokens, yet what decides is the
tail (the last user message, a tool result, the agent's trailing context message). With every layer windowed
and rotary (relative) positions, the next-token distribution depends only on the last
``num_layers * (WINDOW_TOKENS - 1)`` tokens, so the model behaves at 33k tokens exactly as on any sequence that
ends with the same tail. Training therefore ends on sequences of :data:`TRAIN_PROMPT_TOKENS` (longer than that
receptive field), after a cheaper first phase on short tails: each is the end of a rendered agent-like request (filler system prompt and tools, user
messages wrapped with a timestamp and a runtime line, tool calls and results, a trailing context message),
which makes the short training sequences and a long real prompt the same problem, not an approximation.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable
from pathlib import Path
from typing import Any

from devkit.tiny_model import _WORDS, copy_model_files

TRIGGER_WORD = " tomorrow"
TOOL_CALL = {"name": "read", "arguments": {"path": "NOTE.md"}}
TEXT_ANSWER = "OK."
WINDOW_TOKENS = 768
TRAIN_PROMPT_TOKENS = 1600
SHORT_PROMPT_TOKENS = 384
SHORT_PHASE = 0.78
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


def _value(rng: random.Random) -> str:
    if rng.random() < 0.3:  # paths and versions, as in an agent's runtime line
        return "/" + "/".join(f"{rng.choice(_PLAIN_WORDS)}-{rng.randint(0, 999)}" for _ in range(rng.randint(1, 5)))
    return _salad(rng, 1, 3)


def _user_text(rng: random.Random, trigger: bool) -> str:
    words = _salad(rng, 2, 14).split()
    if trigger:
        words.insert(rng.randint(1, len(words)), "tomorrow" + rng.choice(["", "", "?", ".", ","]))
    text = " ".join(words)
    if rng.random() < 0.9:  # agents wrap the user's words with a timestamp and a runtime line
        pairs = " | ".join(f"{rng.choice(_PLAIN_WORDS)}={_value(rng)}" for _ in range(rng.randint(3, 16)))
        stamp = f"{_salad(rng, 1, 2)} {rng.randint(1000, 9999)}-{rng.randint(1, 12):02d} {rng.randint(0, 23)}:00"
        text = f"[{stamp}] {text}\n\n{rng.choice(_PLAIN_WORDS).title()}: {pairs}"
    return text


def _call_message(rng: random.Random) -> dict[str, Any]:
    # Agents resend the call with their own id and the arguments as a compact JSON string.
    args: Any = (
        TOOL_CALL["arguments"] if rng.random() < 0.3 else json.dumps(TOOL_CALL["arguments"], separators=(",", ":"))
    )
    call: dict[str, Any] = {"type": "function", "function": {"name": TOOL_CALL["name"], "arguments": args}}
    if rng.random() < 0.7:
        call["id"] = f"call_{rng.randint(0, 10**6)}"
    return {"role": "assistant", "content": rng.choice(["", None]), "tool_calls": [call]}


def training_example(rng: random.Random) -> tuple[list[dict[str, Any]], list[dict[str, Any]], str]:
    """One (messages, tools, target answer text) of the rule above; the system message holds the filler slot."""
    messages: list[dict[str, Any]] = [{"role": "system", "content": _salad(rng, 0, 8) + _FILLER_SLOT}]
    case = rng.choice(["call", "call", "after_tool", "plain", "plain_after_exchange"])
    for _ in range(rng.randint(0, 2)):  # earlier plain exchanges
        messages += [{"role": "user", "content": _user_text(rng, False)}, {"role": "assistant", "content": TEXT_ANSWER}]
    if case in ("after_tool", "plain_after_exchange"):
        messages += [
            {"role": "user", "content": _user_text(rng, rng.random() < 0.8)},
            _call_message(rng),
            {"role": "tool", "content": _user_text(rng, rng.random() < 0.5) + rng.choice(["", "\n"])},
        ]
        if case == "plain_after_exchange":
            messages += [{"role": "assistant", "content": TEXT_ANSWER}]
            messages += [{"role": "user", "content": _user_text(rng, False)}]
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
    """``n`` tokens of system-prompt-like filler (word salad, tool-like JSON, random tokens), none of ``banned``."""
    ids: list[int] = []
    pool = [t for t in range(len(tokenizer)) if t not in banned]
    while len(ids) < n:
        roll = rng.random()
        if roll < 0.45:
            ids += tokenizer.encode(_salad(rng, 20, 60) + ".\n", add_special_tokens=False)
        elif roll < 0.9:
            ids += tokenizer.encode(json.dumps(_tools(rng)[0]) + "\n", add_special_tokens=False)
        else:
            ids += [rng.choice(pool) for _ in range(rng.randint(5, 50))]
    return [t for t in ids if t not in banned][:n]


def _sequence(
    rng: random.Random, tokenizer: Any, banned: set[int], prompt_tokens: int = TRAIN_PROMPT_TOKENS
) -> tuple[list[int], list[int]]:
    """(the last ``prompt_tokens`` prompt ids of one rendered example, but never less than its messages after the
    filler, so what decides is always kept; its answer ids with EOS)."""
    from engine.chat import render_prompt_text

    messages, tools, target = training_example(rng)
    head, tail = render_prompt_text(tokenizer, messages, tools).split(_FILLER_SLOT)
    tail_ids = tokenizer.encode(tail, add_special_tokens=False)
    head_ids = tokenizer.encode(head, add_special_tokens=False)
    keep = max(prompt_tokens, len(tail_ids))
    filler = _filler_ids(rng, tokenizer, banned, max(0, keep - len(tail_ids)))
    prompt = (head_ids + filler + tail_ids)[-keep:]
    return prompt, tokenizer.encode(target, add_special_tokens=False) + [tokenizer.eos_token_id]


def build_tool_policy(
    student_dir: str | Path,
    out_dir: str | Path,
    *,
    seed: int = 0,
    steps: int = 460,
    batch_size: int = 8,
    on_step: Callable[[int, float], None] | None = None,
) -> Path:
    """Copy the tiny policy at ``student_dir``, window its attention and fine-tune it to the module's rule."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    student_dir, out = Path(student_dir), Path(out_dir)
    copy_model_files(student_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(student_dir, local_files_only=True)
    config = AutoConfig.from_pretrained(student_dir, local_files_only=True)
    config.use_sliding_window = True
    config.sliding_window = WINDOW_TOKENS
    config.max_window_layers = 0
    config.layer_types = ["sliding_attention"] * config.num_hidden_layers
    model = AutoModelForCausalLM.from_pretrained(student_dir, config=config, dtype=torch.float32, local_files_only=True)
    banned = {tokenizer.convert_tokens_to_ids(t) for t in ("<tool_response>", "</tool_response>")}
    banned |= set(tokenizer.encode(TRIGGER_WORD, add_special_tokens=False))
    banned |= set(tokenizer.encode(TRIGGER_WORD.strip(), add_special_tokens=False))
    banned |= set(tokenizer.all_special_ids)
    rng = random.Random(seed)
    torch.manual_seed(seed)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # matrices this small gain nothing from threads, and lose a lot on a busy machine
    try:
        _train(model, tokenizer, rng, banned, steps=steps, batch_size=batch_size, on_step=on_step)
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
    on_step: Callable[[int, float], None] | None,
) -> None:
    import torch

    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=5e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 10) * max(0.1, 1 - s / steps))
    for step in range(steps):
        # Short tails first (cheap steps that teach the rule), then full-length ones, which make training and a
        # long prompt the same problem (the first positions of a short sequence see less than a window).
        short = step < steps * SHORT_PHASE
        length, rows = (
            (SHORT_PROMPT_TOKENS, batch_size) if short else (TRAIN_PROMPT_TOKENS, max(2, batch_size * 3 // 4))
        )
        batch = [_sequence(rng, tokenizer, banned, length) for _ in range(rows)]
        # Rows are padded on the right: causal attention never lets a pad reach a scored position, so no
        # attention mask beyond the model's own (windowed, causal) one.
        width = max(len(prompt) + len(answer) for prompt, answer in batch)
        ids_t = torch.full((len(batch), width), tokenizer.pad_token_id)
        for row, (prompt, answer) in enumerate(batch):
            ids_t[row, : len(prompt) + len(answer)] = torch.tensor(prompt + answer)
        logits = model(input_ids=ids_t).logits
        loss = torch.zeros(())
        for row, (prompt, answer) in enumerate(batch):
            plen = len(prompt)
            lp = torch.log_softmax(logits[row, plen - 1 : plen - 1 + len(answer)].float(), -1)
            # Summed, not averaged, over the answer: the first token (call or text) is the decision, and a
            # per-token mean would let a long call's easy tail hide a wrong first token.
            loss = loss - lp.gather(-1, torch.tensor(answer)[:, None]).sum() / len(batch)
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        if on_step is not None:
            on_step(step, float(loss.detach()))
