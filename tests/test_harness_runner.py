"""The harness runner: workspaces, environment, placeholders, limits, statuses, concurrency."""

import asyncio
import json
import os
import stat
import sys
import time
from pathlib import Path

import pytest

from gyre.harness.runner import (HarnessPool, Limits, WorkspaceExists, classify, cleanup_workspaces,
                                 expand_argv)
from gyre.harness.tasks import load_suite

TASK = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
PY = sys.executable


def pool(tmp_path, command, **kw):
    limits = kw.pop("limits", Limits(timeout_s=30, kill_grace_s=0.5))
    return HarnessPool(tmp_path / "run", command, limits=limits, **kw)


def run(p: HarnessPool, eid="e1", task=TASK, **kw):
    return asyncio.run(p.run_execution(task, eid, api_key="key-" + eid, base_url="http://127.0.0.1:9/v1", **kw))


def group_gone(pgid: int, within_s: float = 5.0) -> bool:
    """No live member left in the group (zombies awaiting their reaper do not count)."""
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        alive = []
        for d in Path("/proc").iterdir():
            if d.name.isdigit():
                try:
                    fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
                except (FileNotFoundError, ProcessLookupError):
                    continue
                if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                    alive.append(d.name)
        if not alive:
            return True
        time.sleep(0.05)
    return False


def test_env_placeholders_and_layout(tmp_path, monkeypatch):
    monkeypatch.setenv("GYRE_TEST_SECRET", "do-not-leak")
    script = ("import json, os, sys; json.dump({'argv': sys.argv[1:], 'env': dict(os.environ), 'cwd': os.getcwd()},"
              " open('seen.json', 'w')); print('to stdout'); print('to stderr', file=sys.stderr)")
    p = pool(tmp_path, ["{python}", "-c", script, "{prompt_file}", "{workspace}", "{task_dir}", "{execution_id}",
                        "{python}", '{"not": "a placeholder"}', "{unknown}", "{prompt}"],
             pass_env=["PATH", "GYRE_TEST_MISSING"], extra_env={"MSWEA_CONFIGURED": "true"})
    res = run(p, "task-0.a", extra_env={"PER_EXECUTION": "1"})
    assert (res.status, res.returncode, res.error) == ("done", 0, None)
    ws = tmp_path / "run" / "workspaces" / "task-0.a"
    assert res.workspace == str(ws) and (ws / "start.md").read_text() == TASK.prompt
    seen = json.loads((ws / "seen.json").read_text())
    public = tmp_path / "run" / "tasks" / TASK.name
    assert seen["argv"] == [str(ws / "start.md"), str(ws), str(public), "task-0.a", PY,
                            '{"not": "a placeholder"}', "{unknown}", TASK.prompt]
    assert Path(seen["cwd"]) == ws
    env = seen["env"]
    assert env["OPENAI_BASE_URL"] == "http://127.0.0.1:9/v1" and env["OPENAI_API_KEY"] == "key-task-0.a"
    assert env["GYRE_WORKSPACE"] == str(ws) and env["GYRE_TASK_DIR"] == str(public)
    # the harness sees the published task files, never the hidden tests
    assert (public / "start.md").read_text() == TASK.prompt
    assert not any(p.name == "tests" or p.suffix == ".py" for p in public.rglob("*"))
    assert env["GYRE_EXECUTION_ID"] == "task-0.a" and env["MSWEA_CONFIGURED"] == "true"
    assert env["PER_EXECUTION"] == "1" and env["PATH"] == os.environ["PATH"]
    assert "GYRE_TEST_SECRET" not in env and "HOME" not in env
    logs = Path(res.log_dir)
    assert logs == tmp_path / "run" / "logs" / "task-0.a"
    assert (logs / "harness.stdout").read_text() == "to stdout\n"
    assert (logs / "harness.stderr").read_text() == "to stderr\n"
    for d in (tmp_path / "run", tmp_path / "run" / "workspaces", ws, tmp_path / "run" / "logs", logs):
        assert stat.S_IMODE(d.stat().st_mode) == 0o700, d


def test_exit_statuses(tmp_path):
    p = pool(tmp_path, ["sh", "-c", "exit 3"])
    res = run(p, "fail")
    assert (res.status, res.returncode, res.signal) == ("failed", 3, None)
    p = pool(tmp_path, ["no-such-harness-binary-xyz"])
    res = run(p, "missing")
    assert res.status == "failed" and "cannot start" in res.error
    assert (tmp_path / "run" / "workspaces" / "missing" / "start.md").exists()


@pytest.mark.parametrize("command,sig", [
    ([PY, "-c", "import os; os.abort()"], "SIGABRT"),
    (["bash", "-c", "kill -SEGV $$"], "SIGSEGV"),
    (["sh", "-c", f"{PY} -c 'import os; os.abort()'; exit $?"], "SIGABRT"),  # a shell reports 128+N
])
def test_crash_is_recorded(tmp_path, command, sig):
    res = run(pool(tmp_path, command), "crash")
    assert (res.status, res.signal) == ("crashed", sig), res
    assert Path(res.workspace, "start.md").exists()


def test_sleeping_forever_is_killed_at_the_limit(tmp_path):
    # The harness ignores SIGTERM and leaves a grandchild behind: the whole group must go.
    command = ["bash", "-c", "trap '' TERM; echo $$ > pgid; touch progress.py; sleep 1000 & sleep 1000; wait"]
    p = pool(tmp_path, command, limits=Limits(timeout_s=1.0, kill_grace_s=0.5))
    t0 = time.monotonic()
    res = run(p, "sleepy")
    assert time.monotonic() - t0 < 10
    assert (res.status, res.signal) == ("timeout", "SIGKILL") and "limit" in res.error
    ws = Path(res.workspace)
    assert (ws / "progress.py").exists() and (ws / "start.md").exists(), "the workspace is kept"
    assert group_gone(int((ws / "pgid").read_text()))


def test_term_is_enough_for_a_polite_harness(tmp_path):
    p = pool(tmp_path, ["sleep", "1000"], limits=Limits(timeout_s=0.5, kill_grace_s=5))
    t0 = time.monotonic()
    res = run(p, "polite")
    assert (res.status, res.signal) == ("timeout", "SIGTERM") and time.monotonic() - t0 < 4


def test_cpu_and_memory_limits(tmp_path):
    p = pool(tmp_path, [PY, "-c", "while True: pass"], limits=Limits(timeout_s=20, cpu_s=1))
    res = run(p, "spin")
    assert (res.status, res.signal) == ("crashed", "SIGXCPU"), res
    p = pool(tmp_path, [PY, "-c", "x = bytearray(1 << 30)"], limits=Limits(timeout_s=20, memory_mb=300))
    res = run(p, "hog")
    assert res.status == "failed" and "MemoryError" in Path(res.log_dir, "harness.stderr").read_text()


def test_concurrency_bound(tmp_path):
    script = "import time, sys; open('t', 'w').write(f'{time.time()} '); time.sleep(0.4); open('t', 'a').write(f'{time.time()}')"
    p = pool(tmp_path, [PY, "-c", script], concurrency=2)

    async def main():
        return await asyncio.gather(*(p.run_execution(TASK, f"c{i}", api_key="k", base_url="u") for i in range(5)))

    results = asyncio.run(main())
    assert [r.status for r in results] == ["done"] * 5
    assert p.max_running_seen == 2 and p.running == 0
    spans = [tuple(map(float, Path(r.workspace, "t").read_text().split())) for r in results]
    for start, _ in spans:  # at no start time were more than 2 executions inside their span
        assert sum(1 for s, e in spans if s <= start < e) <= 2


def test_reuse_and_bad_ids(tmp_path):
    p = pool(tmp_path, ["true"])
    assert run(p, "same").status == "done"
    with pytest.raises(WorkspaceExists):
        run(p, "same")
    for bad in ("../escape", "a/b", ".hidden", "", "x" * 300):
        with pytest.raises(ValueError):
            run(p, bad)
    assert not (tmp_path / "escape").exists()


def test_stop_all_and_cancel(tmp_path):
    p = pool(tmp_path, ["bash", "-c", "echo $$ > pgid; sleep 1000"], limits=Limits(timeout_s=60, kill_grace_s=0.5))

    async def main():
        runs = [asyncio.create_task(p.run_execution(TASK, f"s{i}", api_key="k", base_url="u")) for i in range(2)]
        while p.running < 2:
            await asyncio.sleep(0.05)
        await p.stop_all()
        results = await asyncio.gather(*runs)
        with pytest.raises(RuntimeError):
            await p.run_execution(TASK, "late", api_key="k", base_url="u")
        return results

    results = asyncio.run(main())
    assert [r.status for r in results] == ["stopped", "stopped"]
    for r in results:
        assert group_gone(int(Path(r.workspace, "pgid").read_text()))

    p2 = pool(tmp_path / "b", ["bash", "-c", "echo $$ > pgid; sleep 1000"])

    async def cancel():
        t = asyncio.create_task(p2.run_execution(TASK, "cancelled", api_key="k", base_url="u"))
        while not (tmp_path / "b" / "run" / "workspaces" / "cancelled" / "pgid").exists():
            await asyncio.sleep(0.05)
        await asyncio.sleep(0.1)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t

    asyncio.run(cancel())
    assert group_gone(int((tmp_path / "b" / "run" / "workspaces" / "cancelled" / "pgid").read_text()))


def test_cleanup_removes_only_given_workspaces(tmp_path):
    p = pool(tmp_path, ["true"])
    for eid in ("w1", "w2", "w3"):
        run(p, eid)
    assert cleanup_workspaces(tmp_path / "run", ["w1", "w3", "never-ran"]) == ["w1", "w3"]
    assert sorted(os.listdir(tmp_path / "run" / "workspaces")) == ["w2"]
    with pytest.raises(ValueError):
        cleanup_workspaces(tmp_path / "run", [".."])


def test_from_config(tmp_path):
    from gyre.config import load_config

    cfg = load_config(None, [f"run.dir={tmp_path}", "harness.concurrency=3", "harness.timeout_s=7",
                             'harness.env=["A=1", "B=x=y"]'])
    p = HarnessPool.from_config(cfg)
    assert p.concurrency == 3 and p.limits.timeout_s == 7 and p.extra_env == {"A": "1", "B": "x=y"}
    assert p.command == [ "{python}", "-m", "gyre.harness.reference_agent"]


def test_helpers():
    assert expand_argv(["{python}x{workspace}"], {"python": "p", "workspace": "w"}) == ["pxw"]
    with pytest.raises(ValueError):
        expand_argv([], {})
    assert classify(0, None) == ("done", None)
    assert classify(-15, "timeout") == ("timeout", "SIGTERM")
    assert classify(0, "stopped") == ("stopped", None)
    assert classify(-11, None) == ("crashed", "SIGSEGV")
    assert classify(139, None) == ("crashed", "SIGSEGV")
    assert classify(130, None) == ("failed", None)  # 128 + SIGINT: an ordinary exit status


def test_relative_run_dir_gives_absolute_paths(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    p = HarnessPool("rel-run", [PY, "-c", "import os; open('ws.txt', 'w').write(os.environ['GYRE_WORKSPACE'])"])
    res = run(p, "r1")
    assert res.status == "done" and Path(res.workspace).is_absolute()
    assert Path(res.workspace, "ws.txt").read_text() == str(tmp_path / "rel-run" / "workspaces" / "r1")


def test_kill_all_now(tmp_path):
    p = pool(tmp_path, ["bash", "-c", "echo $$ > pgid; sleep 1000"])

    async def main():
        t = asyncio.create_task(p.run_execution(TASK, "k1", api_key="k", base_url="u"))
        while p.running < 1:
            await asyncio.sleep(0.05)
        p.kill_all_now()
        return await t

    res = asyncio.run(main())
    assert (res.status, res.signal) == ("stopped", "SIGKILL")
    assert group_gone(int(Path(res.workspace, "pgid").read_text()))
