"""A rank's last words: the one line saying why it ended the job, kept in run.dir.

A rank that fails prints the line and calls MPI_Abort; under load `mpiexec` can end before it
has forwarded that line (seen: `gyre run` exited 1 with only "without a report" to show). The
rank also writes the line here, and the launcher names it when the job ends without a report.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

from gyre.fsio import atomic_write_text

SUFFIX = ".failed"


def record(run_dir: Path, who: str, rank: int, line: str) -> None:
    with contextlib.suppress(OSError):  # the line is also on stderr; a full disk must not hide the abort
        atomic_write_text(Path(run_dir) / f"{who}{rank}{SUFFIX}", line + "\n")


def since(run_dir: Path, t0: float) -> list[str]:
    """The lines of the ranks that failed in the job started at ``t0`` (an earlier job's are older)."""
    found = []
    for p in sorted(Path(run_dir).glob(f"*{SUFFIX}")):
        with contextlib.suppress(OSError):
            if p.stat().st_mtime >= t0:
                found.append(p.read_text(encoding="utf-8", errors="replace").strip())
    return [x for x in found if x]
