"""Load analyze_pytest_results from NL2RepoBench's own openhands/post_processor.py, for parity
checks only (its code is read at test time, never copied into Gyre).

Where: $GYRE_NL2REPOBENCH (a checkout, or a bare git directory whose HEAD is read), else the
mirror this project's tooling fetches to /work/.mirror/multimodal-art-projection+NL2RepoBench.
"""

from __future__ import annotations

import ast
import logging
import os
import re
import subprocess
from pathlib import Path
from typing import Any, Dict, List

_CANDIDATES = ("/work/.mirror/multimodal-art-projection+NL2RepoBench/repo",)
_FILE = "openhands/post_processor.py"


def _source() -> str | None:
    for where in filter(None, [os.environ.get("GYRE_NL2REPOBENCH"), *_CANDIDATES]):
        p = Path(where)
        if (p / _FILE).is_file():
            return (p / _FILE).read_text(encoding="utf-8")
        if p.is_dir():
            r = subprocess.run(["git", "--git-dir", str(p), "show", f"HEAD:{_FILE}"], capture_output=True, text=True)
            if r.returncode == 0:
                return r.stdout
    return None


def load_official():
    """analyze_pytest_results(command_results, total) -> dict, or None when not at hand."""
    src = _source()
    if src is None:
        return None
    tree = ast.parse(src)
    fn = next((n for n in tree.body if isinstance(n, ast.FunctionDef) and n.name == "analyze_pytest_results"), None)
    if fn is None:
        return None
    ns: dict = {"re": re, "List": List, "Dict": Dict, "Any": Any}
    exec(compile(ast.Module([fn], []), _FILE, "exec"), ns)  # the function alone: no Docker imports
    quiet = logging.getLogger("nl2repobench-official")
    quiet.disabled = True
    return lambda results, total: ns["analyze_pytest_results"](results, total, quiet)
