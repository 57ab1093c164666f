"""A harness written with litellm (pip install litellm): two turns and a context compaction.

litellm talks to Gyre's proxy as to any OpenAI-compatible server: the provider prefix `openai/`
plus the proxy's /v1 URL and this execution's key. The compaction call is labelled with the
`X-Gyre-Role: compactor` header (a harness that cannot choose model names can label every call
this way); Gyre's tree branches there instead of rewriting history (docs/harnesses.md).
"""

import os
from pathlib import Path

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")  # no network at import
import litellm  # noqa: E402

BASE, KEY = os.environ["OPENAI_BASE_URL"], os.environ["OPENAI_API_KEY"]


def ask(messages, role: str = "main") -> str:
    r = litellm.completion(model="openai/main", api_base=BASE, api_key=KEY, messages=messages, max_tokens=128,
                           extra_headers={"X-Gyre-Role": role}, num_retries=2)
    return r.choices[0].message.content or ""


def main() -> None:
    ws = Path(os.environ.get("GYRE_WORKSPACE", "."))
    task = (ws / "start.md").read_text() if (ws / "start.md").is_file() else "Say hello."
    history = [{"role": "user", "content": task}]
    history.append({"role": "assistant", "content": ask(history)})
    summary = ask(history + [{"role": "user", "content": "Summarise the work so far in one line."}], role="compactor")
    history = [{"role": "user", "content": f"{task}\nSo far: {summary}\nFinish the task."}]  # compacted context
    (ws / "answer.md").write_text(ask(history))


if __name__ == "__main__":
    main()
