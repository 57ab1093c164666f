"""Where `make test`'s CPU goes, test by test: a pytest plugin that records the machine's CPU
seconds (from /proc/stat: every process, also those Slurm's daemons or mpiexec start outside
pytest's process tree) spent while each test ran.

Only meaningful with one test at a time on an otherwise quiet machine (`-n 0`):

    PYTHONPATH=benchmarks make test JOBS=0 PYTEST_ARGS="-p suite_cpu"
    .venv/bin/python benchmarks/suite_cpu.py   # the table (by package, the 25 costliest tests)
                                               # and benchmarks/results/suite_cpu.json (flat)

Each test appends {"id", "cpu", "wall"} to $SUITE_CPU_OUT (default /tmp/gyre-suite-cpu.jsonl,
emptied at the start of a session); a module's fixtures count in the test that first needs them.
Why /proc/stat and not rusage: a job's engines, trainers and Slurm steps are no children of
pytest, so RUSAGE_CHILDREN misses most of a whole job.
"""

from __future__ import annotations

import collections
import json
import os
import sys
import time
from pathlib import Path

import pytest

OUT = Path(os.environ.get("SUITE_CPU_OUT", "/tmp/gyre-suite-cpu.jsonl"))
RESULT = Path(__file__).resolve().parent / "results" / "suite_cpu.json"


def machine_cpu_s() -> float:
    """Busy CPU seconds of the whole machine so far (user, nice, system, irq, softirq)."""
    with open("/proc/stat") as f:
        v = [int(x) for x in f.readline().split()[1:]]
    return (v[0] + v[1] + v[2] + v[5] + v[6]) / os.sysconf("SC_CLK_TCK")


def pytest_sessionstart(session) -> None:
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    cpu0, t0 = machine_cpu_s(), time.monotonic()
    yield
    with OUT.open("a") as f:
        f.write(json.dumps({"id": item.nodeid, "cpu": round(machine_cpu_s() - cpu0, 2),
                            "wall": round(time.monotonic() - t0, 2)}) + "\n")


def summarize(path: Path = OUT, top: int = 25) -> tuple[dict, str]:
    """The flat figures (suite_cpu.json) and a markdown table of them."""
    rows = [json.loads(x) for x in path.read_text().splitlines() if x.strip()]
    if not rows:
        raise SystemExit(f"{path}: no tests recorded (run make test with -p suite_cpu first)")
    by = collections.defaultdict(lambda: [0.0, 0])
    for r in rows:
        pkg = r["id"].split("/")[1] if r["id"].count("/") >= 2 else r["id"].split("::")[0]
        by[pkg][0] += r["cpu"]
        by[pkg][1] += 1
    costliest = sorted(rows, key=lambda r: -r["cpu"])[:top]
    flat = {"tests": len(rows), "cpu_s": round(sum(r["cpu"] for r in rows), 1),
            "wall_s": round(sum(r["wall"] for r in rows), 1),
            **{f"cpu_s.{k}": round(c, 1) for k, (c, _) in by.items()},
            **{f"costliest.{i + 1}.cpu_s": r["cpu"] for i, r in enumerate(costliest)},
            **{f"costliest.{i + 1}.test": r["id"] for i, r in enumerate(costliest)}}
    lines = [f"{flat['tests']} tests, {flat['cpu_s']:.0f} CPU-s, {flat['wall_s']:.0f} s of wall", "",
             "| package | tests | CPU-s |", "| --- | --- | --- |"]
    lines += [f"| {k} | {n} | {c:.0f} |" for k, (c, n) in sorted(by.items(), key=lambda kv: -kv[1][0])]
    lines += ["", "| CPU-s | wall s | test |", "| --- | --- | --- |"]
    lines += [f"| {r['cpu']:.1f} | {r['wall']:.1f} | {r['id']} |" for r in costliest]
    return flat, "\n".join(lines)


if __name__ == "__main__":
    figures, text = summarize(Path(sys.argv[1]) if len(sys.argv) > 1 else OUT)
    RESULT.write_text(json.dumps(figures, indent=1) + "\n")
    print(text)
