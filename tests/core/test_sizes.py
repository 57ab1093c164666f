"""Sizes (the project's rule): no file of gyre/ over 800 lines and no class over
400, measured on the source (lines of the file; a class from its `class` line to its last).

A room that grows past these has grown into a kernel: split it along the seams it already names
(see gyre/proxy/routes.py, relay.py, recording.py and gyre/sim/prefix_cache.py, decode_pool.py,
diagnostics.py, run_loop.py for how). The allow-list names only what is still over today and is
itself checked: an entry that fits again must leave it."""

from __future__ import annotations

import ast
import functools
from pathlib import Path

import gyre

PKG = Path(gyre.__file__).parent
MAX_FILE_LINES = 800
MAX_CLASS_LINES = 400

# (path under gyre/, class name or None for the file) -> why it is still over; shrink, never grow
ALLOWED: dict[tuple[str, str | None], str] = {}


def oversized(path: Path, rel: str) -> list[tuple[str, str | None, int]]:
    """(rel, None, lines) for a file over MAX_FILE_LINES, (rel, class, lines) for each class over
    MAX_CLASS_LINES (nested classes included)."""
    src = path.read_text(encoding="utf-8")
    out = []
    n = len(src.splitlines())
    if n > MAX_FILE_LINES:
        out.append((rel, None, n))
    for node in ast.walk(ast.parse(src)):
        if isinstance(node, ast.ClassDef):
            size = node.end_lineno - node.lineno + 1
            if size > MAX_CLASS_LINES:
                out.append((rel, node.name, size))
    return out


@functools.cache  # one walk of gyre/ for both checks
def all_oversized() -> tuple[tuple[str, str | None, int], ...]:
    return tuple(o for f in sorted(PKG.rglob("*.py")) for o in oversized(f, f.relative_to(PKG).as_posix()))


def test_no_file_over_800_lines_and_no_class_over_400():
    over = [f"gyre/{rel}{':' + cls if cls else ''} is {n} lines (limit {MAX_CLASS_LINES if cls else MAX_FILE_LINES})"
            for rel, cls, n in all_oversized() if (rel, cls) not in ALLOWED]
    assert not over, "split these along their seams: " + "; ".join(over)


def test_the_allow_list_names_only_what_is_still_over():
    still = {(rel, cls) for rel, cls, _ in all_oversized()}
    fits = sorted(f"gyre/{rel}{':' + cls if cls else ''}" for rel, cls in ALLOWED if (rel, cls) not in still)
    assert not fits, f"these fit their limit now: take them off ALLOWED in {Path(__file__).name}: {fits}"


def test_the_size_check_sees_a_big_class_and_a_big_file(tmp_path):
    """The checks above can fail: a class of 401 lines and a file of 801 are found, 400 and 800 not."""
    body = "\n".join(f"    x{i} = {i}" for i in range(399))
    (tmp_path / "big.py").write_text(f"class Big:\n{body}\n    y = 0\n")  # 401 lines, one class
    (tmp_path / "fits.py").write_text(f"class Fits:\n{body}\n")  # 400 lines
    assert oversized(tmp_path / "big.py", "big.py") == [("big.py", "Big", 401)]
    assert oversized(tmp_path / "fits.py", "fits.py") == []
    (tmp_path / "long.py").write_text("x = 0\n" * 801)
    (tmp_path / "ok.py").write_text("x = 0\n" * 800)
    assert oversized(tmp_path / "long.py", "long.py") == [("long.py", None, 801)]
    assert oversized(tmp_path / "ok.py", "ok.py") == []
