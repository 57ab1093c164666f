"""Configuration that tells the truth: every key of gyre/config.py is read by the package.

A key nothing reads (`proxy.request_retries`, `sim.preset`, ... before) makes a user believe they
steer something they do not. The check walks the config dataclasses and looks in the package's
source for a read of each key: an attribute access `.key` (or the key as a string, for getattr
and keyword tables) outside the key's own definition."""

from __future__ import annotations

import ast
import dataclasses
import re
from pathlib import Path

import gyre
from gyre.config import GyreConfig

PACKAGE = Path(gyre.__file__).parent


def package_source() -> str:
    """The package's code; gyre/config.py without the field definitions (its helpers, such as
    `default_tiny_dir` or `GyreConfig.shard_dir`, are readers like any other)."""
    parts = [p.read_text() for p in sorted(PACKAGE.rglob("*.py")) if p.name != "config.py"]
    config = (PACKAGE / "config.py").read_text()
    fields = {n for cls in ast.parse(config).body if isinstance(cls, ast.ClassDef)
              for node in cls.body if isinstance(node, ast.AnnAssign)
              for n in range(node.lineno, node.end_lineno + 1)}  # a definition and its help text
    parts.append("\n".join(line for i, line in enumerate(config.splitlines(), 1) if i not in fields))
    return "\n".join(parts)


def unread_keys(source: str) -> list[str]:
    unread = []
    for section in dataclasses.fields(GyreConfig):
        for f in dataclasses.fields(section.default_factory()):
            if not re.search(rf"\.{f.name}\b|[\"']{f.name}[\"']", source):
                unread.append(f"{section.name}.{f.name}")
    return unread


def test_every_config_key_is_read_by_the_package():
    assert unread_keys(package_source()) == [], "read these keys where they steer something, or delete them"


def test_the_check_finds_a_key_nothing_reads():
    source = package_source()
    without = re.sub(r"\.connect_retries\b", ".x", source)  # as if nothing read engine.connect_retries
    assert unread_keys(without) == ["engine.connect_retries"]


def undocumented_keys() -> list[str]:
    """Keys whose field carries no `help=` description (`gyre config reference` would show none)."""
    return [f"{section.name}.{f.name}" for section in dataclasses.fields(GyreConfig)
            for f in dataclasses.fields(section.default_factory()) if not (f.metadata.get("help") or "").strip()]


def test_every_key_has_a_description():
    assert undocumented_keys() == []
