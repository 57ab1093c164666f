"""A reward function for Gyre (``[reward] function = "reward_fn:score"``, ``pythonpath = ["docs/recipes"]``).

Gyre calls it once per finished execution, in a subprocess in the harness's sandbox with a time
limit (``reward.timeout_s``), with keyword arguments:

- ``workspace``: the execution's retained workspace (a path, ``/workspace`` in the sandbox; read-only);
- ``task``: {name, prompt, test_commands, test_case_count, metadata} (metadata: the dataset row's);
- ``tests``: the tests' results {reward, passed, total, source, error, log_path}, or None where the
  task has no tests (a dataset row scored by the reward alone);
- ``calls``: one dict per model call {index, agent_role, n_input, n_output, finish_reason,
  policy_version, temperature, top_p, t_start, t_end}.

It returns a float, or a dict of named parts (each logged in <run.dir>/rewards.jsonl and in
validation rounds); the reward is the part named ``reward`` if there is one, else their sum. An
exception or a non-finite value is a failed evaluation with its reason: never trained, never 0.

This one keeps the tests' pass share and adds shaping: a small bonus for a short answer file and
a penalty for calls cut by the token limit.
"""

from __future__ import annotations

from pathlib import Path


def score(workspace: str, task: dict, tests: dict | None, calls: list[dict]) -> dict:
    passed = (tests or {}).get("reward") or 0.0
    answer = Path(workspace) / "answer.txt"
    text = answer.read_text(encoding="utf-8", errors="replace").strip() if answer.is_file() else ""
    brevity = 0.1 if 0 < len(text) <= int(task["metadata"].get("max_chars", 80)) else 0.0
    truncated = sum(c["finish_reason"] == "length" for c in calls)
    return {"tests": passed, "brevity": brevity, "truncation": -0.05 * truncated}
