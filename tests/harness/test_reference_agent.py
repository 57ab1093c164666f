"""The reference harness, run as a separate process against a scripted OpenAI-compatible server."""

import asyncio
import copy
import json
import random
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from support.loop_thread import ServedApp

from gyre.harness.reference_agent import EXPLORER_SYSTEM, MAIN_SYSTEM
from gyre.harness.tasks import BUILTIN_DIR, load_suite

FIZZBUZZ = (Path(BUILTIN_DIR).parent / "builtin_solutions" / "fizzbuzz" / "fizzbuzz.py").read_text()


class ScriptedServer(ServedApp):
    """Serves /v1/chat/completions from per-model scripts (a list of assistant messages, or a
    function of the request) and records every request with its headers."""

    def __init__(self, scripts: dict):
        self.scripts = {k: (list(v) if isinstance(v, list) else v) for k, v in scripts.items()}
        self.requests: list[dict] = []
        self.served: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"auth": request.headers.get("Authorization"), **body})
        script = self.scripts.get(body["model"])
        if script is None:
            return web.json_response({"error": {"message": "unknown model"}}, status=404)
        if callable(script):
            message = script(body)
        elif script:
            message = script.pop(0)
        else:
            message = {"role": "assistant", "content": "FINAL ANSWER: out of script"}
        self.served.append(copy.deepcopy(message))
        return web.json_response({"id": f"c{len(self.served)}", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": message,
                                               "finish_reason": "tool_calls" if message.get("tool_calls") else "stop"}]})

    def routes(self, app) -> None:
        app.router.add_post("/v1/chat/completions", self.handle)

    def models(self):
        return [r["model"] for r in self.requests]


def call(name, i, **args):
    return {"id": f"call_{name}_{i}", "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


def assistant(*calls, content=None, **extra):
    return {"role": "assistant", "content": content, "tool_calls": list(calls), **extra}


def run_agent(server, ws: Path, *flags, key="test-key", timeout=60):
    env = {"OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": key, "GYRE_WORKSPACE": str(ws), "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "gyre.harness.reference_agent", *flags], cwd=ws, env=env,
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    (d / "start.md").write_text("Implement calc.py with add(a, b) and a package pkg with util.py.\n" * 10)
    (tmp_path / "outside.txt").write_text("secret")
    return d


def test_scripted_tool_calls(ws):
    big = "# padding so that the conversation passes the compaction limit\n" * 60
    main = [
        assistant(call("write_file", 1, path="calc.py", content="def add(a, b):\n    return a + b\n"),
                  content="Writing calc.py.", refusal=None, reasoning_content="plan: write the file first"),
        assistant(call("explore", 2, question="What exists?")),
        assistant(call("bash", 3, command=f"{sys.executable} -c 'import calc; print(calc.add(2, 3))'"),
                  call("read_file", 4, path="../outside.txt")),
        assistant(call("write_file", 5, path="notes.md", content=big)),
        # after the compaction: plain content with a file block, then finish
        {"role": "assistant", "content": "Here it is:\n```python\n# file: pkg/util.py\nVALUE = 42\n```\n"},
        assistant(call("finish", 6, summary="done")),
    ]
    explorer = [assistant(call("bash", 7, command="ls")),
                {"role": "assistant", "content": "calc.py exists; pkg/util.py is missing."}]
    compactor = [{"role": "assistant", "content": "SUMMARY: calc.py written, pkg/util.py missing."}]
    with ScriptedServer({"main": main, "subagent:explorer": explorer, "compactor": compactor}) as srv:
        proc = run_agent(srv, ws, "--compact-chars", "4000", "--subagent-turn", "99")
    assert proc.returncode == 0, proc.stderr
    reqs = srv.requests
    assert all(r["auth"] == "Bearer test-key" for r in reqs)
    assert srv.models() == ["main", "main", "subagent:explorer", "subagent:explorer", "main", "main",
                            "compactor", "main", "main"]
    assert all(r["tools"] for r in reqs)
    assert {t["function"]["name"] for t in reqs[0]["tools"]} == {"bash", "write_file", "read_file", "explore", "finish"}
    assert {t["function"]["name"] for t in reqs[2]["tools"]} == {"bash", "read_file"}

    # Files: by tool and by a fenced block; nothing outside the workspace is readable.
    assert (ws / "calc.py").read_text().startswith("def add") and (ws / "pkg" / "util.py").read_text() == "VALUE = 42\n"
    main_reqs = [r for r in reqs if r["model"] == "main"]
    tool_results = {m["tool_call_id"]: m["content"] for r in reqs for m in r["messages"] if m["role"] == "tool"}
    assert "5" in tool_results["call_bash_3"].splitlines()[1]
    assert "outside" in tool_results["call_read_file_4"] and "secret" not in tool_results["call_read_file_4"]

    # The sub-agent: its own system prompt; its final answer is the explore call's tool result.
    sub = [r for r in reqs if r["model"] == "subagent:explorer"]
    assert sub[0]["messages"][0] == {"role": "system", "content": EXPLORER_SYSTEM}
    assert "What exists?" in sub[0]["messages"][1]["content"]
    assert tool_results["call_explore_2"] == "calc.py exists; pkg/util.py is missing."
    assert sub[1]["messages"][2] == srv.served[2]  # the explorer replays its own message too

    # Replay: every assistant message sent back is exactly one the server gave (extra keys too).
    served = [json.dumps(m, sort_keys=True) for m in srv.served]
    for r in reqs:
        for m in r["messages"]:
            if m["role"] == "assistant":
                assert json.dumps(m, sort_keys=True) in served, m
    assert main_reqs[1]["messages"][2] == srv.served[0]
    assert main_reqs[1]["messages"][2]["reasoning_content"] == "plan: write the file first"

    # Compaction: the compactor sees the main conversation plus a request; main restarts from
    # system + task + summary.
    comp = reqs[6]
    before = reqs[5]["messages"]
    assert comp["messages"][:len(before)] == before
    assert comp["messages"][-1]["role"] == "user" and "Summarise" in comp["messages"][-1]["content"]
    after = reqs[7]["messages"]
    assert after[0] == {"role": "system", "content": MAIN_SYSTEM}
    assert after[1] == {"role": "user", "content": (ws / "start.md").read_text()}
    assert len(after) == 3 and "SUMMARY: calc.py written" in after[2]["content"]
    # The file block got an answer in a user message, not a nudge.
    last = reqs[8]["messages"]
    assert last[-1]["role"] == "user" and "pkg/util.py" in last[-1]["content"] and "No tool" not in last[-1]["content"]


def test_a_model_that_never_calls_tools_still_branches(ws):
    rng = random.Random(0)

    def babble(body):
        words = "".join(rng.choice("abcdefgh ij\n") for _ in range(rng.randint(50, 1500)))
        return {"role": "assistant", "content": words}

    scripts = {m: babble for m in ("main", "subagent:explorer", "compactor")}
    with ScriptedServer(scripts) as srv:
        proc = run_agent(srv, ws)  # the default limits
    assert proc.returncode == 0, proc.stderr
    models = srv.models()
    first_sub, first_comp = models.index("subagent:explorer"), models.index("compactor")
    assert models[:first_sub].count("main") <= 3 and models[:first_comp].count("main") <= 5
    assert models.count("main") == 10  # the default turn limit
    nudges = [m for m in srv.requests[1]["messages"] if m["role"] == "user" and "No tool was called" in m["content"]]
    assert nudges
    after = srv.requests[first_comp + 1]
    assert after["model"] == "main" and len(after["messages"]) == 3


def test_no_subagent_flag_and_final_answer(ws):
    script = [{"role": "assistant", "content": "thinking"}, {"role": "assistant", "content": "thinking more"},
              {"role": "assistant", "content": "All good.\nFINAL ANSWER: done"}]
    with ScriptedServer({"main": script}) as srv:
        proc = run_agent(srv, ws, "--no-subagent")
    assert proc.returncode == 0, proc.stderr
    assert srv.models() == ["main"] * 3


def test_rejected_key_exits_nonzero(ws):
    with ScriptedServer({}) as srv:  # every model unknown: 404
        proc = run_agent(srv, ws)
    assert proc.returncode == 3 and "HTTP 404" in proc.stderr


def test_through_the_runner_and_the_evaluator(tmp_path):
    """The whole path: runner environment -> agent -> workspace -> evaluator score."""
    from gyre.harness.evaluator import EvalOptions, evaluate_workspace
    from gyre.harness.runner import HarnessPool, Limits

    task = {t.name: t for t in load_suite("builtin")}["fizzbuzz"]
    main = [{"role": "assistant", "content": f"```python\n# file: fizzbuzz.py\n{FIZZBUZZ}```"},
            assistant(call("finish", 1, summary="done"))]
    with ScriptedServer({"main": main}) as srv:
        pool = HarnessPool(tmp_path / "run", ["{python}", "-m", "gyre.harness.reference_agent", "--no-subagent"],
                           limits=Limits(timeout_s=60))
        res = asyncio.run(pool.run_execution(task, "fb-0", api_key="exec-key", base_url=srv.url))
    assert res.status == "done", Path(res.log_dir, "harness.stderr").read_text()
    assert {r["auth"] for r in srv.requests} == {"Bearer exec-key"}
    ev = evaluate_workspace(task, res.workspace, res.status, EvalOptions(scratch_dir=str(tmp_path / "s")))
    assert (ev.reward, ev.source) == (1.0, "tests")


def test_tool_limits(ws, tmp_path):
    main = [assistant(call("bash", 1, command="head -c 500000 /dev/zero | tr '\\0' x; echo END"),
                      call("bash", 2, command="sleep 100 & sleep 100"),
                      call("write_file", 3, path=str(tmp_path / "abs_outside.txt"), content="x"),
                      call("write_file", 4, path="link/inside.txt", content="x"),
                      {"id": "call_bad_5", "type": "function", "function": {"name": "bash", "arguments": "{not json"}},
                      call("rm_rf", 6)),
            assistant(call("finish", 7, summary="done"))]
    (ws / "link").symlink_to(tmp_path)
    with ScriptedServer({"main": main}) as srv:
        # call 2 waits the whole limit, call 1 must finish inside it on a loaded machine: its 500 kB
        # (still 60 times the output cap) take milliseconds, so 2 s (at 1 s a 5 MB pipe was killed
        # once beside three CPU-heavy neighbours; 5 s was then waited by every run)
        proc = run_agent(srv, ws, "--tool-timeout", "2", "--no-subagent", timeout=60)
    assert proc.returncode == 0, proc.stderr
    results = {m["tool_call_id"]: m["content"] for m in srv.requests[1]["messages"] if m["role"] == "tool"}
    big = results["call_bash_1"]
    assert len(big) < 9000 and big.startswith("exit status 0") and big.rstrip().endswith("END")
    assert results["call_bash_2"].startswith("killed after 2s")
    assert "outside" in results["call_write_file_3"] and not (tmp_path / "abs_outside.txt").exists()
    assert "outside" in results["call_write_file_4"] and not (tmp_path / "inside.txt").exists()
    assert "not a valid JSON object" in results["call_bad_5"]
    assert "unknown tool 'rm_rf'" in results["call_rm_rf_6"]
