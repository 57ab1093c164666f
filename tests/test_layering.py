"""Layering (ARCHITECTURE.md: arrows point one way): gyre.traj uses nothing of gyre.train, the
MicroBatch contract and advantage estimators sit below both, and the train modules import each
other without cycles, function-level imports included (backends come from one table)."""

from __future__ import annotations

import ast
from pathlib import Path

import gyre

PKG = Path(gyre.__file__).parent


def imports_of(path: Path) -> set[str]:
    """Every gyre module a file imports, at any nesting level."""
    out = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            out.update(a.name for a in node.names if a.name.startswith("gyre"))
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("gyre"):
            out.add(node.module)
            # `from gyre.train import megatron_cpu` imports a module too
            out.update(f"{node.module}.{a.name}" for a in node.names)
    return out


def module_name(path: Path) -> str:
    rel = path.relative_to(PKG.parent).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def graph(package: str) -> dict[str, set[str]]:
    files = sorted((PKG / package.removeprefix("gyre").strip(".")).rglob("*.py"))
    mods = {module_name(f): f for f in files}
    return {m: {i for i in imports_of(f) if i in mods and i != m} for m, f in mods.items()}


def test_traj_imports_nothing_from_train():
    for f in sorted((PKG / "traj").rglob("*.py")):
        bad = sorted(i for i in imports_of(f) if i == "gyre.train" or i.startswith("gyre.train."))
        assert not bad, f"{f.name} imports {bad}"
    for f in (PKG / "batch.py", PKG / "advantage.py"):
        assert not {i for i in imports_of(f) if i.startswith(("gyre.train", "gyre.traj"))}, f.name


def test_train_modules_have_no_import_cycles():
    g = graph("gyre.train")
    assert "gyre.train.backends" in g and "gyre.train.base" in g
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> None:
        state[m] = 1
        for n in sorted(g[m]):
            assert state.get(n) != 1, "import cycle: " + " -> ".join(stack + [m, n])
            if n not in state:
                visit(n, stack + [m])
        state[m] = 2

    for m in sorted(g):
        if m not in state:
            visit(m, [])
    # the backends know nothing of each other; only the table names them
    assert "gyre.train.megatron_trainer" not in g["gyre.train.trainer"]
    assert "gyre.train.trainer" not in g["gyre.train.megatron_trainer"]


def test_model_knows_nobody_who_serves_or_trains():
    """gyre.model (families, weights, templates, parsers) imports only itself."""
    for f in sorted((PKG / "model").rglob("*.py")):
        bad = sorted(i for i in imports_of(f) if not i.startswith("gyre.model"))
        assert not bad, f"{f.name} imports {bad}"
