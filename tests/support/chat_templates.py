"""Chat templates written for the tests (Gyre's ChatML as Jinja, ...) and a tool list, for the template tests."""

from __future__ import annotations

from pathlib import Path


TEMPLATES = Path(__file__).parents[1] / "templates"
TOOLS = [{"type": "function", "function": {"name": "bash", "description": "run a shell command",
                                           "parameters": {"type": "object", "properties": {"command": {"type": "string"}}}}}]
