"""One execution as stored: identity, outcome, evaluation and its trajectory tree."""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from enum import StrEnum

from gyre.traj.tree import TrajectoryTree


class Status(StrEnum):
    """How an execution ended (each member is its own string: shards and ledgers hold the word)."""
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CRASHED = "crashed"
    TIMEOUT = "timeout"
    STOPPED = "stopped"      # by Gyre (preemption, the run's end): never scored, rerun on resume
    LOST = "lost"            # Gyre failed it before its harness ran (e.g. its sandbox did not start)


STATUSES = tuple(s.value for s in Status)
# ended by the harness, for good: these are scored
FINISHED = (Status.DONE, Status.FAILED, Status.CRASHED, Status.TIMEOUT)
# ended by Gyre, not by the harness: never scored, rerun on resume
NOT_FINISHED = (Status.STOPPED, Status.LOST)

# reward_source: how the evaluator scored what it left behind

# A [harness] limit's error starts with its key (gyre.harness.limits): "harness.max_processes = 50 passed: ..."
_LIMIT = re.compile(r"harness\.(max_\w+) = ")


def limit_of(error: str | None) -> str | None:
    """The [harness] limit that stopped an execution ("max_workspace_files"), from its error; None
    when no limit did."""
    m = _LIMIT.match(error or "")
    return m[1] if m else None


@dataclass
class ExecutionRecord:
    execution_id: str
    task: str
    group: int = 0                 # executions of one query share a group (GRPO baseline)
    status: str = Status.RUNNING     # a Status (or its word, as read back from a shard)
    reward: float = float("nan")
    reward_source: str = ""        # tests | tests-after-timeout | tests-after-crash | unscorable | ...
    passed: int = 0
    total: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    workspace: str = ""
    tree: TrajectoryTree = field(default_factory=TrajectoryTree)
    error: str | None = None       # why it ended badly: a limit it passed, its time limit, a start failure
    # the named parts of a reward function's answer (gyre.harness.reward); in memory only: the
    # shards keep the reward, <run.dir>/rewards.jsonl keeps the parts
    reward_parts: dict = field(default_factory=dict)

    @property
    def min_version(self) -> int:
        vs = [c.policy_version for c in self.tree.calls]
        return min(vs) if vs else -1

    @property
    def max_version(self) -> int:
        vs = [c.policy_version for c in self.tree.calls]
        return max(vs) if vs else -1
