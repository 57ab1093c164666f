"""Limits that bound the node under every runtime (issue 34): the command line each runtime
builds carries the sizes and caps it can enforce, a limit it cannot enforce is warned of once
(naming the key and the fix), and the evaluator's commands get the harness's kernel cap and sized
scratch (a hostile repository's tests, scored in bubblewrap)."""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
import warnings
from pathlib import Path

import pytest

from gyre.harness.evaluator import EvalOptions
from gyre.harness.limits import kernel_counts_per_namespace, kernel_process_cap
from gyre.harness.runtimes import ImageRef, Instance, Mount, get_runtime
from gyre.harness.sandbox import (INIT, Environments, Placement, SandboxConfig, UnboundedWarning,
                                  host_user_namespace)
from support import eval_limits

PY = sys.executable
INIT_FILE = Path(__file__).resolve().parents[2] / "gyre" / "harness" / "sandbox_init.py"


def _inst(runtime: str, location: str, tmpfs_mb: int = 0, process_cap: int = 0) -> Instance:
    return Instance(argv=["python3", "-S", INIT, "--", "agent"], mounts=[Mount("/runs/ws/e1", "/workspace", True)],
                    env={"OPENAI_API_KEY": "sk-secret"}, image=ImageRef(runtime, location, "x"), name="t-g0",
                    tmpfs_mb=tmpfs_mb, process_cap=process_cap)


def _after(argv: list[str], flag: str) -> list[str]:
    """Every value that follows ``flag`` in ``argv``."""
    return [argv[i + 1] for i, a in enumerate(argv[:-1]) if a == flag]


@pytest.mark.parametrize("program", ["podman", "docker"])
def test_oci_sizes_tmp_and_shm_and_caps_pids(program):
    la = get_runtime(program).launch(_inst(program, "ghcr.io/x/t:1.0", tmpfs_mb=48, process_cap=208))
    assert _after(la.argv, "--tmpfs") == ["/tmp:rw,exec,nosuid,nodev,mode=1777,size=48m"]
    assert _after(la.argv, "--shm-size") == ["48m"] and _after(la.argv, "--pids-limit") == ["208"]
    # every option before the image: after it they would be the harness's arguments
    image_at = la.argv.index("ghcr.io/x/t:1.0")
    assert max(la.argv.index(f) for f in ("--tmpfs", "--shm-size", "--pids-limit")) < image_at
    unsized = get_runtime(program).launch(_inst(program, "ghcr.io/x/t:1.0")).argv
    assert not {"--tmpfs", "--shm-size", "--pids-limit"} & set(unsized)


def test_enroot_mounts_sized_tmpfs_over_its_own_tmp_and_the_hosts_dev_shm():
    la = get_runtime("enroot").launch(_inst("enroot", "/img/t.sqsh", tmpfs_mb=48))
    mounts = _after(la.argv, "--mount")
    for dst in ("/tmp", "/dev/shm"):
        assert f"tmpfs:{dst}:tmpfs:x-create=dir,rw,nosuid,nodev,mode=1777,size=48m" in mounts, mounts
    assert "/runs/ws/e1:/workspace:none:x-create=auto,rbind" in mounts
    assert la.argv.index("t-g0") > max(i for i, a in enumerate(la.argv) if a == "--mount")
    assert not any(m.startswith("tmpfs:") for m in _after(get_runtime("enroot").launch(
        _inst("enroot", "/img/t.sqsh")).argv, "--mount"))


def test_what_a_runtime_cannot_bound_names_the_key_and_the_fix():
    apptainer = get_runtime("apptainer").unbounded(2048, 1024)
    assert len(apptainer) == 2
    assert apptainer[0].startswith("harness.tmpfs_mb = 2048") and "/dev/shm" in apptainer[0]
    assert "sessiondir max size" in apptainer[0] and "bwrap" in apptainer[0]
    assert apptainer[1].startswith("harness.max_processes = 1024") and "user namespace" in apptainer[1]
    assert get_runtime("singularity").unbounded(2048, 0)[0].startswith("harness.tmpfs_mb = 2048 does not hold "
                                                                        "under singularity")
    enroot = get_runtime("enroot").unbounded(2048, 1024)
    assert len(enroot) == 1 and enroot[0].startswith("harness.tmpfs_mb = 2048") and "10-system.fstab" in enroot[0]
    for name in ("bwrap", "podman", "docker"):  # all of it holds there
        assert get_runtime(name).unbounded(2048, 1024) == []
    for name in ("apptainer", "enroot"):  # nothing asked, nothing to say
        assert get_runtime(name).unbounded(0, 0) == []


def test_an_unbounded_limit_is_warned_of_once_per_process():
    envs = Environments(SandboxConfig(tmpfs_mb=64))
    place = Placement("image", get_runtime("apptainer"), ImageRef("apptainer", "/img/t.sif", "x"), True, None)
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        envs.warn_unbounded(place, 50)
        envs.warn_unbounded(place, 50)  # the next execution under it: already said
    said = [str(w.message) for w in seen if issubclass(w.category, UnboundedWarning)]
    assert len(said) == 2 and said[0].startswith("harness.tmpfs_mb = 64") and \
        said[1].startswith("harness.max_processes = 50"), said
    if shutil.which("bwrap"):  # bubblewrap holds both: nothing said
        bwrap = Placement("sandbox", get_runtime("bwrap"), None, True, None)
        with warnings.catch_warnings():
            warnings.simplefilter("error")
            envs.warn_unbounded(bwrap, 50)


def test_every_sandboxed_launcher_carries_the_process_cap_and_the_hosts_namespace():
    envs = Environments(SandboxConfig(tmpfs_mb=64))
    for place in (Placement("image", get_runtime("enroot"), ImageRef("enroot", "/i.sqsh", "x"), True, None),
                  Placement("image", get_runtime("podman"), ImageRef("podman", "x:1", "x"), True, None)):
        argv = envs.launcher(place, 50)
        if kernel_counts_per_namespace():
            assert argv[3:] == ["--nproc", str(kernel_process_cap(50)), "--host-userns", host_user_namespace()]
        assert envs.launcher(place, 0) == argv[:3]
        inst = envs.instance(place, argv, [], {}, name="t", private=[], max_processes=50)
        assert (inst.process_cap, inst.tmpfs_mb) == (kernel_process_cap(50), 64)
        assert envs.instance(place, argv, [], {}, name="t", private=[]).process_cap == 0
    with pytest.warns(Warning):
        bare = Environments(SandboxConfig(sandbox="none"))
    # no sandbox: Gyre's own namespace, where RLIMIT_NPROC would count all its user's processes
    assert "--nproc" not in bare.launcher(Placement("host", None, None, True, None), 50)


def _launched_rlimit(*cap: str) -> subprocess.CompletedProcess:
    probe = "import resource; print(resource.getrlimit(resource.RLIMIT_NPROC)[0])"
    return subprocess.run([PY, "-S", str(INIT_FILE), *cap, "--", PY, "-S", "-c", probe],
                          capture_output=True, text=True, timeout=60)


def test_the_launcher_leaves_the_cap_unset_in_the_hosts_own_user_namespace():
    # a runtime that made no user namespace: the cap would hold the instance to every process
    # of the user on the node, so it is not set, and the harness's stderr says so
    before = _launched_rlimit().stdout
    same = _launched_rlimit("--nproc", "100000", "--host-userns", host_user_namespace())
    assert same.returncode == 0 and same.stdout == before
    assert "no user namespace of its own" in same.stderr and "not set" in same.stderr
    # another namespace (as in a sandbox): set (a cap high enough to hold no one back here)
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NPROC)[1]
    other = _launched_rlimit("--nproc", "100000", "--host-userns", "user:[1]")
    want = 100000 if hard == resource.RLIM_INFINITY else min(100000, hard)
    assert other.returncode == 0 and other.stdout.strip() == str(want), other


def test_evaluation_options_take_the_harness_process_limit():
    from gyre.config import load_config

    cfg = load_config(None, ["harness.max_processes=77"])
    assert EvalOptions.from_config(cfg).max_processes == 77


@pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")
@pytest.mark.skipif(not kernel_counts_per_namespace(), reason="RLIMIT_NPROC per user namespace needs Linux 5.14")
def test_a_hostile_repository_cannot_fork_bomb_or_fill_the_node_while_scored():
    with tempfile.TemporaryDirectory(prefix="gyre-evalbomb-") as tmp:  # pytest's own is private to root
        got = eval_limits.scored(Path(tmp), max_processes=20, tmpfs_mb=4)
    if "skipped" in got:
        pytest.skip(got["skipped"])
    probe = got["probe"]
    assert probe is not None, got
    # the kernel refused forks at the harness's cap (200 tasks; without it all 400 ran), counting
    # the launcher and pytest too
    assert probe["refused"] == "EAGAIN" and probe["forks"] < kernel_process_cap(20) <= eval_limits.ATTEMPTS, got
    for scratch in ("/tmp", "/dev/shm"):  # full at harness.tmpfs_mb, not at the node's memory
        n, err = probe[scratch]
        assert err == "ENOSPC" and 3 << 20 <= n <= 4 << 20, (scratch, got)
    # and the evaluation itself went on to its end (a score, not an evaluator error)
    assert got["source"] == "tests" and got["environment"] == "bwrap (host root)", got
