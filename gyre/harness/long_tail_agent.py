"""A benchmark harness with long-tailed tool time: a fixed number of calls, seeded lognormal tool
sleeps between them.

    python -m gyre.harness.long_tail_agent --execution-id ID [--calls 8] [--max-tokens 32]
        [--tool-mean-s 1.0] [--sigma-task 0.3] [--sigma-exec 0.6] [--seed 0]

It stands for an agent whose environment (tests, installs, builds) takes most of an execution and
whose slowest member sets a group's end: the shape of the paper's NL2RepoBench profile, scaled to
seconds. Each call asks for ``--max-tokens`` output tokens with the conversation so far (earlier
replies replayed exactly, so the proxy's token reuse and the engine's prefix cache work as for a
real agent), then the harness "runs a tool": it sleeps ``tool_s / calls`` seconds and appends a
short tool result. After the last call (and its tool time) it writes the last reply's content to
``answer.txt`` and exits 0.

An execution's tool time is a two-level lognormal with mean ``calls x tool_mean_s``:
``tool_s = calls x tool_mean_s x exp(sigma_task z_task + sigma_exec z_exec - (sigma_task^2 +
sigma_exec^2) / 2)``, ``z_task`` shared by a group (the id's ``q<group>-<task>`` prefix: Gyre's head
names executions ``q<group>-<task>-g<k>``), ``z_exec`` its own; both seeded from ``--seed`` and the
id, so a group is the same in every run (and every scheme) of a benchmark. :func:`tool_seconds` is
the one formula (a benchmark's simulation reads the same numbers).

Standard library only; the OpenAI HTTP contract through :func:`gyre.harness.answer_agent.chat`.
"""

from __future__ import annotations

import argparse
import math
import os
import random
import sys
import time
from pathlib import Path

from gyre.harness.answer_agent import ANSWER_FILE, ApiError, chat

TOOL_RESULT = "Tool output for step {i}: the command finished; continue with the next step."


def group_key(execution_id: str) -> str:
    """The group part of an execution id (``q3-task-g5`` -> ``q3-task``); the id itself otherwise."""
    head, sep, tail = execution_id.rpartition("-g")
    return head if sep and tail.isdigit() else execution_id


def tool_seconds(execution_id: str, calls: int, tool_mean_s: float, sigma_task: float, sigma_exec: float,
                 seed: int) -> float:
    """Total tool seconds of one execution (see the module doc); deterministic in its arguments."""
    z_task = random.Random(f"{seed}:task:{group_key(execution_id)}").gauss(0.0, 1.0)
    z_exec = random.Random(f"{seed}:exec:{execution_id}").gauss(0.0, 1.0)
    log_factor = sigma_task * z_task + sigma_exec * z_exec - (sigma_task ** 2 + sigma_exec ** 2) / 2
    return calls * tool_mean_s * math.exp(log_factor)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m gyre.harness.long_tail_agent", description=__doc__.split("\n\n")[0])
    p.add_argument("--execution-id", default=os.environ.get("GYRE_EXECUTION_ID", ""),
                   help="seeds the tool times (default $GYRE_EXECUTION_ID)")
    p.add_argument("--calls", type=int, default=8, help="model calls (default 8)")
    p.add_argument("--max-tokens", type=int, default=32, help="max_tokens of each call (default 32)")
    p.add_argument("--tool-mean-s", type=float, default=1.0, help="mean tool seconds after each call (default 1.0)")
    p.add_argument("--sigma-task", type=float, default=0.3, help="log-sd of the group's tool-time factor")
    p.add_argument("--sigma-exec", type=float, default=0.6, help="log-sd of the execution's own factor")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--model", default="main", help="model name sent (Gyre reads it as the agent role)")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per-request HTTP timeout")
    p.add_argument("--retries", type=int, default=3, help="retries on 429/5xx and connection errors")
    args = p.parse_args(argv)
    if not args.execution_id:
        p.error("--execution-id (or $GYRE_EXECUTION_ID) is required: it seeds the tool times")
    if args.calls < 1 or args.max_tokens < 1:
        p.error("--calls and --max-tokens must be at least 1")
    if args.tool_mean_s < 0 or args.sigma_task < 0 or args.sigma_exec < 0:
        p.error("--tool-mean-s, --sigma-task and --sigma-exec must be >= 0")
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    base_url, api_key = os.environ.get("OPENAI_BASE_URL"), os.environ.get("OPENAI_API_KEY", "")
    if not base_url:
        print("long_tail_agent: OPENAI_BASE_URL is not set", file=sys.stderr)
        return 2
    ws = Path(os.environ.get("GYRE_WORKSPACE") or os.getcwd())
    try:
        task = (ws / "start.md").read_text(encoding="utf-8")
    except OSError as e:
        print(f"long_tail_agent: cannot read the task: {e}", file=sys.stderr)
        return 2
    pause = tool_seconds(args.execution_id, args.calls, args.tool_mean_s, args.sigma_task, args.sigma_exec,
                         args.seed) / args.calls
    url = base_url.rstrip("/") + "/chat/completions"
    messages: list[dict] = [{"role": "user", "content": task}]
    reply: dict = {}
    try:
        for i in range(args.calls):
            reply = chat(url, api_key, {"model": args.model, "messages": messages, "max_tokens": args.max_tokens},
                         args.timeout_s, args.retries)
            time.sleep(pause)  # the tool runs
            messages = [*messages, reply, {"role": "user", "content": TOOL_RESULT.format(i=i + 1)}]
    except ApiError as e:
        print(f"long_tail_agent: {e}", file=sys.stderr)
        return 1
    content = reply.get("content")
    (ws / ANSWER_FILE).write_text(content if isinstance(content, str) else "", encoding="utf-8", errors="replace")
    print(f"long_tail_agent: {args.calls} calls, {pause * args.calls:.2f} s of tools", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
