"""Selection: which candidate trajectories (leaves) of an execution train.

A leaf's rank is the first ``role_priority`` glob pattern its agent role matches (unmatched roles
rank after every pattern). Within a rank, trajectories with more target tokens on their
root-to-leaf path come first, then the lower node id, so the choice is deterministic.

``k`` (``selection.k``) means:

* an integer K >= 1: the first K leaves in that order (fewer if the execution has fewer);
* ``"all"``: every leaf;
* ``"main"`` (main-only): every leaf whose agent role is exactly ``"main"``, uncapped, because
  each main-agent leaf (the final branch, each abandoned retry) holds outputs no other leaf has.
  Main outputs from before a compaction lie on the compactor's leaf path, so main-only trains
  them only where a main leaf's path also holds them. An execution without a main leaf selects
  nothing (materialization reports it as skipped).

The result is in rank order; materialization relies on that order only to decide which row of the
expanded layout carries a shared target.
"""

from __future__ import annotations

from dataclasses import dataclass
from fnmatch import fnmatchcase

import numpy as np

from gyre.config import SelectionConfig
from gyre.traj.tree import ROOT, TrajectoryTree

MAIN_ROLE = "main"


@dataclass(frozen=True)
class SelectionSpec:
    k: int | str = 5                                  # K, "all" or "main"
    role_priority: tuple[str, ...] = ("main", "subagent:*", "compactor")

    def __post_init__(self) -> None:
        object.__setattr__(self, "k", SelectionConfig.parse_k(self.k))
        object.__setattr__(self, "role_priority", tuple(self.role_priority))

    @classmethod
    def from_config(cls, cfg: SelectionConfig) -> "SelectionSpec":
        return cls(k=cfg.k, role_priority=tuple(cfg.role_priority))

    @property
    def label(self) -> str:
        """Name used in ablation results: main_only, k5, all."""
        return {"main": "main_only", "all": "all"}.get(self.k, f"k{self.k}")  # type: ignore[arg-type]


def role_rank(role: str, priority: tuple[str, ...] | list[str]) -> int:
    """Index of the first pattern matching ``role``; ``len(priority)`` when none does."""
    for i, pattern in enumerate(priority):
        if fnmatchcase(role, pattern):
            return i
    return len(priority)


def path_target_tokens(tree: TrajectoryTree) -> np.ndarray:
    """Target tokens on each node's root path (parents are created before their children)."""
    own = np.fromiter((n.n_targets for n in tree.nodes), np.int64, len(tree.nodes))
    out = own.copy()
    for n in tree.nodes:
        if n.parent != ROOT:
            out[n.id] += out[n.parent]
    return out


def rank_leaves(tree: TrajectoryTree, priority: tuple[str, ...] | list[str]) -> list[int]:
    """Every leaf, best first: role rank, then most target tokens on the path, then node id."""
    leaves = tree.leaves()
    if not leaves:
        return []
    on_path = path_target_tokens(tree)
    key = {i: (role_rank(tree.nodes[i].agent_role, priority), -int(on_path[i]), i) for i in leaves}
    return sorted(leaves, key=key.__getitem__)


def select_leaves(tree: TrajectoryTree, spec: SelectionSpec) -> list[int]:
    """The selected leaves of one execution, in rank order (see the module docstring)."""
    ranked = rank_leaves(tree, spec.role_priority)
    if spec.k == "all":
        return ranked
    if spec.k == "main":
        return [i for i in ranked if tree.nodes[i].agent_role == MAIN_ROLE]
    return ranked[: int(spec.k)]
