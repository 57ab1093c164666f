"""Probes of the limits that bound the node (tests/harness/test_sandbox_limits.py,
benchmarks/bench_hostile.py).

    python node_limits.py RUN_DIR MAX_PROCESSES

runs a bash fork bomb as one sandboxed execution and prints, as one JSON line, how it ended and
the most processes its tree held at once (sampled every 20 ms). Run it as an ordinary user
(`ordinary_user_argv`): the kernel never applies RLIMIT_NPROC to the host's root.
"""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import threading
import time
from pathlib import Path

from gyre.harness.limits import _stat_all
from gyre.harness.runner import HarnessPool, Limits
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import load_suite

BOMB = ":(){ :|:& };:; sleep 60"
ROOT = Path(__file__).resolve().parents[2]
# Python that writes 64 KiB blocks to each folder of DIRS until the file system refuses (at most
# `cap` bytes), then records the bytes and the errno per folder in `out`
FILL_DIRS = """
for d in DIRS:
    n, err = 0, None
    try:
        with open(os.path.join(d, 'fill'), 'wb') as f:
            while n < cap:
                f.write(b'x' * 65536)
                f.flush()
                n += 65536
    except OSError as e:
        err = errno.errorcode.get(e.errno, str(e.errno))
    out[d] = [n, err]
    try:
        os.unlink(os.path.join(d, 'fill'))
    except OSError:
        pass
"""
# a harness that fills each path given (at most 64 MiB, or `GYRE_FILL_MB`) and writes down what it could
FILL = ("import errno, json, os, sys\ncap, out = int(os.environ.get('GYRE_FILL_MB', '64')) << 20, {}\n"
        "DIRS = sys.argv[1:]\n" + FILL_DIRS + "json.dump(out, open('/workspace/fill.json', 'w'))\n")


def ordinary_user_argv(tmp: Path, nproc_net: int = 1500) -> tuple[list[str] | None, str]:
    """(argv prefix that runs Python with Gyre importable as an ordinary user, or None; why not).
    Root runs it as nobody (``tmp`` is given to nobody), under a cap of nobody's processes on the
    whole node in case the sandbox's own cap does not hold."""
    if os.getuid() != 0:
        return [sys.executable], ""
    if shutil.which("setpriv") is None or shutil.which("prlimit") is None:
        return None, "root, and setpriv/prlimit (util-linux) are missing to run it as nobody"
    os.chown(tmp, 65534, 65534)
    path = os.pathsep.join([str(ROOT), sysconfig.get_paths()["purelib"]])
    for py in (sys.executable, f"/usr/bin/python{sys.version_info.major}.{sys.version_info.minor}"):
        argv = ["prlimit", f"--nproc={nproc_net}:{nproc_net}", "setpriv", "--reuid=65534", "--regid=65534",
                "--clear-groups", "env", f"PYTHONPATH={path}", f"HOME={tmp}", py]
        if subprocess.run([*argv, "-c", "import gyre.harness.runner"], capture_output=True).returncode == 0:
            return argv, ""
    return None, "no Python that nobody may run with Gyre's packages (the venv lies under a private folder)"


def fork_bomb(tmp: Path, max_processes: int, nproc_net: int = 1500) -> dict:
    """The probe below, run as an ordinary user; {"skipped": why} where none can run it."""
    argv, why = ordinary_user_argv(tmp, nproc_net)
    if argv is None:
        return {"skipped": why}
    out = subprocess.run([*argv, __file__, str(tmp / "run"), str(max_processes)],
                         capture_output=True, text=True, timeout=180)
    if out.returncode != 0:
        raise RuntimeError(f"the fork bomb probe failed: {out.stderr[-2000:]}")
    return json.loads(out.stdout.strip().splitlines()[-1])


def descendants(root: int) -> int:
    procs = _stat_all()
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    seen, todo = {root}, [root]
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in seen:
                seen.add(c)
                todo.append(c)
    return len(seen)


def main(run_dir: str, max_processes: int) -> dict:
    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    pool = HarnessPool(run_dir, ["bash", "-c", BOMB],
                       limits=Limits(timeout_s=60, kill_grace_s=0.5, poll_s=1.0, max_processes=max_processes),
                       environments=Environments(SandboxConfig(sandbox="bwrap")))
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            for r in list(pool._running):
                peak[0] = max(peak[0], descendants(r.process.pid))
            time.sleep(0.02)

    t = threading.Thread(target=sample, daemon=True)
    t.start()
    t0 = time.monotonic()
    res = asyncio.run(pool.run_execution(task, "bomb", api_key="k", base_url="http://127.0.0.1:9/v1"))
    done.set()
    t.join()
    return {"status": res.status, "error": res.error, "peak_processes": peak[0],
            "stopped_after_s": round(time.monotonic() - t0, 2)}


if __name__ == "__main__":
    print(json.dumps(main(sys.argv[1], int(sys.argv[2]))), flush=True)
