"""The configuration reference, generated from gyre/config.py (`gyre config reference`).

Every key of every section with its type, default, allowed values or range and help text, as
Markdown. `docs/configuration.md` is this output (`gyre config reference > docs/configuration.md`);
tests/config/test_config_reference.py fails when the committed file and config.py disagree.
"""

from __future__ import annotations

import dataclasses
import typing
from enum import Enum

from gyre.config import GyreConfig

HEADER = """# Configuration reference

Generated from `gyre/config.py` by `gyre config reference > docs/configuration.md`; do not edit
by hand (a test fails when the two disagree). A run's configuration is one TOML file with these
sections, plus `section.key=value` overrides on the command line (`gyre run --config run.toml
sched.staleness=2`). A bad key or value is refused naming the key, the value and what is allowed.
"""


def _type_name(kind) -> str:
    if isinstance(kind, type) and issubclass(kind, Enum):
        return "choice"
    return getattr(typing.get_origin(kind) or kind, "__name__", str(kind))


def _default(value) -> str:
    if isinstance(value, Enum):
        value = value.value
    if isinstance(value, str):
        return f'`"{value}"`' if value else '`""`'
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`"


def _allowed(f: dataclasses.Field, kind) -> str:
    meta = f.metadata
    if isinstance(kind, type) and issubclass(kind, Enum):
        return ", ".join(f"`{m.value}`" for m in kind)
    if meta.get("choices"):
        return ", ".join(f"`{c}`" for c in meta["choices"])
    lo, hi = meta.get("min"), meta.get("max")
    if lo is not None and hi is not None:
        return f"{lo} .. {hi}"
    if lo is not None:
        return f">= {lo}"
    if hi is not None:
        return f"<= {hi}"
    return ""


def _cell(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


def reference_markdown() -> str:
    out = [HEADER]
    for section in dataclasses.fields(GyreConfig):
        cls = type(section.default_factory())
        hints = typing.get_type_hints(cls)
        out += [f"## [{section.name}]", "", "| key | type | default | allowed | what it does |",
                "| --- | --- | --- | --- | --- |"]
        instance = cls()
        for f in dataclasses.fields(cls):
            kind = hints[f.name]
            out.append(f"| `{section.name}.{f.name}` | {_type_name(kind)} | {_cell(_default(getattr(instance, f.name)))} "
                       f"| {_cell(_allowed(f, kind))} | {_cell(f.metadata.get('help', ''))} |")
        out.append("")
    return "\n".join(out)
