"""`gyre tasks SUITE`: the tasks of a suite, whether each can be scored here, and why not.

A task can be scored here when its tests ship with the suite (scored on the host root, in
bubblewrap) or when its image is found locally by the configured runtime (harness.runtime,
harness.image_dir); otherwise the line says what is missing and how to get it.
"""

from __future__ import annotations

import argparse

from gyre.config import load_config
from gyre.harness.sandbox import Environments, SandboxConfig, UnsandboxedWarning
from gyre.harness.tasks import read_suite


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("suite", nargs="?", help="'builtin', 'learnable', a folder of tasks, or the NL2RepoBench "
                                            "repository; default: harness.suite")
    p.add_argument("--config", help="TOML configuration file")
    p.add_argument("--strict", action="store_true", help="refuse the suite if a task folder is broken")
    p.add_argument("overrides", nargs="*", help="section.key=value configuration overrides, e.g. "
                                                "harness.image_dir=/scratch/nl2repo-sif")


def run(args: argparse.Namespace) -> int:
    import warnings

    from rich.console import Console
    from rich.table import Table


    cfg = load_config(args.config, args.overrides)
    h = cfg.harness
    suite = read_suite(args.suite or h.suite, strict=args.strict or h.strict_suite,
                       image_template=h.image_template)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UnsandboxedWarning)  # listing runs nothing
        envs = Environments(SandboxConfig.from_config(h))
    cols = ("task", "tests", "count", "scorable here", "where / why not")
    rows, scorable = [], 0
    for task in suite.tasks:
        place = envs.place(task)
        scorable += place.scorable
        tests = "shipped" if task.tests_dir is not None else "in image"
        rows.append((task.name, tests, str(task.test_case_count), "yes" if place.scorable else "no",
                     place.label if place.scorable else place.reason))
    rows += [(name, "-", "-", "skipped", why) for name, why in suite.skipped]
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
    print(f"{len(suite.tasks)} tasks, {scorable} scorable here, {len(suite.tasks) - scorable} not; "
              f"{len(suite.skipped)} broken task folders skipped; sandbox: {envs.host_backend}")
    return 0
