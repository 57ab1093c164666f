"""The token-identity audit: do the tokens a micro-batch trains match what the engine returned?

ARCHITECTURE.md invariant 1: what trains is exactly what was sampled. Each call records, when the
proxy captures it, a digest of the output ids and behaviour log-probs the engine returned
(``CallRecord.output_digest``). For every target node a micro-batch trains, the audit checks

* each trained (id, behaviour log-prob) against the node's stored tokens at the same offset
  (a materialization error: counted token by token), and
* the node's stored output against the digest of the call that created it (the tree or shard
  no longer holds what the engine returned: every trained token of the node counts).

Calls without a digest (shards of schema 1) are not audited: ``unchecked`` counts their tokens.
The goal is 0 mismatched tokens on every step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Sequence

import numpy as np

from gyre.traj.tree import output_digest

if TYPE_CHECKING:
    from gyre.batch import MicroBatch


@dataclass
class Audit:
    tokens: int = 0            # trained target tokens audited
    mismatched: int = 0        # of those, tokens whose id or behaviour log-prob differs
    unchecked: int = 0         # trained tokens of calls recorded without a digest
    first: str | None = None   # the first offending call, "execution <id> call <index>"

    def add(self, other: "Audit") -> None:
        self.tokens += other.tokens
        self.mismatched += other.mismatched
        self.unchecked += other.unchecked
        self.first = self.first or other.first


def audit_micro_batch(mb: MicroBatch | dict, keys: np.ndarray, executions: Sequence) -> Audit:
    """Audit one micro-batch (a MicroBatch, or its wire form as the head holds it: numpy arrays by
    field name); ``keys`` are its targets' (execution_index, node, offset) and ``executions`` the
    step's `SelectedExecution`s, indexed by ``execution_index``."""
    out = Audit()
    if not len(keys):
        return out
    by_index = {e.index: e for e in executions}
    wire = mb if isinstance(mb, dict) else {"target_ids": mb.target_ids, "old_logprobs": mb.old_logprobs}
    ids = np.asarray(wire["target_ids"])
    old = np.asarray(wire["old_logprobs"])
    _, start = np.unique(keys[:, :2], axis=0, return_index=True)
    bounds = np.append(np.sort(start), len(keys))
    # targets of one node are contiguous in a micro-batch (one piece carries a node's targets)
    for lo, hi in zip(bounds[:-1].tolist(), bounds[1:].tolist()):
        exe_i, node_id = (int(x) for x in keys[lo, :2])
        e = by_index[exe_i]
        node = e.record.tree.nodes[node_id]
        offsets = keys[lo:hi, 2]  # token positions in the node (targets start at target_start)
        stored_ids = node.tokens[offsets]
        stored_lp = node.logprobs[offsets - node.target_start]
        bad = (ids[lo:hi] != stored_ids) | (old[lo:hi].view(np.int32) != stored_lp.astype(np.float32).view(np.int32))
        n_bad = int(bad.sum())
        call = e.record.tree.calls[node.call_index] if 0 <= node.call_index < len(e.record.tree.calls) else None
        out.tokens += hi - lo
        if call is None or call.output_digest == 0:
            out.unchecked += hi - lo
        elif output_digest(node.tokens[node.target_start:], node.logprobs) != call.output_digest:
            n_bad = hi - lo
        if n_bad:
            out.mismatched += n_bad
            out.first = out.first or f"execution {e.record.execution_id} call {node.call_index}"
    return out


def audit_warning(audit: Audit) -> str | None:
    """The warning a step with mismatched tokens gets; None when every trained token matched."""
    if not audit.mismatched:
        return None
    return (f"token-identity audit: {audit.mismatched} of {audit.tokens} trained tokens differ from what "
            f"the engine returned (first: {audit.first}); what trains is not what was sampled: check the "
            f"shard or tree that recorded the call")
