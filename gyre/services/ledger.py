"""The ledger: what a run writes down, and what ``--resume`` reads back.

- ``ledger.jsonl``: every ended execution's last word: trained in step s (with its staleness), or
  not admitted with the reason; plus ``resume`` / ``resuming`` / ``resumed`` lines.
- ``steps.jsonl``: one row per committed step (`gyre.events.RunStats` computes it).
- ``state.json``: the commit point of a step (version, groups started, weights, checkpoint).

On resume `reconcile` makes ledger and step rows agree with the committed state (a step past it
is redone, so its lines become not admitted), and `stopped_to_replay` lists the stopped
executions whose recorded calls a new execution of the same task replays.
"""

from __future__ import annotations

import json
import re
import time
from pathlib import Path
from typing import Callable

from gyre.events import ExecutionDropped
from gyre.fsio import atomic_write_json, atomic_write_text
from gyre.proxy.journal import read_journal
from gyre.proxy.replay import Replay
from gyre.traj.record import Status
from gyre.traj.store import iter_executions

EXECUTION_ID = re.compile(r"^q(?P<group>\d+)-(?P<task>.+)-g(?P<member>\d+)$")  # as the head names them


def execution_id(group: int, task: str, member: int) -> str:
    return f"q{group}-{task}-g{member}"


class Ledger:
    def __init__(self, run_dir: str | Path, shard_dir: str | Path, *, emit: Callable, clock: Callable[[], float] = time.time):
        self.run_dir, self.shard_dir = Path(run_dir), Path(shard_dir)
        self.emit, self.clock = emit, clock
        self.ledger_path, self.steps_path = self.run_dir / "ledger.jsonl", self.run_dir / "steps.jsonl"
        self.state_path = self.run_dir / "state.json"
        self._ledger = self._steps = None
        # an execution that ended and has no ledger line yet: id -> (reward or None, why it cannot train)
        self.ended: dict[str, tuple[float | None, str]] = {}
        self.task_of: dict[int, str] = {}               # group id -> task name
        self.unscorable: dict[str, int] = {}            # executions that ended with no reward, by why
        self.errors: dict[str, str] = {}                # why an ended execution ended badly (a limit, ...)

    def open(self) -> None:
        """Line-buffered appends: a line is in the file when the call returns."""
        self._ledger = open(self.ledger_path, "a", buffering=1)
        self._steps = open(self.steps_path, "a", buffering=1)

    def close(self) -> None:
        for f in (self._ledger, self._steps):
            if f is not None:
                f.close()

    # ---- executions ----------------------------------------------------------------------------
    def group_started(self, group: int, task: str) -> None:
        self.task_of[group] = task

    def execution_ended(self, eid: str, reward: float | None, why_not: str, unscorable: str = "",
                        error: str | None = None) -> None:
        """``why_not``: why it cannot train ("" if it can); ``unscorable``: why it has no reward;
        ``error``: the record's error (a limit it passed, its time limit), kept for its line."""
        self.ended[eid] = (reward, why_not)
        if error:
            self.errors[eid] = error
        if reward is None:
            self.unscorable[unscorable or "no reward"] = self.unscorable.get(unscorable or "no reward", 0) + 1

    def why_not(self, eid: str) -> str:
        return self.ended[eid][1]

    def line(self, eid: str, g, *, admitted: bool, reason: str = "", staleness: int | None = None,
             step: int | None = None) -> None:
        """An execution's ledger line is its last word (``g``: its core GroupRecord)."""
        reward, _ = self.ended.pop(eid, (None, ""))
        if not admitted:
            self.emit(ExecutionDropped(self.clock(), eid, g.id, reason))
        self._write({"execution": eid, "group": g.id, "task": self.task_of[g.id], "admitted": admitted,
                     "step": step, "staleness": staleness, "lag_syncs": g.lag_syncs if admitted else None,
                     "reason": reason, "reward": reward, "version": g.version, "sync": g.sync,
                     "error": self.errors.pop(eid, None)})

    def close_unfinished(self, groups, why: str, step: int) -> None:
        """Every execution that ended and did not train gets its line, with the reason."""
        for g in groups:
            for eid in g.executions:
                if eid in self.ended:  # ended, and not yet given its last ledger line
                    self.line(eid, g, admitted=False,
                              reason=f"{why} before step {step} closed (group {g.state.value})")

    def resuming(self, eid: str, source: str) -> None:
        """Written before it runs: a stopped execution's recording is never replayed into two."""
        self._write({"resuming": eid, "from": source})

    def resumed(self, eid: str, source: str, recorded_calls: int, replayed_calls: int) -> None:
        self._write({"resumed": eid, "from": source, "recorded_calls": recorded_calls,
                     "replayed_calls": replayed_calls})

    def resume_marker(self, version: int) -> None:
        self._write({"resume": True, "version": version, "at": self.clock()})

    def step_row(self, row: dict) -> None:
        self._steps.write(json.dumps(row) + "\n")

    def _write(self, row: dict) -> None:
        self._ledger.write(json.dumps(row) + "\n")

    # ---- state ---------------------------------------------------------------------------------
    def write_state(self, *, version: int, rollout_version: int, groups_started: int, weights: str,
                    checkpoint: str) -> None:
        atomic_write_json(self.state_path, {
            "version": version, "rollout_version": min(version, rollout_version), "groups_started": groups_started,
            "weights": weights, "checkpoint": checkpoint})

    def load_state(self) -> tuple[int, int]:
        """(version, next group id) of the last committed step; the ledger is reconciled with it."""
        if not self.state_path.exists():
            return 0, 0
        st = json.loads(self.state_path.read_text())
        version = int(st["version"])
        # groups of unfinished steps are rerun under new ids; what they recorded is in the shards
        # and (after `reconcile`) in the ledger as not admitted, so nothing trains twice
        self.reconcile(version)
        return version, int(st["groups_started"])

    def reconcile(self, version: int) -> None:
        """Make ledger.jsonl and steps.jsonl agree with the committed state after a hard stop.

        A head killed between a step's ledger lines and state.json leaves lines for a step that
        the resumed job redoes (the trainer restarts from the committed checkpoint): those become
        not admitted. Executions in the shards with no ledger line (killed before they were
        recorded) get one. Rewritten atomically, once, before the resumed job appends."""
        lines = self.ledger_path.read_text().splitlines() if self.ledger_path.exists() else []
        out, seen = [], set()
        for line in lines:
            row = json.loads(line)
            if "execution" in row:
                if row["admitted"] and row["step"] is not None and row["step"] >= version:
                    row = {**row, "admitted": False, "staleness": None, "lag_syncs": None,
                           "reason": f"step {row['step']} rolled back: the head stopped before it was committed"}
                seen.add(row["execution"])
            out.append(json.dumps(row))
        for rec in iter_executions(self.shard_dir):
            if rec.execution_id not in seen:
                seen.add(rec.execution_id)
                out.append(json.dumps({"execution": rec.execution_id, "group": rec.group, "task": rec.task,
                                       "admitted": False, "step": None, "staleness": None, "lag_syncs": None,
                                       "reason": "the head stopped before this execution was admitted or recorded",
                                       "reward": None, "version": rec.min_version, "sync": None}))
        ws_dir = self.run_dir / "workspaces"
        for ws in sorted(ws_dir.iterdir()) if ws_dir.is_dir() else ():
            m = EXECUTION_ID.match(ws.name)
            if m and ws.name not in seen:  # it was running when the head died: no record of it exists
                seen.add(ws.name)
                out.append(json.dumps({"execution": ws.name, "group": int(m["group"]), "task": m["task"],
                                       "admitted": False, "step": None, "staleness": None, "lag_syncs": None,
                                       "reason": "lost: it was running when the head was killed; its calls were "
                                                 "not recorded (its group is rerun)",
                                       "reward": None, "version": None, "sync": None}))
        atomic_write_text(self.ledger_path, "".join(line + "\n" for line in out))
        if self.steps_path.exists():
            keep = [line for line in self.steps_path.read_text().splitlines()
                    if line.strip() and json.loads(line)["step"] < version]
            atomic_write_text(self.steps_path, "".join(line + "\n" for line in keep))

    def stopped_to_replay(self, journal_dir: str | Path | None = None) -> dict[tuple[str, int], list]:
        """(task, member) -> [(execution id, tree or Replay)] of executions the stopped job was
        running (status ``stopped``, calls recorded, never resumed yet), and of those a killed
        head was running (a journal in ``journal_dir`` and no shard: gyre.proxy.journal): a new
        group of the same task resumes them by replay, member for member (gyre.proxy.replay)."""
        done = set()  # recordings already taken by a resumed execution ("resuming" lines)
        for line in self.ledger_path.read_text().splitlines() if self.ledger_path.exists() else []:
            if '"resuming"' in line:
                done.add(json.loads(line).get("from"))
        out: dict[tuple[str, int], list] = {}
        recorded = set()
        for rec in iter_executions(self.shard_dir):
            recorded.add(rec.execution_id)
            m = EXECUTION_ID.match(rec.execution_id)
            if m and rec.status == Status.STOPPED and rec.tree.calls and rec.execution_id not in done:
                out.setdefault((rec.task, int(m["member"])), []).append((rec.execution_id, rec.tree))
        for f in sorted(Path(journal_dir).glob("*.jsonl")) if journal_dir and Path(journal_dir).is_dir() else ():
            m = EXECUTION_ID.match(f.stem)  # in a shard already (killed before its journal went): not again
            if m and f.stem not in recorded and f.stem not in done:
                replay = Replay.from_journal(read_journal(f))
                if replay.recorded:
                    out.setdefault((m["task"], int(m["member"])), []).append((f.stem, replay))
        return out
