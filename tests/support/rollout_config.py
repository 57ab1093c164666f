"""The configuration of a small `gyre rollout` (the builtin suite, the reference harness) for the rollout tests."""

from __future__ import annotations

from pathlib import Path

from gyre.config import load_config


AGENT = ["{python}", "-m", "gyre.harness.reference_agent", "--max-tokens", "32", "--max-turns", "4",
         "--compact-chars", "600", "--subagent-turn", "1", "--subagent-max-turns", "1"]


def cfg_for(run_dir: Path, *extra: str, command: list[str] = AGENT):
    cmd = "[" + ", ".join(f'"{c}"' for c in command) + "]"
    return load_config(None, [f"run.dir={run_dir}", "engine.endpoints=2", "harness.group_size=2",
                              "harness.concurrency=4", 'harness.tasks=["fizzbuzz", "roman"]',
                              f"harness.command={cmd}", "harness.timeout_s=120", "eval.timeout_s=60", *extra])
