"""The Slurm dev cluster (slurm/devcluster.sh) as a test fixture, and job helpers."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest


REPO = Path(__file__).resolve().parents[2]
DEVCLUSTER = REPO / "slurm" / "devcluster.sh"
STATE = os.environ.get("GYRE_SLURM_DIR", "/tmp/gyre-devcluster")
APT = "apt-get install -y slurmctld slurmd slurm-client munge iproute2"


def _skip_reason() -> str | None:
    if sys.platform != "linux":
        return "the dev cluster needs Linux network namespaces"
    if os.geteuid() != 0:
        return "the dev cluster needs root (network namespaces, bridge, /etc/hosts)"
    missing = [c for c in ("slurmctld", "slurmd", "sbatch", "squeue", "scontrol", "munged", "ip", "nsenter", "unshare")
               if not shutil.which(c)]
    if missing:
        return f"missing {', '.join(missing)}: {APT}"
    probe = f"gyre-probe-{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", probe], capture_output=True, text=True, timeout=20)
    if r.returncode != 0:
        return f"cannot create network namespaces here: {r.stderr.strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True, timeout=20)
    return None


def _env() -> dict:
    env = dict(os.environ)
    env["SLURM_CONF"] = f"{STATE}/slurm.conf"
    env["GYRE_PYTHON"] = sys.executable
    env["PATH"] = f"{Path(sys.executable).parent}:{env.get('PATH', '/usr/bin:/bin')}"
    env.pop("GYRE_RESUME", None)
    return env


@pytest.fixture(scope="module")
def cluster():
    reason = _skip_reason()
    if reason:
        pytest.skip(reason)
    env = _env()
    # One dev cluster per machine: a second suite (another clone's CI) waits here instead of
    # cancelling this one's jobs or taking the cluster down under it.
    lock = open(f"{STATE}.lock", "w")
    fcntl.flock(lock, fcntl.LOCK_EX)
    already = subprocess.run([str(DEVCLUSTER), "status"], env=env, capture_output=True, timeout=30).returncode == 0
    t = time.time()
    r = subprocess.run([str(DEVCLUSTER), "up"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, f"devcluster up failed:\n{r.stdout}\n{r.stderr}"
    print(f"\ndev cluster {'reused' if already else 'up'} in {time.time() - t:.2f} s")
    try:
        yield env
    finally:
        if not already:
            subprocess.run([str(DEVCLUSTER), "down"], env=env, capture_output=True, timeout=120)
        lock.close()


def sbatch(env: dict, args: list, extra_env: dict | None = None) -> str:
    """`sbatch --parsable ARGS` (ARGS: options, the script, its arguments); the job id."""
    r = subprocess.run(["sbatch", "--parsable", *map(str, args)], env={**env, **(extra_env or {})},
                       cwd=REPO, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout.strip().split(";")[0]


def job_states(env: dict, job: str) -> set[str]:
    """The job's states; empty once Slurm no longer knows it. A failed squeue (slurmctld busy on a
    loaded machine) is asked again, not read as "the job ended"."""
    for _ in range(10):
        r = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T"], env=env, capture_output=True, text=True, timeout=30)
        if r.returncode == 0:
            return set(r.stdout.split())
        if "Invalid job id" in r.stderr:
            return set()
        time.sleep(1.0)
    raise AssertionError(f"squeue -j {job} failed 10 times: {r.stderr.strip()}")


def wait_gone(env: dict, job: str, timeout: float, out: Path) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        if not job_states(env, job):
            return
        time.sleep(0.5)
    why = _why_waiting(env, job)
    subprocess.run(["scancel", job], env=env, capture_output=True, timeout=30)
    wait_gone_quiet(env, job, 30)
    pytest.fail(f"job {job} still there after {timeout} s (cancelled); {why}; its output:\n{_tail(out)}")


def _why_waiting(env: dict, job: str) -> str:
    """The job's state and reason and the nodes' states (a pending job says why it waits)."""
    q = subprocess.run(["squeue", "-h", "-j", job, "-o", "%T %r"], env=env, capture_output=True, text=True, timeout=30)
    n = subprocess.run(["sinfo", "-h", "-N", "-o", "%N %T %E"], env=env, capture_output=True, text=True, timeout=30)
    return f"squeue: {q.stdout.strip() or q.stderr.strip()}; nodes: {'; '.join(n.stdout.split(chr(10)))}"


def wait_gone_quiet(env: dict, job: str, timeout: float) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline and job_states(env, job):
        time.sleep(0.5)


def _tail(p: Path, n: int = 6000) -> str:
    try:
        return p.read_text(errors="replace")[-n:]
    except OSError:
        return "(no output file)"
