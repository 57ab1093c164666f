"""docs/harnesses.md, followed as written: a standalone `gyre proxy` (the real command, a process)
in front of an engine, an execution registered over the admin route, a real agent program from
the package index run with the environment Gyre gives a harness (docs/recipes/openai_agent.py, on
the openai SDK), the execution ended over the new admin route, and its shard read back with the
roles the harness labelled.

The engine is the scripted stand-in (tests/support/scripted_engine.py: the outputs are chosen); everything
else is what a user runs. The three recipes as a run starts them
(`harness.command` as written, under the default sandbox, scored), litellm's compactor label and
mini-swe-agent's shell commands included: tests/harness/test_recipes_sandboxed.py (each litellm
import costs ~5 s of CPU, so the two litellm recipes run there only)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from gyre.proxy.routes import start_site
from gyre.traj.store import read_shard
from support.loop_thread import LoopThread
from support.scripted_engine import ScriptedEngine
from support.proxy_stack import R

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "docs" / "recipes"
ADMIN = "recipe-admin-key"


def say(text: str) -> list[int]:
    return R.encode(text) + [R.im_end]


def admin(url: str, body: dict | None = None) -> dict:
    req = urllib.request.Request(url, data=json.dumps(body or {}).encode(), method="POST",
                                 headers={"Authorization": f"Bearer {ADMIN}", "Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=30) as r:
        return json.loads(r.read())


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """The scripted engine on loopback and `gyre proxy` in front of it, as docs/harnesses.md starts it."""
    lt = LoopThread()
    engine = ScriptedEngine(decode=R.decode)
    engine.script = [say("ok")]
    runner, port = lt.run(start_site(engine.app(), "127.0.0.1", 0))
    shards = tmp_path_factory.mktemp("shards")
    proc = subprocess.Popen([sys.executable, "-m", "gyre.cli", "proxy", "--engine", f"http://127.0.0.1:{port}",
                             "--host", "127.0.0.1", "--port", "0", "--admin-key", ADMIN, "--shard-dir", str(shards)],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    printed = []
    for line in proc.stdout:
        printed.append(line)
        if line.startswith("  (docs/harnesses.md)"):
            break
    base = next(x.split()[1] for x in printed if x.startswith("GYRE_PROXY_LISTENING"))
    yield {"engine": engine, "base": base, "printed": "".join(printed), "shards": shards}
    proc.terminate()
    proc.wait(10)
    lt.run(runner.cleanup())
    lt.close()


def run_recipe(served, tmp_path, name: str, eid: str, outputs: list[str]) -> tuple[list, Path]:
    """Register `eid`, run docs/recipes/<name> as Gyre runs a harness, end it; (its calls, workspace)."""
    served["engine"].script = [say(o) for o in outputs]
    key = admin(served["base"] + "/gyre/executions", {"execution_id": eid, "task": "hello"})["api_key"]
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "start.md").write_text("Create hello.txt containing the word hello.")
    env = {**os.environ, "OPENAI_BASE_URL": served["base"] + "/v1", "OPENAI_API_KEY": key,
           "GYRE_WORKSPACE": str(ws), "GYRE_TASK_DIR": str(ws), "GYRE_EXECUTION_ID": eid,
           "HOME": str(tmp_path)}
    r = subprocess.run([sys.executable, str(RECIPES / name)], cwd=ws, env=env, capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    ended = admin(f"{served['base']}/gyre/executions/{eid}/end", {"status": "done", "reward": 1.0})
    assert ended["execution_id"] == eid and ended["status"] == "done" and Path(ended["shard"]).parent == served["shards"]
    (rec,) = read_shard(ended["shard"])
    assert rec.execution_id == eid and rec.reward == 1.0 and ended["calls"] == len(rec.tree.calls)
    return rec.tree.calls, ws


def test_the_proxy_prints_its_base_url_and_how_to_register(served):
    assert f"OpenAI base URL {served['base']}/v1" in served["printed"]
    assert "/gyre/executions" in served["printed"] and "/end" in served["printed"]


def test_openai_sdk_recipe_labels_main_and_a_subagent(served, tmp_path):
    calls, ws = run_recipe(served, tmp_path, "openai_agent.py", "openai-1", ["draft", "looks fine", "final answer"])
    assert [c.agent_role for c in calls] == ["main", "subagent:reviewer", "main"]
    assert (ws / "answer.md").read_text() == "final answer"


def test_ending_an_unknown_or_badly_described_execution_is_a_clear_error(served):
    for eid, body, want in (("nope", {}, "no running execution 'nope'"),
                            ("nope", {"status": "great"}, "status: 'great' is not one of")):
        with pytest.raises(urllib.error.HTTPError) as e:
            admin(f"{served['base']}/gyre/executions/{eid}/end", body)
        assert want in json.loads(e.value.read())["error"]["message"]
