"""The builtin tasks, their reference solutions and workspaces built from them, for the evaluator tests."""

from __future__ import annotations

import shutil
from pathlib import Path

from gyre.harness.tasks import BUILTIN_DIR, load_suite


SOLUTIONS = Path(BUILTIN_DIR).parent / "builtin_solutions"
TASKS = {t.name: t for t in load_suite("builtin")}


def workspace(tmp_path, files: dict | None = None, solution: str | None = None) -> Path:
    ws = tmp_path / "ws"
    ws.mkdir(parents=True, exist_ok=True)
    if solution:
        shutil.copytree(SOLUTIONS / solution, ws, dirs_exist_ok=True)
    for rel, text in (files or {}).items():
        (ws / rel).parent.mkdir(parents=True, exist_ok=True)
        (ws / rel).write_text(text)
    return ws
