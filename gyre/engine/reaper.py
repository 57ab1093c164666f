"""Engines of a dead run: written down while they run, reaped when the run is resumed.

An engine runs in its own session (so a signal to the harnesses' groups never reaches it), which
also means it outlives a driver killed with SIGKILL, and so does its key file. Every driver that
starts engines (``gyre rollout``, each cell agent) keeps one file ``<run_dir>/pids/<owner>.json``
listing them: process ids with their start time (``/proc/<pid>/stat`` field 22, so a reused pid
is never mistaken for ours), and key files. ``reap(run_dir)`` at resume ends every listed process
still alive and deletes the listed key files, then the lists.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import time
from pathlib import Path

from gyre.fsio import atomic_write_json


def start_time(pid: int) -> int | None:
    """Start time of ``pid`` in clock ticks since boot, or None if it is gone (Linux /proc)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # the command name (field 2) may hold spaces and parentheses: split after its last ')'
    return int(stat[stat.rindex(")") + 2:].split()[19])


class ProcessList:
    """The engine processes and key files one driver owns, kept in ``<run_dir>/pids/<owner>.json``."""

    def __init__(self, run_dir: str | os.PathLike, owner: str):
        self.path = Path(run_dir) / "pids" / f"{owner}.json"
        self.entries: dict[str, dict] = {}

    def add(self, name: str, pids: list[int], key_file: str | os.PathLike | None = None) -> None:
        self.entries[name] = {"pids": [[p, start_time(p)] for p in pids],
                              "key_file": str(key_file) if key_file else None}
        self._write()

    def remove(self, name: str) -> None:
        if self.entries.pop(name, None) is not None:
            self._write()

    def close(self) -> None:
        """Everything listed was stopped by its owner: the list goes."""
        self.entries.clear()
        self.path.unlink(missing_ok=True)

    def _write(self) -> None:
        atomic_write_json(self.path, self.entries)


def reap(run_dir: str | os.PathLike, grace_s: float = 5.0) -> dict:
    """End the listed processes of a dead run that still live and delete its key files.

    Returns ``{"processes": [pid, ...], "key_files": [path, ...]}`` (what was found and removed).
    Only a process whose start time matches the one written down is signalled."""
    found: dict = {"processes": [], "key_files": []}
    d = Path(run_dir) / "pids"
    if not d.is_dir():
        return found
    lists = sorted(d.glob("*.json"))
    alive = []
    for path in lists:
        try:
            entries = json.loads(path.read_text())
        except (OSError, ValueError):
            entries = {}
        for e in entries.values():
            for pid, started in e.get("pids", []):
                if started is not None and start_time(pid) == started:
                    alive.append(pid)
            key = e.get("key_file")
            if key and Path(key).exists():
                Path(key).unlink(missing_ok=True)
                found["key_files"].append(key)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in alive:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pid, sig)  # an engine leading its own session: its children go too
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)    # one in its parent's group
        deadline = time.monotonic() + (grace_s if sig == signal.SIGTERM else 5.0)
        while time.monotonic() < deadline and any(_running(p) for p in alive):
            time.sleep(0.05)
    found["processes"] = alive
    for path in lists:
        path.unlink(missing_ok=True)
    return found


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reaped child of ours would otherwise count)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat[stat.rindex(")") + 2] != "Z"
