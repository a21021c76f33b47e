"""The real chat templates the suite renders (tests/data/chat-templates, with their sources and licenses) and
the one tool the template tests call (a bounded string argument, so forced calls stay short)."""

from __future__ import annotations

from pathlib import Path

TEMPLATES_DIR = Path(__file__).resolve().parents[1] / "data" / "chat-templates"
TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "rename",
            "parameters": {"type": "object", "properties": {"to": {"type": "string", "maxLength": 8}}},
        },
    }
]
