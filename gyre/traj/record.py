"""One execution as stored: identity, outcome, evaluation and its trajectory tree."""

from __future__ import annotations

from dataclasses import dataclass, field

from gyre.traj.tree import TrajectoryTree

# status: how the harness ended ("stopped": by Gyre; "lost": Gyre failed it before it ran);
# reward_source: how the evaluator scored what it left behind
STATUSES = ("running", "done", "failed", "crashed", "timeout", "stopped", "lost")


@dataclass
class ExecutionRecord:
    execution_id: str
    task: str
    group: int = 0                 # executions of one query share a group (GRPO baseline)
    status: str = "running"
    reward: float = float("nan")
    reward_source: str = ""        # tests | tests-after-timeout | tests-after-crash | unscorable | ...
    passed: int = 0
    total: int = 0
    t_start: float = 0.0
    t_end: float = 0.0
    workspace: str = ""
    tree: TrajectoryTree = field(default_factory=TrajectoryTree)

    @property
    def min_version(self) -> int:
        vs = [c.policy_version for c in self.tree.calls]
        return min(vs) if vs else -1

    @property
    def max_version(self) -> int:
        vs = [c.policy_version for c in self.tree.calls]
        return max(vs) if vs else -1
