"""The harness recipes of docs/harnesses.md run as Gyre runs them: `harness.command` exactly as the
page writes it (`["{python}", "docs/recipes/<recipe>.py"]`, a path relative to where Gyre starts),
under the default sandbox (bubblewrap: `harness.sandbox = "auto"`), through the rollout service
(`gyre rollout`'s and the head's): the real proxy, harness pool, evaluator and shard writer. The
engine is the scripted stand-in (tests/support/scripted_engine.py) so that the model's answers are
chosen: mini-swe-agent's shell commands are real ones that solve the task.

Each test asserts what a run depends on: the execution ended `done` (not failed), every call is
recorded with the agent role the recipe labels, and the workspace was scored by the task's tests.
The last one types the `gyre rollout` command itself (e2e: the embedded engine on the tiny model).
"""

from __future__ import annotations

import asyncio
import math
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from gyre.config import load_config
from gyre.harness.sandbox import Environments, SandboxConfig
from gyre.harness.tasks import BUILTIN_DIR, load_suite
from gyre.proxy.routes import start_site
from gyre.services.rollout import RolloutService
from gyre.traj.record import Status
from gyre.traj.store import iter_executions
from support.proxy_stack import R
from support.scripted_engine import ScriptedEngine

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="bubblewrap is not installed")

ROOT = Path(__file__).resolve().parents[2]
ASSETS = ROOT / "gyre" / "assets"
IDENTITY = {"model_hash": "m" * 8, "tokenizer_hash": "t" * 8}
TASK = {t.name: t for t in load_suite(BUILTIN_DIR)}["fizzbuzz"]


def say(text: str) -> list[int]:
    return R.encode(text) + [R.im_end]


def run_as_documented(tmp_path: Path, monkeypatch, recipe: str, outputs: list[str]):
    """`docs/recipes/<recipe>` as docs/harnesses.md configures it, one execution of fizzbuzz
    through the rollout service under the default sandbox: (its record, as read back from its shard)."""
    monkeypatch.chdir(ROOT)  # `gyre run` / `gyre rollout` started from the repository, as the page says
    cfg = load_config(None, [f"run.dir={tmp_path / 'run'}", f'harness.command=["{{python}}", "docs/recipes/{recipe}"]',
                             "harness.timeout_s=180", "eval.timeout_s=60", "proxy.port=0"])
    assert cfg.harness.sandbox == "auto"  # the default, untouched
    envs = Environments(SandboxConfig.from_config(cfg.harness))
    assert envs.host_backend == "bwrap" and envs.place(TASK).kind == "sandbox"

    async def main():
        engine = ScriptedEngine(decode=R.decode)
        engine.script = [say(o) for o in outputs]
        erunner, port = await start_site(engine.app(), "127.0.0.1", 0)
        service = RolloutService(cfg, envs, ASSETS, IDENTITY, tmp_path / "shards")
        try:
            await service.start([f"http://127.0.0.1:{port}"], engine_key="")
            assert service.pool.own_files == [str(ROOT / "docs" / "recipes" / recipe)]
            return await service.execute(TASK, "fizzbuzz-g0-a0", 0)
        finally:
            await service.close()
            await erunner.cleanup()

    rec = asyncio.run(main())
    logs = tmp_path / "run" / "logs" / "fizzbuzz-g0-a0"
    stderr = (logs / "harness.stderr").read_text() if (logs / "harness.stderr").exists() else ""
    assert rec.status == Status.DONE, (rec.status, rec.error, stderr[-3000:])
    assert rec.reward_source == "tests" and math.isfinite(rec.reward) and rec.total > 0, (rec.reward_source, rec.error)
    (stored,) = [r for r in iter_executions(tmp_path / "shards") if r.execution_id == "fizzbuzz-g0-a0"]
    assert stored.reward == rec.reward and len(stored.tree.calls) == len(rec.tree.calls)
    return stored, Path(rec.workspace)


@pytest.mark.slow  # a sandbox, a harness process and the task's tests: ~3-5 s on a loaded machine
def test_openai_sdk_recipe_runs_as_documented_in_the_default_sandbox(tmp_path, monkeypatch):
    rec, ws = run_as_documented(tmp_path, monkeypatch, "openai_agent.py", ["draft", "looks fine", "final answer"])
    assert [c.agent_role for c in rec.tree.calls] == ["main", "subagent:reviewer", "main"]
    assert (ws / "answer.md").read_text() == "final answer"
    assert rec.reward == 0.0  # scored by fizzbuzz's tests: an answer.md solves nothing


@pytest.mark.slow  # importing litellm takes ~20 s on a loaded 2-core machine
def test_litellm_recipe_runs_as_documented_in_the_default_sandbox(tmp_path, monkeypatch):
    rec, ws = run_as_documented(tmp_path, monkeypatch, "litellm_agent.py", ["step one", "did one", "done"])
    assert [c.agent_role for c in rec.tree.calls] == ["main", "compactor", "main"]
    assert (ws / "answer.md").read_text() == "done"


SOLUTION = '''cat > fizzbuzz.py <<'EOF'
def fizzbuzz(n):
    if n < 1:
        raise ValueError(n)
    return ("Fizz" if n % 3 == 0 else "") + ("Buzz" if n % 5 == 0 else "") or str(n)


def fizzbuzz_range(start, stop):
    return [fizzbuzz(i) for i in range(start, stop)]
EOF'''


@pytest.mark.slow  # mini-swe-agent imports litellm
def test_mini_swe_agent_recipe_solves_the_task_in_the_default_sandbox(tmp_path, monkeypatch):
    pytest.importorskip("minisweagent")
    act = "THOUGHT: {}\n\n```mswea_bash_command\n{}\n```"
    rec, ws = run_as_documented(tmp_path, monkeypatch, "mini_swe_agent.py", [
        act.format("write the module", SOLUTION),
        act.format("submit", "echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT")])
    assert len(rec.tree.calls) == 2 and {c.agent_role for c in rec.tree.calls} == {"main"}
    assert (ws / "fizzbuzz.py").is_file()  # the agent's own shell command ran, in the workspace
    assert rec.reward == 1.0 and rec.passed == rec.total  # and the task's tests say it is solved


@pytest.mark.e2e
@pytest.mark.slow
def test_gyre_rollout_runs_the_openai_recipe_as_written(tmp_path):
    """The command a user types, from the repository, with the page's `harness.command`: the
    embedded engine on the tiny model answers (its text means nothing; the roles are the recipe's)."""
    run_dir = tmp_path / "run"
    r = subprocess.run([sys.executable, "-m", "gyre.cli", "rollout", "--no-progress", f"run.dir={run_dir}",
                        'harness.command=["{python}", "docs/recipes/openai_agent.py"]', 'harness.tasks=["fizzbuzz"]',
                        "harness.group_size=2", "engine.endpoints=1"],
                       cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert "bwrap" in r.stdout  # the summary's sandbox: the default one
    recs = list(iter_executions(run_dir / "shards"))
    assert len(recs) == 2 and {x.status for x in recs} == {Status.DONE}, [(x.status, x.error) for x in recs]
    for rec in recs:
        assert [c.agent_role for c in rec.tree.calls] == ["main", "subagent:reviewer", "main"]
        assert rec.reward_source == "tests" and math.isfinite(rec.reward) and rec.total > 0
        assert (Path(rec.workspace) / "answer.md").is_file()
