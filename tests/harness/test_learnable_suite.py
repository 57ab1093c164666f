"""The learnable suite: it loads, its pytest tests grade answer.txt like scoring.py does, and the
answer_agent harness (a separate process) writes that file from a scripted OpenAI-compatible server."""

import copy
import subprocess
import sys
from pathlib import Path

import pytest
from aiohttp import web

from support.loop_thread import ServedApp

from gyre.harness.answer_agent import FOLLOW_UP
from gyre.harness.builtin_learnable import scoring
from gyre.harness.evaluator import EvalOptions, evaluate_workspace
from gyre.harness.tasks import LEARNABLE_DIR, load_suite

SCORING = Path(scoring.__file__)


@pytest.fixture(scope="module")
def tasks():
    return {t.name: t for t in load_suite("learnable")}


def test_suite_loads(tasks):
    assert sorted(tasks) == sorted(scoring.TASKS)
    assert [t.name for t in load_suite(LEARNABLE_DIR)] == sorted(tasks)
    for t in tasks.values():
        assert t.scorable and t.test_case_count == scoring.LEVELS and t.test_files == ("tests",)
        assert "answer.txt" in t.prompt


def test_shipped_scoring_is_the_package_copy(tasks):
    for t in tasks.values():
        assert (t.tests_dir / "tests" / "answer_scoring.py").read_bytes() == SCORING.read_bytes(), t.name
        assert f'TASK = "{t.name}"' in (t.tests_dir / "tests" / f"test_{t.name}.py").read_text()


def test_scoring_levels():
    r = scoring.reward
    assert r("no_letters", "2024") == r("short_answer", "2024") == 1.0
    assert r("no_letters", "only letters here") == 0.0
    assert r("no_letters", "a" * 9 + "1") == 0.4  # 1/10 non-letters: levels 1..4 (i/40 <= 0.1)
    assert r("no_letters", " \n\t") == r("short_answer", " \n\t") == r("short_answer", "") == 0.0
    assert r("short_answer", " " + "x" * 101 + "\n") == 0.3  # 101 chars: levels with 140 - 13i >= 101
    assert r("short_answer", "x" * 128) == 0.0
    # the thresholds sit where the untrained tiny model answers (24 tokens, ~110 chars, ~4% symbols)
    assert 0 < r("short_answer", "x" * 110) < 0.5 and 0 < r("no_letters", "x" * 24 + "!") < 0.5


def _score(task, tmp_path, name, answer: str | None):
    ws = tmp_path / name
    ws.mkdir()
    if answer is not None:
        (ws / "answer.txt").write_bytes(answer.encode())
    return evaluate_workspace(task, ws, "done", EvalOptions(timeout_s=60))


def test_evaluator_grades_answers(tasks, tmp_path):
    digits = _score(tasks["no_letters"], tmp_path, "digits", "12345 678\n")
    letters = _score(tasks["no_letters"], tmp_path, "letters", "hello world\n")
    mixed_text = "abcdefghi1 xyz 42"  # 3 of 15 non-whitespace characters are digits: levels 1..8
    mixed = _score(tasks["no_letters"], tmp_path, "mixed", mixed_text)
    assert (digits.reward, digits.passed, digits.total, digits.source) == (1.0, 10, 10, "tests"), digits
    assert (letters.reward, letters.passed) == (0.0, 0), letters
    assert mixed.reward == scoring.reward("no_letters", mixed_text) == 0.8, mixed
    long_text = "ab\r\n" * 25  # 98 characters once stripped: \r\n counts 2 (read as written, not translated)
    short = _score(tasks["short_answer"], tmp_path, "short", long_text)
    assert short.reward == scoring.reward("short_answer", long_text) == 0.3, short
    missing = _score(tasks["short_answer"], tmp_path, "missing", None)
    assert (missing.reward, missing.passed) == (0.0, 0), missing


class ScriptedServer(ServedApp):
    """POST /v1/chat/completions answers the scripted assistant messages in order."""

    def __init__(self, script: list, status: int = 200):
        self.script, self.status = list(script), status
        self.requests: list[dict] = []
        self.served: list[dict] = []

    async def handle(self, request: web.Request) -> web.Response:
        body = await request.json()
        self.requests.append({"auth": request.headers.get("Authorization"), **body})
        if self.status != 200:
            return web.json_response({"error": {"message": "bad request"}}, status=self.status)
        message = self.script.pop(0)
        self.served.append(copy.deepcopy(message))
        return web.json_response({"id": f"c{len(self.served)}", "object": "chat.completion", "model": body["model"],
                                  "choices": [{"index": 0, "message": message, "finish_reason": "stop"}]})

    def routes(self, app) -> None:
        app.router.add_post("/v1/chat/completions", self.handle)


def run_agent(server, ws: Path, *flags):
    env = {"OPENAI_BASE_URL": server.url, "OPENAI_API_KEY": "exec-key", "GYRE_WORKSPACE": str(ws),
           "PATH": "/usr/bin:/bin"}
    return subprocess.run([sys.executable, "-m", "gyre.harness.answer_agent", *flags], cwd=ws.parent, env=env,
                          capture_output=True, text=True, timeout=60)


@pytest.fixture
def ws(tmp_path):
    d = tmp_path / "ws"
    d.mkdir()
    (d / "start.md").write_text("## Task\n\nReply with digits only.\n")
    return d


def test_answer_agent_one_turn(ws):
    with ScriptedServer([{"role": "assistant", "content": "  42\r\n"}]) as srv:
        proc = run_agent(srv, ws)
    assert proc.returncode == 0, proc.stderr
    [req] = srv.requests
    assert req["auth"] == "Bearer exec-key" and req["model"] == "main" and req["max_tokens"] == 24
    assert req["messages"] == [{"role": "user", "content": "## Task\n\nReply with digits only.\n"}]
    assert "temperature" not in req
    assert (ws / "answer.txt").read_bytes() == "  42\r\n".encode()  # exactly the content, no translation


def test_answer_agent_replays_its_first_answer_exactly(ws):
    first = {"role": "assistant", "content": " 7\r\n½ <think>é\t", "refusal": None,
             "reasoning_content": "kept as received"}
    second = {"role": "assistant", "content": "7"}
    with ScriptedServer([first, second]) as srv:
        proc = run_agent(srv, ws, "--turns", "2", "--max-tokens", "5")
    assert proc.returncode == 0, proc.stderr
    r1, r2 = srv.requests
    assert r1["max_tokens"] == r2["max_tokens"] == 5
    assert r2["messages"][0] == r1["messages"][0]
    assert r2["messages"][1] == srv.served[0] == first  # replayed exactly, extra keys included
    assert r2["messages"][2] == {"role": "user", "content": FOLLOW_UP}
    assert len(r2["messages"]) == 3
    assert (ws / "answer.txt").read_text() == "7"  # the last assistant message is the answer


def test_answer_agent_null_content_and_api_error(ws):
    with ScriptedServer([{"role": "assistant", "content": None}]) as srv:
        proc = run_agent(srv, ws)
    assert proc.returncode == 0, proc.stderr
    assert (ws / "answer.txt").read_bytes() == b""
    (ws / "answer.txt").unlink()
    with ScriptedServer([], status=400) as srv:
        proc = run_agent(srv, ws)
    assert proc.returncode == 1 and "HTTP 400" in proc.stderr
    assert len(srv.requests) == 1 and not (ws / "answer.txt").exists()
