"""A minimal harness: ask the model once (or a few times) and write its final answer to a file.

    python -m gyre.harness.answer_agent [--max-tokens 24] [--turns 1] [--model main] [--out answer.txt]

It is a black box like any other harness: a separate process using only the standard library and
the OpenAI HTTP contract (POST $OPENAI_BASE_URL/chat/completions, ``Authorization: Bearer
$OPENAI_API_KEY``). It reads ``start.md`` from its workspace ($GYRE_WORKSPACE, else the current
directory) and sends it as the user message. With ``--turns 2`` (or more) each later turn sends the
conversation so far, the previous assistant messages replayed exactly as they were received, plus
:data:`FOLLOW_UP`. The content of the last assistant message is written to ``answer.txt`` in the
workspace (empty when the model sent no content) and the process exits 0; an API error exits 1
without writing the answer.

The suite ``gyre/harness/builtin_learnable`` scores that file; its learnability check builds the
same conversation with :func:`first_messages` and :func:`follow_up_messages`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

ANSWER_FILE = "answer.txt"
FOLLOW_UP = "Give your final answer now."
RETRY_STATUS = (429, 500, 502, 503, 504)


class ApiError(Exception):
    pass


def first_messages(task: str) -> list[dict]:
    """The first call's conversation: the task as the only (user) message."""
    return [{"role": "user", "content": task}]


def follow_up_messages(messages: list[dict], reply: dict) -> list[dict]:
    """The next call's conversation: ``reply`` replayed exactly as received, then FOLLOW_UP."""
    return [*messages, reply, {"role": "user", "content": FOLLOW_UP}]


def chat(url: str, api_key: str, body: dict, timeout_s: float, retries: int) -> dict:
    """One chat completion; returns the assistant message object exactly as the server sent it."""
    data = json.dumps(body).encode()
    for attempt in range(retries + 1):
        req = urllib.request.Request(url, data=data, method="POST", headers={
            "Content-Type": "application/json", "Authorization": f"Bearer {api_key}"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as resp:
                answer = json.loads(resp.read(64 << 20))
            message = answer["choices"][0]["message"]
            if not isinstance(message, dict):
                raise TypeError("choices[0].message is not an object")
            return message
        except urllib.error.HTTPError as e:
            detail = e.read(2000).decode("utf-8", "replace")
            if e.code not in RETRY_STATUS or attempt == retries:
                raise ApiError(f"HTTP {e.code}: {detail}") from None
        except (urllib.error.URLError, TimeoutError, ConnectionError) as e:
            if attempt == retries:
                raise ApiError(f"cannot reach {url}: {e}") from None
        except (ValueError, KeyError, IndexError, TypeError) as e:
            raise ApiError(f"malformed answer: {e}") from None
        time.sleep(min(2 ** attempt, 10))
    raise AssertionError("unreachable")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.answer_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--max-tokens", type=int, default=24, help="max_tokens of each call (default 24)")
    p.add_argument("--turns", type=int, default=1, help="model calls; later ones replay the earlier answers (default 1)")
    p.add_argument("--model", default="main", help="model name sent (Gyre reads it as the agent role)")
    p.add_argument("--temperature", type=float, default=None, help="sent only when given (the server's default otherwise)")
    p.add_argument("--out", default=ANSWER_FILE, help="answer file, relative to the workspace")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request HTTP timeout")
    p.add_argument("--retries", type=int, default=3, help="retries on 429/5xx and connection errors")
    args = p.parse_args(argv)
    if args.max_tokens < 1 or args.turns < 1:
        p.error("--max-tokens and --turns must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY", "")
    if not base_url:
        print("answer_agent: OPENAI_BASE_URL is not set", file=sys.stderr)
        return 2
    ws = Path(os.environ.get("GYRE_WORKSPACE") or os.getcwd())
    try:
        task = (ws / "start.md").read_text(encoding="utf-8")
    except OSError as e:
        print(f"answer_agent: cannot read the task: {e}", file=sys.stderr)
        return 2
    url = base_url.rstrip("/") + "/chat/completions"
    messages = first_messages(task)
    reply: dict = {}
    try:
        for turn in range(args.turns):
            if turn:
                messages = follow_up_messages(messages, reply)
            body = {"model": args.model, "messages": messages, "max_tokens": args.max_tokens}
            if args.temperature is not None:
                body["temperature"] = args.temperature
            reply = chat(url, api_key, body, args.timeout_s, args.retries)
    except ApiError as e:
        print(f"answer_agent: {e}", file=sys.stderr)
        return 1
    content = reply.get("content")
    text = content if isinstance(content, str) else ""
    with open(ws / args.out, "w", encoding="utf-8", errors="replace", newline="") as f:
        f.write(text)
    print(f"answer_agent: {args.turns} call(s), wrote {len(text)} characters to {args.out}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
