"""Per-harness limits that rlimits cannot give: processes and memory of a harness's whole
process tree, the bytes of stdout/stderr kept, and the bytes its workspace holds.

One harness on a shared node must not slow, corrupt or fill anything for the others. RLIMIT_AS
bounds one process, not a tree of them; RLIMIT_NPROC counts every process of the user (the head's
and the sibling harnesses' too); cgroups are not available to a user job everywhere. So a watcher
reads /proc every ``poll_s`` (in a thread, off the event loop) and stops the harness at the first
limit it passes, with an error naming that ``[harness]`` key. A single file is bounded at once by
RLIMIT_FSIZE (set to the workspace limit by the runner); in a sandbox the kernel caps the
processes too (RLIMIT_NPROC in the instance's own user namespace: gyre.harness.sandbox_init; the
pids cgroup under podman/docker), for the harness and for its evaluation's test commands, and the
poll here is the fallback wherever neither holds (gyre.harness.sandbox warns where that is).

Every error starts with ``harness.<key> = <limit>``: the execution's record keeps it, and the
summaries count executions by the limit that stopped them (gyre.traj.record.limit_of).
"""

from __future__ import annotations

import os
import re
import select
import threading
import time
from dataclasses import dataclass
from pathlib import Path

_PAGE = os.sysconf("SC_PAGE_SIZE")
# The kernel's cap in a sandbox (RLIMIT_NPROC) counts threads as well as processes: room for a
# harness's threads and the launcher's relay threads (two per proxy connection), and above
# max_processes, so the poll still sees a fork bomb pass the limit and stops it with its error.
KERNEL_TASKS_PER_PROCESS = 2
LAUNCHER_TASKS = 160


def kernel_process_cap(max_processes: int) -> int:
    """RLIMIT_NPROC inside a sandbox with a user namespace of its own, for `max_processes`."""
    return KERNEL_TASKS_PER_PROCESS * max_processes + LAUNCHER_TASKS


def kernel_counts_per_namespace() -> bool:
    """RLIMIT_NPROC counted per user namespace (Linux 5.14, "ucounts"); before, one count per user
    on the whole node, which would hold a sandbox to the user's other processes too.

    Not cgroup v2's pids controller: a user job can use it only where systemd or Slurm delegates a
    cgroup subtree to it, which most clusters (and this machine: cgroup v1, no controllers in the
    unified hierarchy) do not; a user namespace is what bubblewrap gives everywhere."""
    m = re.match(r"(\d+)\.(\d+)", os.uname().release)
    return m is not None and (int(m[1]), int(m[2])) >= (5, 14)


@dataclass(frozen=True)
class TreeLimits:
    max_processes: int = 0  # 0 = none
    max_memory_mb: int = 0  # resident memory of the whole tree
    max_workspace_mb: int = 0  # allocated bytes under the workspace (sparse files count what they hold)
    max_workspace_files: int = 0  # entries under the workspace (files, folders, links; empty ones too)

    def any(self) -> bool:
        return bool(self.max_processes or self.max_memory_mb or self.max_workspace_mb or self.max_workspace_files)


def _stat_all() -> dict[int, tuple[int, int, int]]:
    """pid -> (ppid, session, rss bytes) of every process we can see."""
    out = {}
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat", "rb") as f:
                raw = f.read()
        except OSError:  # gone meanwhile
            continue
        rest = raw[raw.rfind(b")") + 2:].split()  # the command name may hold spaces and parentheses
        out[int(name)] = (int(rest[1]), int(rest[3]), int(rest[21]) * _PAGE)
    return out


_scan_lock = threading.Lock()
_scan: tuple[float, dict] = (0.0, {})
SCAN_REUSE_S = 0.25  # one /proc scan serves every harness's check in this window (16 harnesses, 1 scan)


def _stat_recent() -> dict[int, tuple[int, int, int]]:
    global _scan
    with _scan_lock:
        now = time.monotonic()
        if now - _scan[0] > SCAN_REUSE_S:
            _scan = (now, _stat_all())
        return _scan[1]


def tree_usage(root: int) -> tuple[int, int]:
    """(processes, resident bytes) of `root`'s tree: its session (it leads one) and every
    descendant, including those that started a session of their own."""
    procs = _stat_recent()
    members = {p for p, (_, sid, _) in procs.items() if sid == root or p == root}
    children: dict[int, list[int]] = {}
    for p, (ppid, _, _) in procs.items():
        children.setdefault(ppid, []).append(p)
    todo = list(members)
    while todo:
        for c in children.get(todo.pop(), ()):
            if c not in members:
                members.add(c)
                todo.append(c)
    return len(members), sum(procs[p][2] for p in members if p in procs)


def allocated_bytes(path: Path) -> int:
    """Bytes the files under `path` hold on disk (st_blocks: a sparse file counts what it holds)."""
    return workspace_usage(path)[0]


def workspace_usage(path: Path, max_entries: int = 0) -> tuple[int, int]:
    """(allocated bytes, entries) under `path`: every file, folder and link counts one entry (an
    empty file takes an inode as a full one does). With `max_entries`, the walk stops as soon as
    the count passes it, so a tree of millions is not walked in full at every poll."""
    total, entries, todo = 0, 0, [str(path)]
    while todo:
        try:
            it = os.scandir(todo.pop())
        except OSError:
            continue
        with it:
            for e in it:
                entries += 1
                if max_entries and entries > max_entries:
                    return total, entries
                try:
                    st = e.stat(follow_symlinks=False)
                except OSError:
                    continue
                total += st.st_blocks * 512
                if e.is_dir(follow_symlinks=False):
                    todo.append(e.path)
    return total, entries


def check(limits: TreeLimits, root: int, workspace: Path | None) -> str | None:
    """The first limit the harness passes, as an error naming its key; None when within all.
    `workspace` None: its bytes are not counted this time (see `WorkspaceClock`)."""
    return _check(limits, root, workspace)


class WorkspaceClock:
    """When a workspace is walked again: a walk that took t seconds waits at least 20 t, so
    counting a 100,000-file workspace does not take a core of its own."""

    def __init__(self, poll_s: float):
        self.poll_s, self.due = poll_s, 0.0

    def due_now(self) -> bool:
        return time.monotonic() >= self.due

    def walked(self, took_s: float) -> None:
        self.due = time.monotonic() + max(self.poll_s, 20 * took_s)


def _check(limits: TreeLimits, root: int, workspace: Path | None) -> str | None:
    if limits.max_processes or limits.max_memory_mb:
        n, rss = tree_usage(root)
        if limits.max_processes and n > limits.max_processes:
            return (f"harness.max_processes = {limits.max_processes} passed: the harness ran {n} processes at "
                    "once; raise it in [harness] if this harness needs more")
        if limits.max_memory_mb and rss > limits.max_memory_mb << 20:
            return (f"harness.max_memory_mb = {limits.max_memory_mb} passed: the harness's processes held "
                    f"{rss >> 20} MB; raise it in [harness] if this harness needs more")
    if (limits.max_workspace_mb or limits.max_workspace_files) and workspace is not None:
        used, entries = workspace_usage(workspace, limits.max_workspace_files)
        if limits.max_workspace_files and entries > limits.max_workspace_files:
            return (f"harness.max_workspace_files = {limits.max_workspace_files} passed: the workspace holds "
                    f"more than {limits.max_workspace_files} entries (files and folders, empty ones too); "
                    "raise it in [harness] if the task needs more")
        if limits.max_workspace_mb and used > limits.max_workspace_mb << 20:
            return (f"harness.max_workspace_mb = {limits.max_workspace_mb} passed: the workspace holds "
                    f"{used >> 20} MB; raise it in [harness] if the task needs more")
    return None


class CappedLog(threading.Thread):
    """Copies a pipe to a file, keeping at most `max_bytes`; the rest is read and dropped (the
    harness never blocks on a full pipe) and counted in a closing line that names the limit."""

    def __init__(self, fd: int, path: Path, max_bytes: int, key: str = "harness.max_log_mb"):
        super().__init__(daemon=True, name=f"gyre-log-{path.name}")
        self.fd, self.path, self.max_bytes, self.key = fd, path, max_bytes, key
        self.kept = self.dropped = 0
        self._quit = threading.Event()
        self._out = open(path, "wb")  # exists from the start, even if the harness never runs

    def run(self) -> None:
        os.set_blocking(self.fd, False)
        with self._out as out:
            try:
                while not self._quit.is_set():  # set: something that escaped the group holds the pipe
                    ready, _, _ = select.select([self.fd], [], [], 0.2)
                    if not ready:
                        continue
                    try:
                        chunk = os.read(self.fd, 1 << 16)
                    except BlockingIOError:
                        continue
                    if not chunk:
                        break
                    room = max(0, self.max_bytes - self.kept) if self.max_bytes else len(chunk)
                    out.write(chunk[:room])
                    self.kept += min(room, len(chunk))
                    self.dropped += len(chunk) - min(room, len(chunk))
            finally:
                os.close(self.fd)
                if self.dropped:
                    out.write(f"\n[gyre: {self.dropped} more bytes dropped: {self.key} = "
                              f"{self.max_bytes >> 20} keeps {self.max_bytes} bytes]\n".encode())

    def close_unstarted(self) -> None:
        os.close(self.fd)
        self._out.close()

    def finish(self, timeout: float = 5.0) -> None:
        """Wait for the end of the output (the group is dead by now), then stop reading."""
        if not self.is_alive() and self.ident is None:
            return
        self.join(timeout)
        self._quit.set()
        self.join()
