"""A harness written with the `openai` SDK (pip install openai): draft, review by a sub-agent,
revise, and write the answer into the workspace.

Gyre starts it with OPENAI_BASE_URL, OPENAI_API_KEY (this execution's own key), GYRE_WORKSPACE,
GYRE_TASK_DIR and GYRE_EXECUTION_ID in its environment (docs/harnesses.md). The model name says
which agent made a call: `main` for the agent itself, `subagent:<name>` for a sub-agent, so that
Gyre's selection (selection.role_priority) knows which trajectories to train first.
"""

import os
from pathlib import Path

from openai import OpenAI


def task_text() -> str:
    for d in (os.environ.get("GYRE_WORKSPACE", "."), os.environ.get("GYRE_TASK_DIR", ".")):
        if (Path(d) / "start.md").is_file():
            return (Path(d) / "start.md").read_text()
    return "Say hello."


def main() -> None:
    client = OpenAI()  # reads OPENAI_BASE_URL and OPENAI_API_KEY
    messages = [{"role": "system", "content": "You are a careful engineer."}, {"role": "user", "content": task_text()}]
    draft = client.chat.completions.create(model="main", messages=messages, max_tokens=256)
    messages.append({"role": "assistant", "content": draft.choices[0].message.content})
    review = client.chat.completions.create(  # a sub-agent: its own conversation, its own role
        model="subagent:reviewer", max_tokens=128,
        messages=[{"role": "user", "content": f"Review this answer:\n{draft.choices[0].message.content}"}])
    messages.append({"role": "user", "content": f"A reviewer says: {review.choices[0].message.content}\nRevise."})
    parts = []  # streamed, as most agents do: Gyre records it the same
    for chunk in client.chat.completions.create(model="main", messages=messages, max_tokens=256, stream=True):
        if chunk.choices and chunk.choices[0].delta.content:
            parts.append(chunk.choices[0].delta.content)
    Path(os.environ.get("GYRE_WORKSPACE", "."), "answer.md").write_text("".join(parts))


if __name__ == "__main__":
    main()
