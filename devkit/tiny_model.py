"""Build tiny, seeded Qwen3-architecture models offline, for the CPU dev stack and the tests.

The builders behind ``hindsight-tiny-model`` (engine.tiny_model_cli) and engine.model_cache, whose keys
cover this file's source: only what shapes a model lives here.

``build_tiny_model`` trains a byte-level BPE tokenizer on a deterministic built-in corpus (no network, no
files outside this package), attaches Qwen3's own chat template (``chat_template.jinja``, byte for byte the
``chat_template`` of Qwen/Qwen3-0.6B, Apache-2.0: thinking on by default, ``enable_thinking=False`` opens an
empty think block, earlier turns' reasoning dropped, Hermes ``<tool_call>`` markup), and saves a randomly
initialised Qwen3ForCausalLM (head_dim 32) as an ordinary Hugging Face folder. As in Qwen3's tokenizer, every
marker that template writes is one token: ChatML's specials, and the think / tool-call / tool-response tags
as added tokens that decoding keeps. The same seed gives byte-identical weights.

``build_teacher`` copies the student and fine-tunes it briefly (a few hundred tiny AdamW steps on
chat prompts answered with TEXT) so that its output distribution clearly prefers TEXT's tokens while
sharing the student's tokenizer: a real teacher for on-policy-distillation tests.
"""

from __future__ import annotations

import json
import random
import shutil
from pathlib import Path
from typing import Any

CHAT_TEMPLATE_PATH = Path(__file__).with_name("chat_template.jinja")
SPECIAL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|pad|>"]
# Markers that must stay single tokens and survive decoding (not "special" in skip_special_tokens terms), as in
# Qwen3's own tokenizer.
MARKER_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|pad|>"

_WORDS = (
    "the a an of to in and or is was be it this that with for on as at by from you your we our they "
    "user assistant tool system please thanks thank sorry wrong right correct again no yes not done ok "
    "file files read write open close list search find weather city today tomorrow time date error "
    "result results value answer question hint because should would could instead use using used "
    "function call arguments name path query json python code test tests run fix bug update change "
    "good bad better best more less first last next step steps turn reply response request judge "
    "score reward boxed think plan check return true false null none number string data model"
).split()
_SNIPPETS = [
    "\\boxed{1}",
    "\\boxed{0}",
    "\\boxed{-1}",
    "[HINT_START]",
    "[HINT_END]",
    '{"name": "get_weather", "arguments": {"city": "Paris"}}',
    "def main():\n    return 0\n",
    "Thanks, that worked.",
    "No, that is wrong. Use the other file.",
    "Error: file not found",
]


def _corpus(seed: int = 1234, n_lines: int = 4000) -> list[str]:
    """Deterministic training text: word salad plus the markers and formats the stack uses."""
    rng = random.Random(seed)
    lines = []
    for i in range(n_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(4, 16))]
        if i % 5 == 0:
            words.insert(rng.randrange(len(words)), rng.choice(_SNIPPETS))
        if i % 7 == 0:
            words.append(str(rng.randint(0, 999)))
        text = " ".join(words)
        lines.append(text.capitalize() + rng.choice([".", "?", "!", ":", ""]))
    return lines


def build_tokenizer(vocab_size: int = 2048) -> Any:
    """Byte-level BPE trained on the built-in corpus, wrapped as PreTrainedTokenizerFast."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    tok.add_tokens([AddedToken(t, special=False, normalized=False) for t in MARKER_TOKENS])
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, eos_token=EOS_TOKEN, pad_token=PAD_TOKEN, bos_token=None, unk_token=None
    )
    fast.chat_template = CHAT_TEMPLATE_PATH.read_text()
    return fast


def _fix_tokenizer_config(out: Path) -> None:
    # transformers 5 writes "TokenizersBackend", which 4.x cannot load.
    cfg_path = out / "tokenizer_config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["tokenizer_class"] = "PreTrainedTokenizerFast"
    cfg_path.write_text(json.dumps(cfg, indent=2, ensure_ascii=False))


def build_tiny_model(
    out_dir: str | Path,
    *,
    seed: int = 0,
    hidden_size: int = 64,
    num_layers: int = 2,
    vocab_size: int = 2048,
    max_position_embeddings: int = 4096,
) -> Path:
    """Build and save a seeded random Qwen3 model + tokenizer; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen3Config

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(vocab_size)
    eos_id = tokenizer.convert_tokens_to_ids(EOS_TOKEN)
    pad_id = tokenizer.convert_tokens_to_ids(PAD_TOKEN)
    cfg = Qwen3Config(
        vocab_size=len(tokenizer),
        hidden_size=hidden_size,
        intermediate_size=hidden_size * 2,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=32,
        max_position_embeddings=max_position_embeddings,
        tie_word_embeddings=True,
        eos_token_id=eos_id,
        pad_token_id=pad_id,
        bos_token_id=None,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(cfg, dtype=torch.float32)
    with torch.no_grad():
        # A wider init than the default 0.02 gives the random model a non-flat next-token distribution.
        for p in model.parameters():
            if p.dim() == 2:
                p.normal_(0.0, 0.08, generator=torch.Generator().manual_seed(seed + p.numel()))
    model.generation_config.eos_token_id = eos_id
    model.generation_config.pad_token_id = pad_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _fix_tokenizer_config(out)
    return out


def copy_model_files(student_dir: Path, out: Path) -> None:
    """Copy every file of ``student_dir`` but its weights (``*.safetensors``) into ``out``, created if missing:
    a model derived from the student keeps its tokenizer and config and saves its own weights there."""
    out.mkdir(parents=True, exist_ok=True)
    for f in student_dir.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors"):
            shutil.copy2(f, out / f.name)


def build_teacher(
    student_dir: str | Path, out_dir: str | Path, prefer_text: str, *, seed: int = 0, steps: int = 150
) -> Path:
    """Copy the student and fine-tune it to prefer ``prefer_text`` as its answer; same tokenizer."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    student_dir, out = Path(student_dir), Path(out_dir)
    copy_model_files(student_dir, out)
    tokenizer = AutoTokenizer.from_pretrained(student_dir)
    model = AutoModelForCausalLM.from_pretrained(student_dir, dtype=torch.float32)
    model.train()
    rng = random.Random(seed)
    torch.manual_seed(seed)
    target = tokenizer.encode(prefer_text, add_special_tokens=False) + [tokenizer.eos_token_id]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(steps):
        batch = []
        for _ in range(4):
            prompt = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(3, 12)))
            msgs = [{"role": "user", "content": prompt}]
            text = tokenizer.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
            p_ids = tokenizer.encode(text, add_special_tokens=False)
            batch.append((p_ids, target))
        loss = torch.zeros(())
        for p_ids, r_ids in batch:
            ids = torch.tensor([p_ids + r_ids])
            logits = model(input_ids=ids).logits[0, :-1]
            lp = torch.log_softmax(logits, -1)
            tgt = ids[0, 1:]
            tok_lp = lp.gather(-1, tgt[:, None])[:, 0][len(p_ids) - 1 :]
            loss = loss - tok_lp.mean() / len(batch)
        opt.zero_grad()
        loss.backward()
        opt.step()
    model.eval()
    model.save_pretrained(out)
    return out
