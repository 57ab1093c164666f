"""A rank's last words: why it ended the job, kept in run.dir beside the traceback.

A rank that fails prints one line and calls MPI_Abort; under load `mpiexec` can end before it
has forwarded that line (seen: `gyre run` exited 1 with only "without a report" to show). So the
rank writes its traceback (``<who><rank>.traceback``, for a bug report) and the line
(``<who><rank>.failed``), and the launcher names the line when the job ends without a report.
"""

from __future__ import annotations

import contextlib
import traceback
from pathlib import Path

from gyre.fsio import atomic_write_text

SUFFIX = ".failed"


def record(run_dir: Path, who: str, rank: int, e: BaseException) -> str:
    """Write the traceback of ``e`` and the one line naming it; return the line."""
    run_dir = Path(run_dir)
    where = ""
    with contextlib.suppress(OSError):  # the line still goes to stderr: a full disk must not hide the abort
        run_dir.mkdir(parents=True, exist_ok=True)
        path = run_dir / f"{who}{rank}.traceback"
        path.write_text("".join(traceback.format_exception(e)))
        where = str(path)
    line = (f"the {who} (rank {rank}) failed: {type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}{f' (traceback: {where})' if where else ''}")
    with contextlib.suppress(OSError):
        atomic_write_text(run_dir / f"{who}{rank}{SUFFIX}", line + "\n")
    return line


def since(run_dir: Path, t0: float) -> list[str]:
    """The lines of the ranks that failed in the job started at ``t0`` (an earlier job's are older)."""
    found = []
    for p in sorted(Path(run_dir).glob(f"*{SUFFIX}")):
        with contextlib.suppress(OSError):
            if p.stat().st_mtime >= t0 and (line := p.read_text(encoding="utf-8", errors="replace").strip()):
                found.append(line)
    return found
