"""The researcher's loop in one `gyre run`: tasks from a dataset, your reward, validation rounds.

The run: the demo job (launchers/demo.toml: the embedded tiny model, the answer-agent harness,
GRPO) trained on a JSONL dataset built from the learnable suite's two task kinds (the suite's own
tests, prompts in several wordings), scored by the recipe's reward function
(docs/recipes/reward_fn.py: the tests' share + a brevity bonus + a truncation penalty), with a
validation round on held-out rows (other wordings, ``split = "validation"``) before the first
step, every 2 steps and after the last. The dataset file also holds one malformed row (a file path
leaving the workspace) so that the refusal path is part of the measured run.

Writes benchmarks/results/loop.json:

- ``val_pass1_first`` / ``val_pass1_last``: pass@1 of the first and last validation rounds
  (pass = reward >= ``PASS_THRESHOLD``), ``val_passk_last`` pass@k (k = ``K``) of the last;
  ``val_reward_first`` / ``val_reward_last``; ``val_rounds`` (version, pass@1, pass@k, reward)
  of every round;
- ``reward_fn_calls``, ``reward_fn_errors``: calls of the reward function (training and
  validation executions; from <run.dir>/rewards.jsonl);
- ``dataset_rows_loaded``, ``dataset_rows_refused``.

Other helpers' keys come from the same run: ``--set section.key=value`` (repeatable) adds
configuration overrides (e.g. a learning-rate schedule), and ``--extra MODULE:FUNCTION`` names a
function f(run_dir: Path, report: dict) -> dict whose keys are merged into loop.json.

    python benchmarks/bench_loop.py [--steps 8] [--keep] [--set train.lr=0.03] [--extra mod:fn]
"""

from __future__ import annotations

import argparse
import importlib
import json
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from gyre.harness.tasks import LEARNABLE_DIR  # noqa: E402

OUT = REPO / "benchmarks" / "results" / "loop.json"
CONFIG = REPO / "launchers" / "demo.toml"
PASS_THRESHOLD, SAMPLES, K, EVERY = 0.5, 4, 4, 2

TRAIN_WORDINGS = {
    "short_answer": ["", "Answer briefly.\n\n", "Keep it short.\n\n"],
    "no_letters": ["", "Symbols only.\n\n", "No words, please.\n\n"],
}
HELD_OUT_WORDINGS = {
    "short_answer": ["Be terse.\n\n", "One short line.\n\n"],
    "no_letters": ["Digits and punctuation.\n\n", "Avoid letters.\n\n"],
}


def task_row(kind: str, name: str, prefix: str, split: str | None) -> dict:
    d = LEARNABLE_DIR / kind
    tests = {str(p.relative_to(d)): p.read_text() for p in sorted((d / "tests").rglob("*.py"))}
    row = {"name": name, "prompt": prefix + (d / "start.md").read_text(), "tests": tests,
           "test_commands": json.loads((d / "test_commands.json").read_text()),
           "test_case_count": int((d / "test_case_count.txt").read_text()), "metadata": {"kind": kind, "max_chars": 40}}
    if split:
        row["split"] = split
    return row


def write_dataset(path: Path) -> None:
    rows = []
    for kind, prefixes in TRAIN_WORDINGS.items():
        rows += [task_row(kind, f"{kind}-{i}", p, None) for i, p in enumerate(prefixes)]
    for kind, prefixes in HELD_OUT_WORDINGS.items():
        rows += [task_row(kind, f"{kind}-held-{i}", p, "validation") for i, p in enumerate(prefixes)]
    bad = task_row("short_answer", "escapes", "", None)
    bad["files"] = {"../outside.txt": "x"}  # refused: a path leaving the workspace
    rows.append(bad)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--keep", action="store_true", help="keep the run directory (printed)")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="an extra configuration override for the run (repeatable)")
    ap.add_argument("--extra", action="append", default=[], metavar="MODULE:FUNCTION",
                    help="f(run_dir, report) -> dict of extra keys for loop.json (repeatable)")
    ap.add_argument("--out", default=str(OUT))
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="gyre-bench-loop-"))
    run_dir = work / "run"
    dataset = work / "tasks.jsonl"
    write_dataset(dataset)
    recipes = REPO / "docs" / "recipes"
    over = [f"run.dir={run_dir}", f"run.steps={args.steps}", "proxy.port=0", f"dataset.path={dataset}",
            "dataset.seed=0", "reward.function=reward_fn:score", f'reward.pythonpath=["{recipes}"]',
            f"validate.every_steps={EVERY}", f"validate.samples={SAMPLES}", f"validate.k={K}",
            f"validate.pass_threshold={PASS_THRESHOLD}", *args.set]
    cmd = [sys.executable, "-m", "gyre.cli", "run", "--config", str(CONFIG), "--no-plots", *over]
    print("$ " + " ".join(cmd), flush=True)
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    wall = time.monotonic() - t0
    print("\n".join(x for x in proc.stdout.splitlines() if x.startswith(("gyre: validation", "gyre: step", "gyre: run"))))
    if proc.returncode != 0:
        print(proc.stdout[-4000:], file=sys.stderr)
        print(f"gyre run failed (exit {proc.returncode}); run dir kept: {run_dir}", file=sys.stderr)
        return 1
    report = json.loads((run_dir / "report.json").read_text())
    rounds = sorted(report["validation"], key=lambda r: r["version"])
    rewards = [json.loads(x) for x in (run_dir / "rewards.jsonl").read_text().splitlines()]
    from gyre.harness.datasets import load_dataset

    ds = load_dataset(dataset, work / "check", reward_configured=True)
    out = {"steps": args.steps, "wall_s": round(wall, 1), "pass_threshold": PASS_THRESHOLD, "samples": SAMPLES,
           "k": K, "validate_every_steps": EVERY,
           "val_pass1_first": rounds[0]["pass@1"], "val_pass1_last": rounds[-1]["pass@1"],
           "val_passk_last": rounds[-1]["pass@k"], "val_reward_first": rounds[0]["reward_mean"],
           "val_reward_last": rounds[-1]["reward_mean"],
           "val_rounds": [{"version": r["version"], "pass@1": r["pass@1"], "pass@k": r["pass@k"],
                           "reward_mean": r["reward_mean"], "parts": r["parts"]} for r in rounds],
           "reward_fn_calls": len(rewards), "reward_fn_errors": sum(1 for r in rewards if r["error"]),
           "dataset_rows_loaded": ds.rows_loaded, "dataset_rows_refused": ds.rows_refused,
           "overrides": args.set}
    for spec in args.extra:
        mod, _, fn = spec.partition(":")
        out.update(getattr(importlib.import_module(mod), fn)(run_dir, report))
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
    print(json.dumps({k: v for k, v in out.items() if k != "val_rounds"}, indent=1))
    if args.keep:
        print(f"run dir kept: {run_dir}")
    else:
        shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
