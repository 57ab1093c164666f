"""A newcomer's first hour (issue 45): what a wrong path, a crashing harness and the demo cost.

Figures (one flat JSON, benchmarks/results/first_hour.json):
- bad_model_path_exit_s: `gyre run --config launchers/demo.toml model.path=<missing>` until it
  exits (goal < 30 s; it hung until Ctrl-C before); bad_model_path_exit_code;
- bad_model_path_mpi_exit_s: the same configuration as launchers/gyre.sbatch starts it (mpiexec
  of gyre.cluster.main, no `gyre run` checking first), 3 ranks;
- crash_rewards_trained: executions of a harness that always crashes (exit 3) admitted into
  training (goal 0), from the ledger, with sched.skip_zero_variance = false (else equal rewards
  drop the groups whatever their cause, and a run where only some crash trains their zeros);
  crash_run_exit_code (goal non-zero), crash_run_s;
- undocumented_keys: configuration keys without a `help=` description (goal 0);
- demo_s: `make demo` (gyre run --config launchers/demo.toml) wall time, only with --demo (it takes
  minutes: run it on a calm machine); load_avg_1m_before / _after: the machine's load around it.

`--root DIR` measures another checkout (e.g. the main one, for the figures before a change);
a run that does not end within --limit-s is killed and recorded as that limit with timed_out.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parents[1]
# the demo's agent makes its calls (trajectories to train), then the harness crashes on its own bug
CRASH = ('harness.command=["{python}", "-c", "import sys; from gyre.harness.answer_agent import main; main(); '
         'print(\'agent: ValueError: a harness bug\', file=sys.stderr); sys.exit(3)"]')


def timed(cmd: list[str], root: Path, limit_s: float) -> tuple[float, int | None, str]:
    """(seconds, exit code or None when killed at the limit, output tail)."""
    t0 = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=root, env={**os.environ, "PYTHONPATH": str(root)}, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=limit_s)
        return time.monotonic() - t0, proc.returncode, out[-2000:]
    except subprocess.TimeoutExpired:  # `gyre run` forwards SIGTERM to mpiexec, which ends its ranks
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            out, _ = proc.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, _ = proc.communicate()
        return limit_s, None, (out or "")[-2000:]


def gyre(root: Path, *args: str) -> list[str]:
    return [sys.executable, "-m", "gyre.cli", *args]


def undocumented(root: Path) -> int:
    code = ("import dataclasses; from gyre.config import GyreConfig; print(sum(1 for s in "
            "dataclasses.fields(GyreConfig) for f in dataclasses.fields(s.default_factory()) "
            "if not (f.metadata.get('help') or '').strip()))")
    return int(subprocess.run([sys.executable, "-c", code], cwd=root, env={**os.environ, "PYTHONPATH": str(root)},
                              capture_output=True, text=True, check=True).stdout)


def bad_path(res: dict, root: Path, demo: str, t: Path, limit_s: float) -> None:
    """The wrong model.path, under `gyre run` and as launchers/gyre.sbatch starts the ranks."""
    s, rc, out = timed(gyre(root, "run", "--config", demo, "--no-plots", f"run.dir={t / 'bad'}",
                            f"model.path={t / 'missing'}"), root, limit_s)
    res.update(bad_model_path_exit_s=round(s, 2), bad_model_path_exit_code=rc,
               bad_model_path_timed_out=rc is None, bad_model_path_said=out.strip().splitlines()[-1:])
    from_mpi = [str(Path(sys.executable).parent / "mpiexec"), "-n", "3", sys.executable, "-m", "gyre.cluster.main",
                "--engine-key-file", str(t / "key"), "--config", demo, f"run.dir={t / 'bad2'}",
                f"model.path={t / 'missing'}"]
    (t / "key").write_text("k")
    (t / "key").chmod(0o600)
    s, rc, _ = timed(from_mpi, root, limit_s)
    res.update(bad_model_path_mpi_exit_s=round(s, 2), bad_model_path_mpi_exit_code=rc)


def resume_check(res: dict, root: Path, demo: str, t: Path, limit_s: float) -> None:
    """A finished run resumed: report.json and the plots must come out as they were (issue 45)."""
    d = t / "resume"
    timed(gyre(root, "run", "--config", demo, f"run.dir={d}", "run.steps=2", "sched.cells=2",
               "harness.group_size=4"), root, limit_s)
    before, plots = (d / "report.json").read_bytes(), {p.name: p.read_bytes() for p in d.glob("*.png")}
    s, rc, _ = timed(gyre(root, "run", "--resume", f"run.dir={d}"), root, limit_s)
    after = (d / "report.json").read_bytes()
    res.update(report_bytes_before_resume=len(before), report_bytes_after_resume=len(after),
               report_equal_after_resume=json.loads(before) == json.loads(after),
               plots_equal_after_resume=plots == {p.name: p.read_bytes() for p in d.glob("*.png")},
               resume_exit_code=rc, resume_s=round(s, 1))


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--root", default=str(HERE), help="the Gyre checkout to measure")
    p.add_argument("--limit-s", type=float, default=300.0)
    p.add_argument("--demo", action="store_true", help="also time the demo (minutes)")
    p.add_argument("--skip-bad-path", action="store_true", help="leave the wrong model.path runs out")
    p.add_argument("--only", choices=("resume",), help="measure one figure; the file's other keys are kept")
    p.add_argument("--out", default=str(HERE / "benchmarks" / "results" / "first_hour.json"))
    args = p.parse_args()
    root = Path(args.root).resolve()
    demo = str(root / "launchers" / "demo.toml")
    res: dict = {"root": str(root), "cpus": os.cpu_count(), "load_avg_1m_start": os.getloadavg()[0]}
    if args.only == "resume":
        out = Path(args.out)
        res = {**(json.loads(out.read_text()) if out.exists() else {}), "load_avg_1m_resume": os.getloadavg()[0]}
        with tempfile.TemporaryDirectory(prefix="gyre-first-hour-") as tmp:
            resume_check(res, root, demo, Path(tmp), args.limit_s)
        out.write_text(json.dumps(res, indent=1) + "\n")
        print(json.dumps(res, indent=1))
        return 0
    with tempfile.TemporaryDirectory(prefix="gyre-first-hour-") as tmp:
        t = Path(tmp)
        resume_check(res, root, demo, t, args.limit_s)
        if not args.skip_bad_path:
            bad_path(res, root, demo, t, args.limit_s)
        crash_dir = t / "crash"
        s, rc, out = timed(gyre(root, "run", "--config", demo, "--no-plots", f"run.dir={crash_dir}", "run.steps=3",
                                "sched.cells=2", "harness.group_size=2", "sched.skip_zero_variance=false", CRASH), root, args.limit_s)
        rows = [json.loads(x) for x in (crash_dir / "ledger.jsonl").read_text().splitlines()
                if '"execution"' in x] if (crash_dir / "ledger.jsonl").exists() else []
        res.update(crash_run_s=round(s, 1), crash_run_exit_code=rc, crash_executions_ended=len(rows),
                   crash_rewards_trained=sum(1 for r in rows if r["admitted"]))
    res["undocumented_keys"] = undocumented(root)
    if args.demo:
        res["load_avg_1m_before"] = os.getloadavg()[0]
        with tempfile.TemporaryDirectory(prefix="gyre-demo-") as tmp:
            s, rc, out = timed(gyre(root, "run", "--config", demo, "--no-plots", f"run.dir={tmp}/demo"), root,
                               max(args.limit_s, 1200))
        res.update(demo_s=round(s, 1), demo_exit_code=rc, demo_warnings=[ln for ln in out.splitlines()
                                                                         if "warning" in ln][-5:])
        res["load_avg_1m_after"] = os.getloadavg()[0]
    else:
        res["demo_s"] = None
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(res, indent=1) + "\n")
    print(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
