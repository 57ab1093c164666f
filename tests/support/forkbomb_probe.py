"""Runs a bash fork bomb as one sandboxed execution and prints, as one JSON line, how it ended and
the most processes its tree held at once (sampled every 20 ms).

    python forkbomb_probe.py RUN_DIR MAX_PROCESSES

Run it as an ordinary user: the kernel never applies RLIMIT_NPROC to the host's root, so a
root caller starts it under ``setpriv`` as nobody (tests/harness/test_sandbox_limits.py,
benchmarks/bench_hostile.py), with a node-wide RLIMIT_NPROC as a safety net.
"""

from __future__ import annotations

import asyncio
import json
import sys
import threading
import time

from gyre.harness.limits import _stat_all
from gyre.harness.runner import HarnessPool, Limits
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import load_suite

BOMB = ":(){ :|:& };:; sleep 60"


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
