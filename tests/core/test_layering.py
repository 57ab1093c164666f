"""Layering (docs/architecture.md: arrows point one way): the module table's "must not" column for
the arrows that hold today, gyre.traj uses nothing of gyre.train, the MicroBatch contract and
advantage estimators sit below both, and the train modules import each other without cycles,
function-level imports included (backends come from one table)."""

from __future__ import annotations

import ast
from pathlib import Path
from types import SimpleNamespace

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


def find_cycle(g: dict[str, set[str]]) -> list[str] | None:
    """One import cycle of ``g`` as the path that closes it, or None."""
    state: dict[str, int] = {}  # 1 = on the stack, 2 = done

    def visit(m: str, stack: list[str]) -> list[str] | None:
        state[m] = 1
        for n in sorted(g[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [m, n] if n in stack else [m, n]
            if n not in state and (found := visit(n, stack + [m])):
                return found
        state[m] = 2
        return None

    for m in sorted(g):
        if m not in state and (found := visit(m, [])):
            return found
    return None


def test_no_import_cycle_anywhere_in_gyre():
    """Over every module of the package, imports inside functions included (an import moved into a
    function to hide a circle is still a circle)."""
    g = graph("gyre")
    assert "gyre.train.backends" in g and "gyre.proxy.body" in g and "gyre.cell.trainer_rank" in g
    cycle = find_cycle(g)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)
    # the backends know nothing of each other; only the table names them
    assert "gyre.train.megatron_trainer" not in g["gyre.train.trainer"]
    assert "gyre.train.trainer" not in g["gyre.train.megatron_trainer"]


def test_cycle_finder_sees_a_function_level_circle():
    """The check above can fail: a circle through an import inside a function is found."""
    assert find_cycle({"a": {"b"}, "b": {"a"}}) in (["a", "b", "a"], ["b", "a", "b"])
    assert find_cycle({"a": {"b"}, "b": set()}) is None
    src = "def f():\n    from gyre.proxy.body import parse_chat_body\n"
    import tempfile
    with tempfile.NamedTemporaryFile("w", suffix=".py") as f:
        f.write(src)
        f.flush()
        assert "gyre.proxy.body" in imports_of(Path(f.name))


def test_a_cells_process_tree_lives_in_cell():
    """The trainer's ranks, their pipe and the cross-cell groups are the cell's: gyre.train is a
    library they call and imports nothing of gyre.cell."""
    for name in ("trainer_process", "trainer_rank", "trainer_messages", "groups"):
        assert (PKG / "cell" / f"{name}.py").exists(), name
    for f in sorted((PKG / "train").rglob("*.py")):
        bad = sorted(i for i in imports_of(f) if i.startswith("gyre.cell"))
        assert not bad, f"{f.name} imports {bad}"


# What gyre.model may use besides itself: the atomic writer (a weights manifest is written
# durably; gyre.fsio imports nothing of Gyre), and the configuration in `gyre make-model` only.
MODEL_USES = {"gyre.fsio", "gyre.fsio.atomic_write_json", "gyre.fsio.atomic_write_text"}
MODEL_CLI_USES = {"gyre.config", "gyre.config.default_tiny_dir", "gyre.config.load_config"}


def test_model_knows_nobody_who_serves_or_trains():
    """gyre.model (families, weights, templates, parsers, identity, tokenizer, the tiny model)
    imports only itself, the atomic writer and (its command line only) the configuration."""
    for f in sorted((PKG / "model").rglob("*.py")):
        allowed = MODEL_USES | (MODEL_CLI_USES if f.name == "cli.py" else set())
        bad = sorted(i for i in imports_of(f) if not i.startswith("gyre.model") and i not in allowed)
        assert not bad, f"{f.name} imports {bad}"


# docs/architecture.md, module table: package -> the packages it must not import (any nesting
# level).
DRIVERS = {"head", "sim", "cluster", "offline_rollout"}
MUST_NOT = {
    "events": {"*"},                                   # pure: nothing of Gyre at all
    "report": DRIVERS | {"sched", "engine", "train", "harness", "proxy"},
    "sched": DRIVERS | {"engine", "train", "harness", "proxy", "report", "cell"},
    "sim": {"head", "cluster", "offline_rollout", "engine", "train", "harness", "proxy"},
    "traj": DRIVERS | {"train", "engine", "proxy", "sched", "harness"},
    "proxy": DRIVERS | {"sched", "train", "harness"},
    "engine": DRIVERS | {"traj", "train", "sched", "harness", "proxy", "cell"},
    "harness": DRIVERS | {"engine", "train", "sched", "proxy"},
    "train": DRIVERS | {"harness", "proxy", "sched", "engine", "cell"},
    "cell": DRIVERS | {"harness", "proxy", "traj", "report"},  # placement comes from cluster, injected
    # the services do work the head and `gyre rollout` compose; they decide nothing and report nothing
    "services": DRIVERS | {"report", "cluster", "sim"},
}
# Arrows against the table that exist today, each to be removed when its cause goes
# (tests/core/test_layering.py fails once an exception no longer occurs, so this list only shrinks).
KNOWN: dict[tuple[str, str], str] = {}


# Arrows the table allows by design, each with its reason.
BY_DESIGN = {
    ("gyre.engine.pace", "sim"): "the paced engine (benchmarks only) steps at the simulator's roofline: one "
                                 "formula for the live check and the simulation it is compared with",
}


def _package(module: str) -> str:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 else ""


def arrows() -> set[tuple[str, str]]:
    """(module, package it imports) for every Gyre import between two top-level packages."""
    out = set()
    for f in sorted(PKG.rglob("*.py")):
        m = module_name(f)
        for i in imports_of(f):
            if i == "gyre":  # `from gyre import faults` names the module in the next entry
                continue
            if _package(i) and _package(i) != _package(m):
                out.add((m, _package(i)))
    return out


def test_the_module_table_holds():
    found = arrows()
    bad = sorted((m, p) for m, p in found - set(KNOWN) - set(BY_DESIGN)
                 if (rule := MUST_NOT.get(_package(m))) and ("*" in rule or p in rule))
    assert not bad, "imports against docs/architecture.md's module table: " + ", ".join(f"{m} -> {p}" for m, p in bad)
    stale = sorted(k for k in KNOWN if k not in found)
    assert not stale, f"known exceptions that no longer occur (remove them from KNOWN): {stale}"


def test_only_drivers_start_the_cell_agent():
    """gyre.cell is a process that drivers start (cluster/main.py); nothing below them imports it."""
    bad = sorted(m for m, p in arrows() if p == "cell" and _package(m) not in DRIVERS | {"cell"})
    assert not bad, f"modules below the drivers import gyre.cell: {bad}"


def test_report_imports_no_driver_and_events_do_no_io():
    for f in sorted((PKG / "report").rglob("*.py")):
        assert not {_package(i) for i in imports_of(f)} & DRIVERS, f"{f.name} imports a driver"
    tree = ast.parse((PKG / "events.py").read_text())
    names = {a.name.split(".")[0] for n in ast.walk(tree) if isinstance(n, (ast.Import, ast.ImportFrom))
             for a in ([SimpleNamespace(name=n.module or "")] if isinstance(n, ast.ImportFrom) else n.names)}
    assert not names & {"os", "io", "pathlib", "subprocess", "socket", "asyncio", "time", "h5py", "json"}, names
    assert not [n for n in ast.walk(tree) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "open"]
