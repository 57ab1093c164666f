"""The long-tailed benchmark harness: seeded tool times, a fixed number of calls, replayed replies."""

from __future__ import annotations

import math
import os
import statistics
import subprocess
import sys
from pathlib import Path

from aiohttp import web

from support.loop_thread import ServedApp

from gyre.harness.long_tail_agent import TOOL_RESULT, group_key, tool_seconds

ROOT = Path(__file__).resolve().parents[2]


class EchoServer(ServedApp):
    """Answers every chat completion with a numbered reply and records the request bodies."""

    def __init__(self) -> None:
        self.requests: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append(body)
        msg = {"role": "assistant", "content": f"reply {len(self.requests)}"}
        return web.json_response({"id": "c", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": msg, "finish_reason": "length"}]})

    def routes(self, app) -> None:
        app.router.add_post("/v1/chat/completions", self.handle)


def test_tool_seconds_are_seeded_shared_by_group_and_long_tailed():
    args = dict(calls=8, tool_mean_s=1.0, sigma_task=0.3, sigma_exec=0.6, seed=0)
    a = tool_seconds("q1-lt-g0", **args)
    assert a == tool_seconds("q1-lt-g0", **args)  # same id, same seed: same time in every run
    assert a != tool_seconds("q1-lt-g0", **{**args, "seed": 1})
    assert group_key("q12-long_tail-g7") == "q12-long_tail" and group_key("odd") == "odd"
    # no spread: exactly calls x mean
    assert tool_seconds("q1-lt-g0", 8, 1.0, 0.0, 0.0, 0) == 8.0
    # the group factor is shared: with sigma_exec = 0, all members of a group take the same time
    same = {tool_seconds(f"q3-lt-g{k}", 8, 1.0, 0.5, 0.0, 0) for k in range(8)}
    assert len(same) == 1
    xs = [tool_seconds(f"q{g}-lt-g{k}", **args) for g in range(200) for k in range(8)]
    assert all(math.isfinite(x) and x > 0 for x in xs)
    assert abs(statistics.fmean(xs) / 8.0 - 1.0) < 0.1     # mean calls x tool_mean_s (1600 draws)
    assert statistics.median(xs) < statistics.fmean(xs) < max(xs) / 2  # right-skewed, long tail
    logs = [math.log(x) for x in xs]
    assert abs(statistics.pstdev(logs) - math.hypot(0.3, 0.6)) < 0.08


def test_agent_makes_its_calls_and_replays_the_conversation(tmp_path):
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "start.md").write_text("Do the task.")
    with EchoServer() as srv:
        env = {"OPENAI_BASE_URL": srv.url, "OPENAI_API_KEY": "k", "GYRE_WORKSPACE": str(ws),
               "PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT)}
        proc = subprocess.run([sys.executable, "-m", "gyre.harness.long_tail_agent", "--execution-id", "q0-t-g1",
                               "--calls", "3", "--max-tokens", "7", "--tool-mean-s", "0"],
                              cwd=ws, env=env, capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    reqs = srv.requests
    assert len(reqs) == 3 and all(r["max_tokens"] == 7 for r in reqs)
    assert [len(r["messages"]) for r in reqs] == [1, 3, 5]
    last = reqs[-1]["messages"]
    assert last[1] == {"role": "assistant", "content": "reply 1"}  # replayed exactly
    assert last[2]["content"] == TOOL_RESULT.format(i=1)
    assert (ws / "answer.txt").read_text() == "reply 3"


def test_agent_refuses_without_an_execution_id(tmp_path):
    env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "PYTHONPATH": str(ROOT), "OPENAI_BASE_URL": "http://x"}
    proc = subprocess.run([sys.executable, "-m", "gyre.harness.long_tail_agent"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and "--execution-id" in proc.stderr
