"""Probe of the node limits during scoring (tests/harness/test_runtime_limits.py).

    python eval_limits.py SCRATCH MAX_PROCESSES TMPFS_MB

scores a builtin task (fizzbuzz, its reference solution) inside bubblewrap, its test command
replaced by a hostile script of the candidate repository (``python3 hostile_tests.py``: the
interpreter of /usr, which an ordinary user can run; Gyre's virtualenv may lie in a folder private
to root). The script fills /tmp and /dev/shm until the file system refuses, and forks children that wait on a pipe
until a fork is refused or ``ATTEMPTS`` of them run (bounded: the probe never becomes a real fork
bomb, with or without the cap). It then releases them and writes what it saw to probe.json in the
scored copy. Prints one JSON line: how the evaluation ended and the probe's findings. Run it as an
ordinary user (`node_limits.ordinary_user_argv`): the kernel never applies RLIMIT_NPROC to root.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ATTEMPTS = 400  # forks tried at most: twice the cap of the max_processes the test uses (20: 200)
FORKS = """
r, w = os.pipe()
kids, refused = [], None
for _ in range(%d):
    try:
        pid = os.fork()
    except OSError as e:
        refused = errno.errorcode.get(e.errno, str(e.errno))
        break
    if pid == 0:
        os.close(w)
        os.read(r, 1)  # until every write end is closed: the parent's, below
        os._exit(0)
    kids.append(pid)
os.close(w)
for pid in kids:
    os.waitpid(pid, 0)
out.update(forks=len(kids), refused=refused)
json.dump(out, open('/workspace/probe.json', 'w'))
""" % ATTEMPTS


def hostile_tests() -> str:
    """The repository's test script: /tmp and /dev/shm filled (at most 64 MiB each), then the forks."""
    from support.node_limits import FILL_DIRS

    return "import errno, json, os\ncap, out = 64 << 20, {}\nDIRS = ('/tmp', '/dev/shm')\n" + FILL_DIRS + FORKS


def scored(scratch: Path, max_processes: int, tmpfs_mb: int, nproc_net: int = 1500) -> dict:
    """The probe below, run as an ordinary user; {"skipped": why} where none can run it."""
    from support.node_limits import ordinary_user_argv

    argv, why = ordinary_user_argv(scratch, nproc_net)
    if argv is None:
        return {"skipped": why}
    out = subprocess.run([*argv, __file__, str(scratch), str(max_processes), str(tmpfs_mb)],
                         capture_output=True, text=True, timeout=300, cwd=scratch)
    if out.returncode != 0:
        raise RuntimeError(f"the evaluation probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def main(scratch: str, max_processes: int, tmpfs_mb: int) -> dict:
    import dataclasses

    from gyre.harness.evaluator import EvalOptions, evaluate_workspace
    from gyre.harness.sandbox import Environments, SandboxConfig
    from support.eval_tasks import SOLUTIONS, TASKS

    root = Path(scratch)
    ws = root / "ws"
    shutil.copytree(SOLUTIONS / "fizzbuzz", ws)
    (ws / "hostile_tests.py").write_text(hostile_tests())
    task = dataclasses.replace(TASKS["fizzbuzz"], test_commands=("python3 hostile_tests.py",))
    envs = Environments(SandboxConfig(sandbox="bwrap", tmpfs_mb=tmpfs_mb))
    opts = EvalOptions(timeout_s=120, scratch_dir=str(root / "eval"), keep_scratch=True,
                       max_processes=max_processes, environments=envs)
    ev = evaluate_workspace(task, ws, "done", opts, root / "eval.log")
    probes = list((root / "eval").glob("gyre-eval-*/repo/probe.json"))
    return {"source": ev.source, "error": ev.error, "environment": ev.environment,
            "probe": json.loads(probes[0].read_text()) if probes else None}


if __name__ == "__main__":
    sys.path[:0] = [str(ROOT / "tests")]
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))), flush=True)
