"""One session's report: what this head saw, from the events (gyre/events.py); no shard is read back.

`gyre.report.history.whole_run` folds it into the run's history (a resumed run is many sessions).
The head is read by its attributes (`stats`, `cells`, `fleet`, `ledger`, `core`, `outputs`, ...),
never imported: the report depends on no driver (docs/architecture.md).
"""

from __future__ import annotations

from dataclasses import asdict



def session_report(head, t1: float, stopped: bool) -> dict:
    st, s, cells = head.stats, head.cfg.sched, head.cells
    executions = dict(st.status_counts)
    events = sorted(head.fleet.events + head.events, key=lambda e: e["t"])  # the cells' and the head's
    return {"stopped_reason": head.failed or (head.rollout.broken if head.rollout else None),
            "failed": head.failed, "unscorable": dict(head.ledger.unscorable),
            "scheme": s.scheme, "label": f"{s.scheme}{s.staleness}", "staleness": s.staleness,
            "staleness_rule": s.staleness_rule, "steps_per_sync": s.steps_per_sync,
            "lag": asdict(st.lag()), "groups_dropped": st.groups_dropped, "groups_started": head.core.started,
            "steps": st.steps,
            "cells": [{**st.cell_time(c.id, t1), "hostname": c.hostname, "switch_phases": c.switch_phases}
                      for c in cells],
            "t0": head.t0, "wall_s": t1 - head.t0, "stopped": stopped,
            "errors": head.fleet.errors + head.errors + head.outputs.errors,
            "warnings": head.warnings,
            # harnesses that broke by themselves (a [harness] limit the policy passed is not one)
            "harness_errors": st.harness_broke,
            "events": events,
            "groups_replaced_zero_variance": head.core.zero_variance_dropped,
            "executions": executions, "stopped_by_limits": dict(st.limit_counts), "version": head.version,
            "intervals": {c.id: st.intervals(c.id, t1) for c in cells},
            "idle": {c.id: st.idle_spans(c.id, t1) for c in cells},
            "metrics": head.outputs.describe(),
            # every round so far, from the run's durable validation.jsonl (so the whole run's)
            "validation": list(head.validation.log.rounds.values()) if head.validation else []}
