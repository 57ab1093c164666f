"""Your reward (gyre/harness/reward.py): a function by dotted path in a subprocess with a time limit,
or a reward server; errors are failed evaluations with their reason, never a 0."""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
from pathlib import Path

import pytest
from aiohttp import web

from gyre.config import ConfigError, load_config
from gyre.harness.evaluator import EvalOptions, EvaluatorPool
from gyre.harness.reward import RewardError, RewardFn, interpret
from gyre.harness.sandbox import SandboxConfig, UnsandboxedWarning
from gyre.traj.tree import CallRecord
from support.eval_tasks import TASKS, workspace

RECIPES = Path(__file__).resolve().parents[2] / "docs" / "recipes"
needs_bwrap = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")


def _module(tmp_path: Path, body: str) -> Path:
    d = tmp_path / "mods"
    d.mkdir(exist_ok=True)
    (d / "my_reward.py").write_text(body)
    return d


def _pool(tmp_path, reward: RewardFn) -> EvaluatorPool:
    return EvaluatorPool(EvalOptions(timeout_s=60, scratch_dir=str(tmp_path / "scratch")), workers=1, reward=reward)


def test_interpret_floats_and_parts():
    assert interpret(0.25) == (0.25, {})
    assert interpret({"a": 0.5, "b": -0.25}) == (0.25, {"a": 0.5, "b": -0.25})
    assert interpret({"reward": 0.9, "style": 0.1}) == (0.9, {"reward": 0.9, "style": 0.1})
    for bad in (float("nan"), True, "1.0", {}, {"a": "x"}, None, [1.0]):
        with pytest.raises(RewardError):
            interpret(bad)


def test_recipe_scores_with_parts_and_logs_them(tmp_path):
    """The recipe of docs/recipes runs in its own interpreter: the tests' share plus shaping parts."""
    rf = RewardFn("reward_fn:score", pythonpath=[RECIPES], timeout_s=30, log_path=tmp_path / "rewards.jsonl")
    ws = workspace(tmp_path, {"answer.txt": "short"}, solution="fizzbuzz")
    calls = [CallRecord(0, 1, "main", 10, 24, "v0", 0, finish_reason="length"),
             CallRecord(1, 2, "main", 40, 5, "v0", 0, finish_reason="stop")]
    with _pool(tmp_path, rf) as pool:
        ev = pool.submit(TASKS["fizzbuzz"], ws, "timeout", execution_id=None, calls=calls).result()
    assert ev.source == "reward-after-timeout" and ev.error is None, ev
    assert ev.parts == {"tests": 1.0, "brevity": 0.1, "truncation": -0.05}
    assert ev.reward == pytest.approx(1.05)
    assert ev.passed == ev.total == TASKS["fizzbuzz"].test_case_count  # the tests' counts are kept
    line = json.loads((tmp_path / "rewards.jsonl").read_text())
    assert line["parts"] == ev.parts and line["error"] is None
    assert (rf.calls, rf.errors) == (1, 0)


@pytest.mark.parametrize("body,timeout,why", [
    ("def score(**kw):\n    raise ValueError('no answer.txt')\n", 20, "ValueError: no answer.txt"),
    ("def score(**kw):\n    return float('nan')\n", 20, "must be finite"),
    # the limit ends a function that never returns, wherever it lands (even before the import):
    # 0.5 s, not more, as the loop burns a core until then
    ("def score(**kw):\n    while True:\n        pass\n", 0.5, "reward.timeout_s = 0.5 s"),
    ("x = 1\n", 20, "cannot import reward.function"),
])
def test_a_failing_reward_is_recorded_with_its_reason(tmp_path, body, timeout, why):
    rf = RewardFn("my_reward:score", pythonpath=[_module(tmp_path, body)], timeout_s=timeout,
                  log_path=tmp_path / "rewards.jsonl")
    res = rf({"workspace": str(tmp_path), "task": {}, "tests": None, "calls": []}, "e1")
    assert res.reward is None and why in res.error, res.error
    assert (rf.calls, rf.errors) == (1, 1)
    assert json.loads((tmp_path / "rewards.jsonl").read_text())["error"] == res.error


def test_a_failing_reward_is_a_failed_evaluation_never_zero(tmp_path):
    body = "def score(**kw):\n    raise ValueError('no answer.txt')\n"
    rf = RewardFn("my_reward:score", pythonpath=[_module(tmp_path, body)], timeout_s=20)
    with _pool(tmp_path, rf) as pool:
        ev = pool.submit(TASKS["fizzbuzz"], workspace(tmp_path, solution="fizzbuzz"), "done").result()
    assert ev.reward is None and ev.source == "reward-error" and "ValueError: no answer.txt" in ev.error
    assert ev.official_reward == 1.0  # the benchmark's score is the tests', untouched


@pytest.mark.slow
def test_the_function_gets_workspace_task_tests_and_calls(tmp_path):
    body = ("import json, os\n"
            "def score(workspace, task, tests, calls):\n"
            "    return {'n_calls': len(calls), 'passed': tests['passed'], 'ws': float(os.path.isdir(workspace)),\n"
            "            'prompt': float(len(task['prompt']) > 0), 'reward': 0.5}\n")
    rf = RewardFn("my_reward:score", pythonpath=[_module(tmp_path, body)], timeout_s=30)
    with _pool(tmp_path, rf) as pool:
        ev = pool.submit(TASKS["fizzbuzz"], workspace(tmp_path, solution="fizzbuzz"), "done",
                         calls=[CallRecord(0, 1, "main", 1, 1, "v0", 0)]).result()
    assert ev.reward == 0.5 and ev.source == "reward"
    assert ev.parts == {"n_calls": 1.0, "passed": float(TASKS["fizzbuzz"].test_case_count), "ws": 1.0,
                        "prompt": 1.0, "reward": 0.5}


# What a reward function may not do in the harness's sandbox: each one is an exception in the
# function, recorded as a reward-error with its reason (never a silent 0), and nothing leaks out.
ESCAPES = {
    "write-run-dir": ("from pathlib import Path\n"
                      "def score(workspace, **kw):\n"
                      "    Path({outside!r}).write_text('escaped')\n"
                      "    return 1.0\n", "FileNotFoundError"),
    "write-own-folder": ("from pathlib import Path\n"
                         "def score(workspace, **kw):\n"
                         "    Path(__file__).with_name('escaped.txt').write_text('escaped')\n"
                         "    return 1.0\n", "OSError: [Errno 30] Read-only file system"),
    "write-workspace": ("from pathlib import Path\n"
                        "def score(workspace, **kw):\n"
                        "    (Path(workspace) / 'answer.txt').write_text('rewritten')\n"
                        "    return 1.0\n", "OSError: [Errno 30] Read-only file system"),
    "read-secret": ("from pathlib import Path\n"
                    "def score(workspace, **kw):\n"
                    "    return float(len(Path({secret!r}).read_text()))\n", "FileNotFoundError"),
    "read-run-dir": ("from pathlib import Path\n"
                     "def score(workspace, **kw):\n"
                     "    return float(len(Path({run_log!r}).read_text()))\n", "FileNotFoundError"),
    "fill-tmp": ("def score(workspace, **kw):\n"  # files under the size rlimit, more than the tmpfs
                 "    for i in range(10):\n"
                 "        with open(f'/tmp/big{{i}}', 'wb') as f:\n"
                 "            f.write(b'x' * (4 << 20))\n"
                 "    return 1.0\n", "No space left on device"),
}


@needs_bwrap
@pytest.mark.parametrize("case", sorted(ESCAPES))
def test_a_reward_that_leaves_its_sandbox_is_a_recorded_reward_error(tmp_path, case):
    """The reward runs under the harness's sandbox and limits (harness.tmpfs_mb here): writing
    into the run directory, its own folder or the workspace, reading a host file or the run
    directory, filling its /tmp. (Its /tmp is its own scratch: a write there reaches no host file.)"""
    run = tmp_path / "run"
    run.mkdir()
    (run / "rewards.jsonl").write_text("")  # the run directory exists and holds something
    secret, outside = tmp_path / "secret.txt", run / "escaped.txt"
    secret.write_text("the hidden tests")
    ws = workspace(tmp_path, {"answer.txt": "mine"}, solution="fizzbuzz")
    body, why = ESCAPES[case]
    body = body.format(outside=str(outside), secret=str(secret), run_log=str(run / "rewards.jsonl"))
    rf = RewardFn("my_reward:score", pythonpath=[_module(tmp_path, body)], timeout_s=30,
                  log_path=run / "rewards.jsonl", sandbox=SandboxConfig(sandbox="bwrap", tmpfs_mb=16))
    with _pool(tmp_path, rf) as pool:
        ev = pool.submit(TASKS["fizzbuzz"], ws, "done").result()
    assert ev.reward is None and ev.source == "reward-error" and why in ev.error, ev
    assert ev.official_reward == 1.0  # the tests' score is untouched
    assert not outside.exists() and not (tmp_path / "mods" / "escaped.txt").exists()
    assert (ws / "answer.txt").read_text() == "mine"
    line = json.loads((run / "rewards.jsonl").read_text())
    assert line["error"] == ev.error and line["reward"] is None and (rf.calls, rf.errors) == (1, 1)
    assert line["sandbox"] == "bwrap"


@needs_bwrap
def test_a_reward_in_its_sandbox_sees_the_workspace_its_module_and_a_scratch(tmp_path):
    """What it may do: read the workspace (at /workspace), files beside its module, the tests'
    log; write its private /tmp; print (to its stderr, never into the answer)."""
    mods = _module(tmp_path, "import os\n"
                             "from pathlib import Path\n"
                             "HERE = Path(__file__).parent\n"
                             "def score(workspace, task, tests, calls):\n"
                             "    print('chatty reward')\n"
                             "    Path('/tmp/gyre-reward-scratch').write_text('ok')\n"
                             "    return {'reward': float((HERE / 'weight.txt').read_text()),\n"
                             "            'answer': float(Path(workspace, 'answer.txt').read_text() == 'mine'),\n"
                             "            'at': float(workspace == '/workspace'),\n"
                             "            'log': float('passed' in Path(tests['log_path']).read_text()),\n"
                             "            'scratch': float(Path('/tmp/gyre-reward-scratch').read_text() == 'ok')}\n")
    (mods / "weight.txt").write_text("0.5")
    rf = RewardFn("my_reward:score", pythonpath=[mods], timeout_s=30, sandbox=SandboxConfig(sandbox="bwrap"))
    ws = workspace(tmp_path, {"answer.txt": "mine"}, solution="fizzbuzz")
    with _pool(tmp_path, rf) as pool:
        ev = pool.submit(TASKS["fizzbuzz"], ws, "done", log_path=tmp_path / "eval.log").result()
    assert ev.error is None and ev.source == "reward", ev
    assert ev.parts == {"reward": 0.5, "answer": 1.0, "at": 1.0, "log": 1.0, "scratch": 1.0}
    assert ev.reward == 0.5 and not Path("/tmp/gyre-reward-scratch").exists()  # its /tmp was its own


def test_sandbox_none_runs_the_reward_bare(tmp_path):
    """harness.sandbox = none (warned): the reward runs bare, the workspace at its host path."""
    body = "def score(workspace, **kw):\n    return float(workspace == {ws!r})\n"
    ws = workspace(tmp_path, solution="fizzbuzz")
    with pytest.warns(UnsandboxedWarning):
        rf = RewardFn("my_reward:score", pythonpath=[_module(tmp_path, body.format(ws=str(ws)))], timeout_s=20,
                      sandbox=SandboxConfig(sandbox="none"))
        res = rf({"workspace": str(ws), "task": {}, "tests": None, "calls": []}, "e1")
    assert (res.reward, res.error) == (1.0, None)


def test_a_missing_pythonpath_folder_is_named(tmp_path):
    rf = RewardFn("my_reward:score", pythonpath=[tmp_path / "nowhere"], timeout_s=20)
    res = rf({"workspace": str(tmp_path), "task": {}, "tests": None, "calls": []}, "e1")
    assert res.reward is None and f"reward.pythonpath: {tmp_path / 'nowhere'} is not a folder" in res.error


def _serve(handler):
    """A real reward server on loopback, in its own thread and loop."""
    started, box = threading.Event(), {}

    def main():
        loop = asyncio.new_event_loop()
        app = web.Application()
        app.router.add_post("/score", handler)
        runner = web.AppRunner(app)
        loop.run_until_complete(runner.setup())
        site = web.TCPSite(runner, "127.0.0.1", 0)
        loop.run_until_complete(site.start())
        box["port"], box["loop"], box["runner"] = site._server.sockets[0].getsockname()[1], loop, runner
        started.set()
        loop.run_forever()
        loop.run_until_complete(runner.cleanup())

    t = threading.Thread(target=main, daemon=True)
    t.start()
    started.wait(10)
    return box, t


def test_reward_server(tmp_path):
    seen = []

    async def handler(request):
        body = await request.json()
        seen.append(body)
        if body["execution_id"] == "bad":
            return web.Response(status=500, text="boom")
        return web.json_response({"reward": 0.75, "style": 0.25})

    box, t = _serve(handler)
    try:
        rf = RewardFn(url=f"http://127.0.0.1:{box['port']}/score", timeout_s=10)
        ok = rf({"workspace": "/w", "task": {"name": "t"}, "tests": None, "calls": [], "execution_id": "good"}, "good")
        assert (ok.reward, ok.parts, ok.error) == (0.75, {"reward": 0.75, "style": 0.25}, None)
        bad = rf({"workspace": "/w", "task": {}, "tests": None, "calls": [], "execution_id": "bad"}, "bad")
        assert bad.reward is None and "500" in bad.error and "boom" in bad.error
        assert seen[0]["task"] == {"name": "t"} and (rf.calls, rf.errors) == (2, 1)
    finally:
        box["loop"].call_soon_threadsafe(box["loop"].stop)
        t.join(10)
    gone = RewardFn(url=f"http://127.0.0.1:{box['port']}/score", timeout_s=2)({}, "x")
    assert gone.reward is None and "unreachable" in gone.error


def test_config_refuses_bad_reward_keys():
    with pytest.raises(ConfigError, match="module:function"):
        load_config(None, ["reward.function=just_a_module"])
    with pytest.raises(ConfigError, match="both set"):
        load_config(None, ["reward.function=a:b", "reward.url=http://x/"])
    cfg = load_config(None, ["reward.function=reward_fn:score", f"reward.pythonpath=[\"{RECIPES}\"]"])
    assert RewardFn.from_config(cfg).label == "reward_fn:score"
    assert RewardFn.from_config(load_config(None, [])) is None  # the tests' score stays the default
    with pytest.raises(ConfigError, match="reward.pythonpath: no/such/folder is not a folder here"):
        RewardFn.from_config(load_config(None, ["reward.function=a:b", 'reward.pythonpath=["no/such/folder"]']))
