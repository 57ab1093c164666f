"""Gyre's reference harness: a coding agent in miniature, run as its own process.

    python -m gyre.harness.reference_agent [--max-turns N] [--compact-chars N] [--no-subagent] ...

It plays an unmodified black-box agent, so it uses only the standard library and the OpenAI HTTP
contract: POST $OPENAI_BASE_URL/chat/completions with ``Authorization: Bearer $OPENAI_API_KEY``,
``model``, ``messages`` and ``tools``. The model name names the agent role: ``main``,
``subagent:explorer`` and ``compactor``.

Shape of a run (the branching real agents produce, even with a model that never calls a tool):
- the main agent reads start.md from its workspace and loops: model call, tools, results;
- tools: ``bash``, ``write_file``, ``read_file`` (confined to the workspace, with time and size
  limits), ``explore`` (a sub-agent with its own system prompt whose final answer comes back as
  the tool result) and ``finish``; when by turn ``--subagent-turn`` the model has not explored,
  the agent runs the explorer itself and hands its report over in the next user message;
- a reply without tool calls is searched for ```python blocks whose first line is ``# file: PATH``
  (written to the workspace); otherwise the agent nudges, repeating the task;
- when the conversation grows ``--compact-chars`` characters past system prompt and task, the
  conversation plus a summarise request goes to the model as ``compactor``; the main conversation
  restarts from system prompt, task and summary;
- ``finish``, a line starting with "FINAL ANSWER", or the turn limit ends the run (exit 0).
Assistant messages are sent back exactly as they were received.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

MAIN_SYSTEM = (
    "You are a coding agent. You work in a repository folder and must implement what the task "
    "(start.md) asks, so that its hidden tests pass. Use the tools: bash to run shell commands in "
    "the repository, write_file and read_file for files, explore to have a sub-agent survey the "
    "repository, finish when the work is done. You may also answer with fenced ```python blocks "
    "whose first line is `# file: PATH`; each is written to PATH."
)
EXPLORER_SYSTEM = (
    "You are an explorer sub-agent. Survey the repository with bash and read_file and answer the "
    "question you are given in a few lines: which files exist, what is missing, what to do next. "
    "Do not modify files. Your final answer is a plain message without tool calls."
)
COMPACT_REQUEST = (
    "The conversation is getting long. Summarise the work so far for yourself: what the task "
    "requires, which files were written, what works, what remains. Reply with the summary only."
)
EXPLORE_QUESTION = "Which files does the task need, which of them exist already, and what is left to do?"


def _fn(name, description, **params):
    return {"type": "function", "function": {
        "name": name, "description": description,
        "parameters": {"type": "object", "required": list(params),
                       "properties": {k: {"type": "string", "description": v} for k, v in params.items()}}}}


TOOLS = {
    "bash": _fn("bash", "Run a shell command in the repository folder.", command="the command"),
    "write_file": _fn("write_file", "Write a file (relative to the repository).", path="file path",
                      content="the whole new content"),
    "read_file": _fn("read_file", "Read a file (relative to the repository).", path="file path"),
    "explore": _fn("explore", "Ask an explorer sub-agent to survey the repository.", question="what to find out"),
    "finish": _fn("finish", "End the work.", summary="what was done"),
}
MAIN_TOOLS = [TOOLS[n] for n in ("bash", "write_file", "read_file", "explore", "finish")]
EXPLORER_TOOLS = [TOOLS[n] for n in ("bash", "read_file")]

_FILE_BLOCK = re.compile(r"```(?:python|py)?[ \t]*\n[ \t]*#[ \t]*file:[ \t]*(\S+)[ \t]*\n(.*?)```", re.S)
_FINAL = re.compile(r"^\s*FINAL ANSWER\b", re.I | re.M)


class ApiError(Exception):
    def __init__(self, status: int | None, message: str):
        super().__init__(f"HTTP {status}: {message}" if status else message)
        self.status = status


def log(msg: str) -> None:
    print(f"[reference-agent {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def cap(text: str, limit: int) -> str:
    """Head and tail of a long text, so that errors at the end of an output are kept."""
    if len(text) <= limit:
        return text
    half = limit // 2
    return f"{text[:half]}\n... [{len(text) - 2 * half} characters cut] ...\n{text[-half:]}"


class Client:
    def __init__(self, base_url: str, api_key: str, timeout_s: float, max_tokens: int | None, retries: int = 3):
        self.url = base_url.rstrip("/") + "/chat/completions"
        self.api_key, self.timeout_s, self.max_tokens, self.retries = api_key, timeout_s, max_tokens, retries
        self.calls = 0

    def chat(self, model: str, messages: list, tools: list) -> dict:
        body = {"model": model, "messages": messages, "tools": tools}
        if self.max_tokens:
            body["max_tokens"] = self.max_tokens
        data = json.dumps(body).encode()
        for attempt in range(self.retries + 1):
            req = urllib.request.Request(self.url, data=data, method="POST", headers={
                "Content-Type": "application/json", "Authorization": f"Bearer {self.api_key}"})
            try:
                with urllib.request.urlopen(req, timeout=self.timeout_s) as resp:
                    answer = json.loads(resp.read(64 << 20))
                self.calls += 1
                return answer["choices"][0]["message"]
            except urllib.error.HTTPError as e:
                detail = e.read(2000).decode("utf-8", "replace")
                if e.code not in (429, 500, 502, 503, 504) or attempt == self.retries:
                    raise ApiError(e.code, detail) from None
            except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
                if attempt == self.retries:
                    raise ApiError(None, f"cannot reach {self.url}: {e}") from None
            except (ValueError, KeyError, IndexError, TypeError) as e:
                raise ApiError(None, f"malformed answer: {e}") from None
            time.sleep(min(2 ** attempt, 10))
        raise AssertionError("unreachable")


class Workspace:
    """The tools. Paths are confined to the workspace; bash runs there with a time limit (it is
    not a sandbox: the runner's limits and process group are what contain it)."""

    def __init__(self, root: Path, tool_timeout_s: float, max_output: int):
        self.root = root.resolve()
        self.tool_timeout_s, self.max_output = tool_timeout_s, max_output

    def path(self, rel: str) -> Path:
        if not isinstance(rel, str) or not rel.strip():
            raise ValueError("a path is required")
        p = (self.root / rel.strip()).resolve()
        if not p.is_relative_to(self.root):
            raise ValueError(f"{rel!r} is outside the repository")
        return p

    def bash(self, command: str) -> str:
        shell = "/bin/bash" if os.path.exists("/bin/bash") else "/bin/sh"
        with tempfile.TemporaryFile() as out:  # a file, not a pipe: output size cannot fill memory
            p = subprocess.Popen([shell, "-c", command], cwd=self.root, stdin=subprocess.DEVNULL,
                                 stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
            try:
                status = f"exit status {p.wait(timeout=self.tool_timeout_s)}"
            except subprocess.TimeoutExpired:
                status = f"killed after {self.tool_timeout_s:g}s"
            try:
                os.killpg(p.pid, 9)  # the command's leftovers too
            except (ProcessLookupError, PermissionError):
                pass
            p.wait()
            size = out.tell()
            out.seek(max(0, size - 4 * self.max_output))
            text = out.read().decode("utf-8", "replace")
        return f"{status}\n{cap(text, self.max_output)}"

    def write_file(self, path: str, content: str) -> str:
        p = self.path(path)
        if not isinstance(content, str):
            raise ValueError("content must be a string")
        if len(content) > (1 << 20):
            raise ValueError("content larger than 1 MiB")
        p.parent.mkdir(parents=True, exist_ok=True)
        p.write_text(content, encoding="utf-8")
        return f"wrote {len(content)} characters to {p.relative_to(self.root)}"

    def read_file(self, path: str) -> str:
        p = self.path(path)
        if not p.is_file():
            raise ValueError(f"{path} is not a file")
        with open(p, "rb") as f:
            data = f.read(4 * self.max_output)
        return cap(data.decode("utf-8", "replace"), self.max_output)

    def listing(self, limit: int = 60) -> str:
        files = []
        for dirpath, dirnames, filenames in os.walk(self.root):
            dirnames[:] = sorted(d for d in dirnames if not d.startswith(".") and d != "__pycache__")
            files += [str((Path(dirpath) / f).relative_to(self.root)) for f in sorted(filenames)]
            if len(files) > limit:
                break
        return "\n".join(files[:limit]) or "(empty)"


class Agent:
    def __init__(self, args: argparse.Namespace, client: Client, ws: Workspace, task: str):
        self.a, self.client, self.ws, self.task = args, client, ws, task
        self.explorers = 0
        self.compactions = 0

    # -- tools ------------------------------------------------------------------------------------
    def call_tool(self, call: dict, allowed: set[str]) -> tuple[str, bool]:
        """(result text, whether it was `finish`)."""
        fn = call.get("function") or {}
        name = fn.get("name")
        if name not in allowed:
            return f"error: unknown tool {name!r}; available: {', '.join(sorted(allowed))}", False
        try:
            args = json.loads(fn.get("arguments") or "{}")
            if not isinstance(args, dict):
                raise ValueError("arguments must be a JSON object")
        except ValueError as e:
            return f"error: arguments are not a valid JSON object: {e}", False
        try:
            if name == "finish":
                return "finished", True
            if name == "explore":
                if not self.a.subagent:
                    return "error: sub-agents are disabled in this run", False
                return self.explore(str(args.get("question") or EXPLORE_QUESTION)), False
            if name == "bash":
                return self.ws.bash(str(args.get("command", ""))), False
            if name == "write_file":
                return self.ws.write_file(args.get("path"), args.get("content", "")), False
            return self.ws.read_file(args.get("path")), False
        except (ValueError, OSError) as e:
            return f"error: {e}", False

    def write_blocks(self, content: str) -> list[str]:
        notes = []
        for path, body in _FILE_BLOCK.findall(content):
            try:
                notes.append(self.ws.write_file(path, body))
            except (ValueError, OSError) as e:
                notes.append(f"could not write {path}: {e}")
        return notes

    # -- the sub-agent ----------------------------------------------------------------------------
    def explore(self, question: str) -> str:
        self.explorers += 1
        model = f"subagent:{self.a.subagent_name}"
        log(f"explorer #{self.explorers}: {question[:80]!r}")
        messages = [{"role": "system", "content": EXPLORER_SYSTEM},
                    {"role": "user", "content": f"{question}\n\nFiles in the repository:\n{self.ws.listing()}"
                                                f"\n\nThe task (start):\n{self.task[:self.a.reminder_chars]}"}]
        answer = ""
        for _ in range(self.a.subagent_max_turns):
            try:
                msg = self.client.chat(model, messages, EXPLORER_TOOLS)
            except ApiError as e:
                if e.status is None or e.status in (401, 403):
                    raise
                return f"(the explorer failed: {cap(str(e), 500)})"
            messages.append(msg)
            answer = msg.get("content") or answer
            calls = msg.get("tool_calls") or []
            if not calls:
                break
            for call in calls:
                result, _ = self.call_tool(call, {"bash", "read_file"})
                messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
        return cap(answer.strip(), 4000) or "(the explorer gave no answer)"

    # -- compaction -------------------------------------------------------------------------------
    def start(self, summary: str | None = None) -> list:
        messages = [{"role": "system", "content": MAIN_SYSTEM}, {"role": "user", "content": self.task}]
        if summary is not None:
            messages.append({"role": "user", "content": "The conversation was compacted. Summary of the work so "
                                                        f"far:\n{summary}\n\nFiles in the repository:\n"
                                                        f"{self.ws.listing()}\n\nContinue the task."})
        return messages

    def compact(self, messages: list) -> list:
        self.compactions += 1
        log(f"compaction #{self.compactions} at {size(messages)} characters")
        summary = ""
        try:  # same messages and tools as the main path: the compactor call branches off it
            msg = self.client.chat("compactor", messages + [{"role": "user", "content": COMPACT_REQUEST}], MAIN_TOOLS)
            summary = (msg.get("content") or "").strip()
        except ApiError as e:
            if e.status is None or e.status in (401, 403):
                raise
            log(f"compactor failed ({e}); summarising locally")
        return self.start(cap(summary, 4000) or "(no summary was produced)")

    # -- the main loop ----------------------------------------------------------------------------
    def run(self) -> str:
        messages = self.start()
        base = size(messages)  # the limit counts growth: a long task alone must not force compaction
        for turn in range(1, self.a.max_turns + 1):
            if size(messages) - base > self.a.compact_chars and len(messages) > 3:
                messages = self.compact(messages)
            try:
                msg = self.client.chat(self.a.model, messages, MAIN_TOOLS)
            except ApiError as e:  # a context overflow: compact and go on, as real agents do
                if e.status in (400, 413) and len(messages) > 3:
                    log(f"turn {turn}: {e}; compacting")
                    messages = self.compact(messages)
                    continue
                raise
            messages.append(msg)  # exactly as received
            calls = msg.get("tool_calls") or []
            content = msg.get("content") or ""
            log(f"turn {turn}: {len(calls)} tool calls, {len(content)} characters")
            feedback = []
            if calls:
                finished = False
                for call in calls:
                    result, done = self.call_tool(call, set(TOOLS))
                    finished |= done
                    messages.append({"role": "tool", "tool_call_id": call.get("id", ""), "content": result})
                if finished:
                    return "finish"
            else:
                written = self.write_blocks(content)
                if _FINAL.search(content):
                    return "final answer"
                feedback += written
                if not written:
                    feedback.append("No tool was called. Call a tool (bash, write_file, read_file, explore, "
                                    "finish), or write files as ```python blocks starting with `# file: PATH`."
                                    f"\nThe task, as a reminder:\n{self.task[:self.a.reminder_chars]}")
            if self.a.subagent and self.explorers == 0 and turn >= self.a.subagent_turn:
                feedback.append("An explorer sub-agent surveyed the repository for you:\n"
                                + self.explore(EXPLORE_QUESTION))
            if feedback:
                messages.append({"role": "user", "content": "\n\n".join(feedback)})
        return "turn limit"


def size(messages: list) -> int:
    return sum(len(json.dumps(m, ensure_ascii=False)) for m in messages)


def _env_int(name: str, default: int) -> int:
    try:
        return int(os.environ.get(name, default))
    except ValueError:
        return default


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.reference_agent", description=__doc__.split("\n")[0])
    p.add_argument("--workspace", default=os.environ.get("GYRE_WORKSPACE") or os.getcwd())
    p.add_argument("--task-file", default="start.md", help="relative to the workspace")
    p.add_argument("--model", default="main", help="model name of the main agent")
    p.add_argument("--max-turns", type=int, default=_env_int("GYRE_AGENT_MAX_TURNS", 10))
    p.add_argument("--compact-chars", type=int, default=_env_int("GYRE_AGENT_COMPACT_CHARS", 6000),
                   help="compact when the conversation grows this many characters past system prompt + task")
    p.add_argument("--no-subagent", dest="subagent", action="store_false",
                   default=os.environ.get("GYRE_AGENT_SUBAGENT", "1") not in ("0", "false", "no"))
    p.add_argument("--subagent-name", default="explorer")
    p.add_argument("--subagent-turn", type=int, default=_env_int("GYRE_AGENT_SUBAGENT_TURN", 2),
                   help="run the explorer at the end of this turn if the model has not")
    p.add_argument("--subagent-max-turns", type=int, default=_env_int("GYRE_AGENT_SUBAGENT_MAX_TURNS", 2))
    p.add_argument("--reminder-chars", type=int, default=1500, help="task text repeated in nudges")
    p.add_argument("--max-tokens", type=int, default=_env_int("GYRE_AGENT_MAX_TOKENS", 0) or None)
    p.add_argument("--request-timeout", type=float, default=600.0)
    p.add_argument("--tool-timeout", type=float, default=30.0)
    p.add_argument("--max-output-chars", type=int, default=8000)
    args = p.parse_args(argv)
    for name in ("max_turns", "compact_chars", "subagent_turn", "subagent_max_turns"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be at least 1")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY", "")
    if not base_url:
        log("OPENAI_BASE_URL is not set")
        return 2
    ws = Workspace(Path(args.workspace), args.tool_timeout, args.max_output_chars)
    try:
        with open(ws.path(args.task_file), "rb") as f:
            task = f.read(1 << 20).decode("utf-8", "replace")
    except (ValueError, OSError) as e:
        log(f"cannot read the task: {e}")
        return 2
    client = Client(base_url, api_key, args.request_timeout, args.max_tokens)
    agent = Agent(args, client, ws, task)
    try:
        reason = agent.run()
    except ApiError as e:
        log(f"giving up: {e}")
        return 3
    log(f"done ({reason}): {client.calls} calls, {agent.explorers} explorers, {agent.compactions} compactions")
    return 0


if __name__ == "__main__":
    sys.exit(main())
