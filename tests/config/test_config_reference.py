"""docs/configuration.md is generated from gyre/config.py (`gyre config reference`): the committed
file must be what the generator prints now, so the reference cannot drift from the code."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from gyre.cli import main
from gyre.config import GyreConfig
from gyre.config_reference import reference_markdown

DOC = Path(__file__).resolve().parents[2] / "docs" / "configuration.md"


def test_committed_reference_is_up_to_date():
    assert DOC.read_text(encoding="utf-8") == reference_markdown(), \
        "regenerate it: gyre config reference > docs/configuration.md"


def test_reference_lists_every_key_with_its_choices(capsys):
    assert main(["config", "reference"]) == 0
    text = capsys.readouterr().out
    assert text == reference_markdown()
    for section in dataclasses.fields(GyreConfig):
        for f in dataclasses.fields(section.default_factory()):
            assert f"| `{section.name}.{f.name}` |" in text
    assert "| `sched.scheme` | choice | `\"E\"` | `E`, `E-paper`, `A`, `C` |" in text
    assert "| `train.layout` | choice | `\"tree\"` | `tree`, `expanded` |" in text
