"""The whole run's report across `--resume`: each session's report folded into the run's history.

A run requeued every day is many sessions (head processes) of one run. Each session's head knows
only what it saw, so its report (`gyre.report.session.session_report`) is folded into the run's
durable history, ``<run.dir>/history.json``, the whole-run report as of the last session that
ended: ``report.json`` and the plots are drawn from the fold, never from one session's memory.

How the fold works:
- times: a session's times move to follow the history's (gaps between sessions are squeezed out:
  a requeue a day later draws right after the last session's end); interval and idle spans stay
  absolute in the first session's clock (``t0``), step and event times relative to it;
- steps: those of the history (the ones the ledger kept: a step past the state a session resumed
  from was rolled back and is redone), those only ``steps.jsonl`` has (a session killed before it
  could write its report; their times are placed after the history's end), then the session's;
- counts (executions by status, limits, drops, unscorable) add up; the lag is re-weighted by
  groups and tokens; each cell's seconds add up and its utilisation is recomputed;
- what describes the session (configuration words, stopped, failed, version) is the newest one's.

A session that did no work (a finished run resumed: no step, no execution started) and did not
fail changes nothing: the history is the report, byte for byte.
"""

from __future__ import annotations

import json
from pathlib import Path

from gyre.fsio import atomic_write_json

HISTORY = "history.json"
_ADD = ("unscorable", "executions", "stopped_by_limits")
_SUM = ("groups_dropped", "harness_errors", "groups_replaced_zero_variance", "groups_started")
_CELL_SECONDS = ("wall_s", "rollout_s", "train_s", "switching_s", "failed_s", "pushing_s", "busy_rollout_s",
                 "busy_train_s", "idle_s", "switches", "switches_to_train", "switches_to_rollout")


def _rows(path: Path) -> list[dict]:
    rows = []
    for line in path.read_text().splitlines() if path.exists() else ():
        try:
            rows.append(json.loads(line))
        except ValueError:
            pass  # a line cut by a kill
    return rows


def _idle(session: dict) -> bool:
    return (not session["steps"] and not session.get("groups_started") and not sum(session["executions"].values())
            and not session.get("failed"))


def whole_run(run_dir: str | Path, session: dict, first_step: int) -> dict:
    """The whole run's report: ``session`` (this head's report; it resumed at step ``first_step``)
    folded into ``run_dir``'s history, which is rewritten with the result (atomically)."""
    path = Path(run_dir) / HISTORY
    history = json.loads(path.read_text()) if path.exists() else None
    session = json.loads(json.dumps(session, default=str))  # the schema report.json has (str keys)
    if history is not None and _idle(session):
        return history
    merged = fold(history, session, first_step, _rows(Path(run_dir) / "steps.jsonl"))
    try:
        atomic_write_json(path, merged)
    except OSError as e:  # a full disk: the report still comes back, and says what a resume will lack
        merged["errors"] = [*merged["errors"], f"{path} not written ({e}): a resumed run's report will lack "
                                               f"this session; free space in run.dir"]
    return merged


def fold(history: dict | None, s: dict, first_step: int, step_rows: list[dict] = ()) -> dict:
    """``s`` (a session's report, in its own clock) after ``history`` (None: the first session)."""
    if history is None:
        return {**s, "sessions": 1}
    wall = history["wall_s"]
    shift_abs = history["t0"] + wall - s["t0"]  # absolute spans of s, in the first session's clock
    out = {**s, "t0": history["t0"], "wall_s": wall + s["wall_s"], "sessions": history.get("sessions", 1) + 1}
    for k in _ADD:
        out[k] = {**history.get(k, {})}
        for key, n in s.get(k, {}).items():
            out[k][key] = out[k].get(key, 0) + n
    for k in _SUM:
        out[k] = history.get(k, 0) + s.get(k, 0)
    kept = [r for r in history["steps"] if r["step"] < first_step]
    last = kept[-1]["step"] if kept else -1
    lost = [_moved(r, wall) for r in step_rows if last < r["step"] < first_step]  # a killed session's
    out["steps"] = kept + lost + [_moved(r, wall) for r in s["steps"]]
    out["lag"] = _lag(history["lag"], s["lag"])
    out["errors"] = history.get("errors", []) + s.get("errors", [])
    out["warnings"] = history.get("warnings", []) + [w for w in s.get("warnings", []) if w not in history.get("warnings", [])]
    out["events"] = history.get("events", []) + [{**e, "t": e["t"] + wall} for e in s.get("events", [])]
    out["cells"] = _cells(history["cells"], s["cells"])
    for k in ("intervals", "idle"):
        out[k] = {c: list(v) for c, v in history.get(k, {}).items()}
        for c, spans in s.get(k, {}).items():
            out[k].setdefault(c, []).extend([*x[:-2], x[-2] + shift_abs, x[-1] + shift_abs] for x in spans)
    return out


def _moved(row: dict, dt: float) -> dict:
    return {**row, "t_start": row["t_start"] + dt, "t_end": row["t_end"] + dt}


def _lag(a: dict, b: dict) -> dict:
    """Two sessions' lags as one: group means by groups, token means by tokens, the worst of both."""
    n = a["groups"] + b["groups"]
    if not n:
        return dict(b)
    tok = a.get("tokens", 0.0) + b.get("tokens", 0.0)

    def mean(key: str, weight: str) -> float:
        wa, wb = (a.get(weight, 0.0), b.get(weight, 0.0)) if tok else (a["groups"], b["groups"])
        return (a[key] * wa + b[key] * wb) / ((wa + wb) or 1)

    return {**b, "groups": n, "tokens": tok, "group_mean_steps": mean("group_mean_steps", "groups"),
            "token_mean_steps": mean("token_mean_steps", "tokens"), "worst_steps": max(a["worst_steps"], b["worst_steps"]),
            "group_mean_syncs": mean("group_mean_syncs", "groups"), "token_mean_syncs": mean("token_mean_syncs", "tokens"),
            "worst_syncs": max(a["worst_syncs"], b["worst_syncs"])}


def _cells(old: list[dict], new: list[dict]) -> list[dict]:
    """Each cell's seconds added up over the sessions (a cell of one session only keeps its own)."""
    by_id = {c["cell"]: dict(c) for c in old}
    for c in new:
        prev = by_id.get(c["cell"])
        if prev is None:
            by_id[c["cell"]] = dict(c)
            continue
        row = {**c, **{k: prev.get(k, 0) + c.get(k, 0) for k in _CELL_SECONDS}}
        row["switch_phases"] = prev.get("switch_phases", []) + c.get("switch_phases", [])
        wall = row["wall_s"]
        row["utilisation"] = (row["busy_rollout_s"] + row["busy_train_s"]) / wall if wall > 0 else 0.0
        by_id[c["cell"]] = row
    return [by_id[k] for k in sorted(by_id)]
