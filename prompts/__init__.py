"""Judge prompt templates (files under prompts/templates/) and parsing of judge outputs.

Public API: ``parse_verdict``, ``parse_hint``, ``load_template`` (name + content + sha256),
``load_regex``, ``render_judge_messages``, ``neutralise``, ``TokenCounter``.
"""

from prompts.parsing import final_answer, parse_hint, parse_verdict
from prompts.render import RenderInfo, TokenCounter, neutralise, render_judge_messages, render_plain_text
from prompts.templates import PromptTemplate, TemplateError, load_regex, load_template

__all__ = [
    "PromptTemplate",
    "RenderInfo",
    "TemplateError",
    "TokenCounter",
    "final_answer",
    "load_regex",
    "load_template",
    "neutralise",
    "parse_hint",
    "parse_verdict",
    "render_judge_messages",
    "render_plain_text",
]
