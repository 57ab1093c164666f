"""Small execution records and the identity they are written under, for the shard tests (and the child process of the compaction fault test)."""

from __future__ import annotations

from gyre.traj.record import ExecutionRecord
from gyre.traj.synthetic import Shape, generate


IDENTITY = {"tokenizer": "sha256:tok0", "model": "sha256:model0"}


def records(n: int = 3, seed: int = 0) -> list[ExecutionRecord]:
    out = [generate(Shape(calls=24 + 6 * k, subagents=1, subagent_calls=4, compactions=1, retries=1,
                          versions_every=7, seed=seed + k), execution_id=f"exec-{seed}-{k}",
                    task=f"täsk/{k}", group=k // 2, t0=1.7e9 + k) for k in range(n)]
    out[0].status, out[0].reward_source, out[0].workspace = "timeout", "tests-after-timeout", "/ws/é 0"
    out[0].error = "wall-clock limit of 600s reached"
    # an execution that ended before its first call, with no reward
    out.append(ExecutionRecord("exec-empty", "t/empty", 9, "crashed", float("nan"), "unscorable"))
    return out
