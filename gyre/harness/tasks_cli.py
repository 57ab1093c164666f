"""`gyre tasks SUITE`: the tasks of a suite, whether each can be scored here, and why not.

A dataset (``dataset.path``, or a ``.jsonl``/``.parquet`` file or Hugging Face directory given as
SUITE) is listed the same way, each row with its split and weight, the refused rows with their line
and why, and the count of rows loaded and refused.

A task can be scored here when its tests ship with the suite (scored on the host root, in
bubblewrap) or when its image is found locally by the configured runtime (harness.runtime,
harness.image_dir); otherwise the line says what is missing and how to get it.
"""

from __future__ import annotations

import argparse
import tempfile
from pathlib import Path

from gyre.config import load_config
from gyre.harness.sandbox import Environments, SandboxConfig, UnsandboxedWarning
from gyre.harness.datasets import dataset_from_config
from gyre.harness.tasks import read_suite


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", help="'builtin', 'learnable', a folder of tasks, the NL2RepoBench "
                                            "repository, or a dataset (.jsonl, .parquet, a Hugging Face "
                                            "directory); default: dataset.path, else harness.suite")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--strict", action="store_true", help="refuse the suite if a task folder is broken")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides, e.g. "
                                                "harness.image_dir=/scratch/nl2repo-sif")


def run(args: argparse.Namespace) -> int:
    cfg = load_config(args.config, args.overrides)
    h = cfg.harness
    if args.strict:
        h.strict_suite = True
    if args.suite and _is_dataset(Path(args.suite)):
        cfg.dataset.path = args.suite
    ds = None
    if cfg.dataset.path and not (args.suite and not _is_dataset(Path(args.suite))):
        with tempfile.TemporaryDirectory(prefix="gyre-tasks-") as tmp:  # listing writes nothing to the run
            ds = dataset_from_config(cfg, Path(tmp))
            return _show(cfg, ds.suite("train"), ds)
    suite = read_suite(args.suite or h.suite, strict=h.strict_suite, image_template=h.image_template)
    return _show(cfg, suite, ds)


def _is_dataset(p: Path) -> bool:
    return p.suffix in (".jsonl", ".parquet", ".ndjson") or (p / "dataset_info.json").exists() \
        or (p / "dataset_dict.json").exists()


def _show(cfg, suite, ds) -> int:
    import warnings

    from rich.console import Console
    from rich.table import Table

    h = cfg.harness
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsandboxedWarning)  # listing runs nothing
        envs = Environments(SandboxConfig.from_config(h))
    cols = ("task", "tests", "count", "scorable here", "where / why not") + (("split", "weight") if ds else ())
    rows, scorable = [], 0
    tasks = [(t, "train") for t in suite.tasks] + [(t, "validation") for t in (ds.validation if ds else [])]
    for task, split in tasks:
        place = envs.place(task)
        scorable += place.scorable
        tests = ("shipped" if task.test_commands else "reward only") if task.tests_dir is not None else "in image"
        rows.append((task.name, tests, str(task.test_case_count), "yes" if place.scorable else "no",
                     place.label if place.scorable else place.reason) + ((split, f"{task.weight:g}") if ds else ()))
    rows += [(name, "-", "-", "skipped" if not ds else "refused", why) + (("-", "-") if ds else ())
             for name, why in suite.skipped]
    con = Console()
    if con.is_terminal:
        t = Table(title=f"suite {suite.root}")
        for col in cols:
            t.add_column(col, overflow="fold")
        for r in rows:
            t.add_row(*r)
        con.print(t)
    else:  # piped: one tab-separated line per task, for grep and scripts
        print(f"# suite {suite.root}\n# " + "\t".join(cols))
        for r in rows:
            print("\t".join(r))
    if ds is not None:
        print(f"dataset {ds.path}: {ds.rows_loaded} rows loaded ({len(ds.train)} train, {len(ds.validation)} "
              f"validation), {ds.rows_refused} refused; {scorable} scorable here; sandbox: {envs.host_backend}")
        return 0
    print(f"{len(suite.tasks)} tasks, {scorable} scorable here, {len(suite.tasks) - scorable} not; "
              f"{len(suite.skipped)} broken task folders skipped; sandbox: {envs.host_backend}")
    return 0
