"""Prompt templates as versioned files: loader giving name + content + sha256.

Contract:
- Every template is a file under ``prompts/templates/`` (``<name>.txt``); no prompt text lives in .py files.
- ``load_template(name)`` returns a :class:`PromptTemplate` with the raw ``content``, its ``sha256`` and
  ``version`` = ``"<name>@<sha256[:12]>"``, the string recorded with every judge result.
- Judge templates hold two sections introduced by the lines ``=== system ===`` and ``=== user ===``;
  placeholders are ``${name}`` (``string.Template``: braces such as ``\\boxed{1}`` need no escaping, and a value
  is substituted once, so text inside a value is never re-expanded).
- An optional sibling ``<name>.regex.txt`` holds the output constraint for that prompt (SGLang ``regex``),
  with ``@NAME@`` placeholders filled from settings (e.g. ``@REASONING_MAX_CHARS@``).
"""

from __future__ import annotations

import hashlib
import re
import string
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
_SECTION_RE = re.compile(r"^=== (system|user) ===$", re.MULTILINE)


class TemplateError(ValueError):
    """A template file is missing or malformed."""


@dataclass(frozen=True)
class PromptTemplate:
    name: str
    content: str
    sha256: str

    @property
    def version(self) -> str:
        return f"{self.name}@{self.sha256[:12]}"

    def sections(self) -> dict[str, str]:
        """``{"system": ..., "user": ...}`` for a sectioned template; ``{"user": content}`` otherwise."""
        parts = _SECTION_RE.split(self.content)
        if len(parts) == 1:
            return {"user": self.content}
        out: dict[str, str] = {}
        for i in range(1, len(parts) - 1, 2):
            out[parts[i]] = parts[i + 1].strip("\n")
        return out

    def render_messages(self, **values: str) -> list[dict[str, str]]:
        """Chat messages with every ``${name}`` substituted; a missing value is a TemplateError."""
        msgs = []
        for role in ("system", "user"):
            body = self.sections().get(role)
            if body is None:
                continue
            try:
                text = string.Template(body).substitute(values)
            except (KeyError, ValueError) as exc:
                raise TemplateError(f"template {self.name}: cannot render {role} section: {exc!r}") from exc
            msgs.append({"role": role, "content": text})
        return msgs


@lru_cache(maxsize=64)
def load_template(name: str, directory: str | None = None) -> PromptTemplate:
    """Load ``<directory>/<name>.txt`` (default: the packaged templates)."""
    path = Path(directory or TEMPLATE_DIR) / f"{name}.txt"
    try:
        raw = path.read_bytes()
    except OSError as exc:
        raise TemplateError(f"prompt template {name!r} not found at {path}") from exc
    return PromptTemplate(name=name, content=raw.decode("utf-8"), sha256=hashlib.sha256(raw).hexdigest())


def load_regex(name: str, directory: str | None = None, **values: int | str) -> str | None:
    """The output constraint ``<name>.regex.txt`` with ``@KEY@`` filled from ``values`` (None if absent)."""
    path = Path(directory or TEMPLATE_DIR) / f"{name}.regex.txt"
    if not path.exists():
        return None
    text = path.read_text(encoding="utf-8").strip("\n")
    for key, val in values.items():
        text = text.replace(f"@{key.upper()}@", str(val))
    if re.search(r"@[A-Z_]+@", text):
        raise TemplateError(f"regex {name}: unfilled placeholder in {text!r}")
    return text
