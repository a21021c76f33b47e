"""devkit.tiny_model: offline, seeded, loadable by AutoTokenizer/AutoModelForCausalLM, carrying Qwen3's own chat
template with every marker it writes one token; teachers prefer their text."""

from __future__ import annotations

import json

import pytest
import torch

pytestmark = pytest.mark.unit


def test_same_seed_same_weights(tiny_model_dir, tmp_path):
    from devkit.tiny_model import build_tiny_model

    again = build_tiny_model(tmp_path / "again", seed=0)
    other = build_tiny_model(tmp_path / "other", seed=1)
    a = (tiny_model_dir / "model.safetensors").read_bytes()
    assert (again / "model.safetensors").read_bytes() == a
    assert (other / "model.safetensors").read_bytes() != a


def test_loads_as_hugging_face_folder(tiny_model_dir):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    cfg = json.loads((tiny_model_dir / "config.json").read_text())
    assert cfg["model_type"] == "qwen3" and cfg["head_dim"] == 32
    tok_cfg = json.loads((tiny_model_dir / "tokenizer_config.json").read_text())
    assert tok_cfg["tokenizer_class"] == "PreTrainedTokenizerFast"
    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    assert tok.eos_token == "<|im_end|>" and model.config.eos_token_id == tok.eos_token_id
    ids = tok.apply_chat_template([{"role": "user", "content": "hello"}], add_generation_prompt=True, tokenize=False)
    out = model(input_ids=torch.tensor([tok.encode(ids, add_special_tokens=False)]))
    assert out.logits.shape[-1] == len(tok)


def test_carries_qwen3_template_with_its_markers_as_single_tokens(tiny_model_dir):
    from engine.chat import load_tokenizer
    from engine.chat_families import detect_family
    from tests.testkit.chat_templates import TEMPLATES_DIR

    tok = load_tokenizer(str(tiny_model_dir))
    assert tok.chat_template == (TEMPLATES_DIR / "Qwen-Qwen3-0.6B.jinja").read_text()  # byte for byte the real one
    family = detect_family(tok.chat_template)
    assert (family.tool_call_parser, family.reasoning_parser, family.reasoning_switch) == (
        "qwen25",
        "qwen3",
        "enable_thinking",
    )
    markers = ["<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "</tool_call>"]
    markers += ["<tool_response>", "</tool_response>"]
    for marker in markers:
        assert marker in tok.chat_template
        ids = tok.encode(marker, add_special_tokens=False)
        assert len(ids) == 1 and tok.decode(ids, skip_special_tokens=True) in ("", marker), marker
    # The tags are kept by a decode that skips specials (the reply parsers read them), ChatML's are not.
    assert tok.decode(tok.encode("<think>a</think>", add_special_tokens=False), skip_special_tokens=True) == (
        "<think>a</think>"
    )


def _answer_logprob(model_dir, tok, text):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir).eval()
    prompt = tok.apply_chat_template(
        [{"role": "user", "content": "check the weather file"}], add_generation_prompt=True, tokenize=False
    )
    p = tok.encode(prompt, add_special_tokens=False)
    r = tok.encode(text, add_special_tokens=False)
    ids = torch.tensor([p + r])
    with torch.no_grad():
        lp = torch.log_softmax(model(input_ids=ids).logits[0, :-1], -1)
    return lp.gather(-1, ids[0, 1:, None])[len(p) - 1 :].sum().item()


def test_teacher_prefers_its_text_and_shares_tokenizer(tiny_model_dir, teacher_model_dir, teacher_preferred_text):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(tiny_model_dir)
    assert (teacher_model_dir / "tokenizer.json").read_bytes() == (tiny_model_dir / "tokenizer.json").read_bytes()
    student = _answer_logprob(tiny_model_dir, tok, teacher_preferred_text)
    teacher = _answer_logprob(teacher_model_dir, tok, teacher_preferred_text)
    # "clearly prefers": at least 10 nats more likely on an unseen prompt
    assert teacher > student + 10.0, (teacher, student)
