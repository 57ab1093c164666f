"""Copying a workspace for scoring without letting it fill the disk.

``shutil.copy2`` writes a sparse file's holes as zeros: a harness's 4 KB sparse file of 4 GB
apparent size became 4 GB of real data in the evaluator's scratch. Here only the data extents
are copied (``SEEK_DATA`` / ``SEEK_HOLE``; the holes stay holes) and the bytes of data copied in
one evaluation are bounded by a budget, past which the copy stops with an error naming it.
:func:`copy_tree` walks without recursion (a 600-deep tree made ``shutil.copytree`` raise
``RecursionError``) and stops at a deadline (200,000 files took 103 s).
"""

from __future__ import annotations

import os
import shutil
import stat
import time
from pathlib import Path
from typing import Callable


class CopyBudgetExceeded(RuntimeError):
    """The workspace holds more data than the evaluation may copy (not an OSError: copytree must
    not swallow it)."""


class CopyTimeExceeded(CopyBudgetExceeded):
    """The copy did not finish before the evaluation's deadline."""


def copy_tree(src: str | os.PathLike, dst: str | os.PathLike, copy_function: Callable[[str, str], None],
              deadline: float | None = None, key: str = "eval.timeout_s") -> None:
    """``shutil.copytree(src, dst, symlinks=True, copy_function=..., dirs_exist_ok=True)`` with an
    explicit stack instead of recursion, stopping with :class:`CopyTimeExceeded` once
    ``time.monotonic()`` passes ``deadline``. Per-entry OSErrors are collected and raised
    together as ``shutil.Error`` at the end, as copytree does."""
    errors: list[tuple[str, str, str]] = []
    stack, dirs = [(Path(src), Path(dst))], []
    while stack:
        s, d = stack.pop()
        try:
            d.mkdir(exist_ok=True)
            with os.scandir(s) as it:
                entries = list(it)
        except OSError as e:
            errors.append((str(s), str(d), str(e)))
            continue
        dirs.append((s, d))
        for e in entries:
            if deadline is not None and time.monotonic() > deadline:
                raise CopyTimeExceeded(f"copying the workspace for scoring did not finish in time ({key}); the "
                                       f"workspace holds too many files")
            sp, dp = Path(e.path), d / e.name
            try:
                if e.is_symlink():
                    if dp.is_symlink() or dp.exists():
                        dp.unlink()
                    os.symlink(os.readlink(sp), dp)
                elif e.is_dir(follow_symlinks=False):
                    stack.append((sp, dp))
                else:
                    copy_function(str(sp), str(dp))
            except OSError as err:
                errors.append((str(sp), str(dp), str(err)))
    for s, d in reversed(dirs):  # deepest first: copying a child does not change a copied stat
        try:
            shutil.copystat(s, d, follow_symlinks=False)
        except OSError as err:
            errors.append((str(s), str(d), str(err)))
    if errors:
        raise shutil.Error(errors)


def _extents(fd: int, size: int):
    """(offset, length) of each data extent of an open file; the whole file where the file
    system cannot tell."""
    pos = 0
    while pos < size:
        try:
            start = os.lseek(fd, pos, os.SEEK_DATA)
        except OSError:  # ENXIO: only a hole is left; EINVAL: no SEEK_DATA here
            if pos == 0 and not _has_seek_data(fd):
                yield 0, size
            return
        end = os.lseek(fd, start, os.SEEK_HOLE)
        yield start, end - start
        pos = end


def _has_seek_data(fd: int) -> bool:
    try:
        os.lseek(fd, 0, os.SEEK_HOLE)
        return True
    except OSError:
        return False


class CopyBudget:
    """A ``copy_function`` for ``shutil.copytree``: regular files only (a FIFO would block the
    evaluator forever; sockets and devices mean nothing in a copy), sparse-aware, and at most
    ``max_bytes`` of data in all (0 = no limit). ``key`` names the setting in errors."""

    def __init__(self, max_bytes: int, key: str = "eval.max_copy_mb"):
        self.max_bytes, self.key, self.copied = max_bytes, key, 0

    def copy(self, src: str, dst: str) -> None:
        st = os.lstat(src)
        if not stat.S_ISREG(st.st_mode):
            return
        fin = os.open(src, os.O_RDONLY | os.O_NOFOLLOW)
        try:
            fout = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o600)
            try:
                for off, length in _extents(fin, st.st_size):
                    self._charge(length)
                    self._copy_range(fin, fout, off, length)
                os.ftruncate(fout, st.st_size)  # a trailing hole
            finally:
                os.close(fout)
        finally:
            os.close(fin)
        shutil.copystat(src, dst, follow_symlinks=False)

    def _charge(self, n: int) -> None:
        self.copied += n
        if self.max_bytes and self.copied > self.max_bytes:
            raise CopyBudgetExceeded(f"the workspace holds more than {self.max_bytes >> 20} MB of data to copy "
                                     f"for scoring ({self.key} = {self.max_bytes >> 20}); raise it if the task needs more")

    @staticmethod
    def _copy_range(fin: int, fout: int, off: int, length: int) -> None:
        end = off + length
        while off < end:
            try:
                n = os.copy_file_range(fin, fout, end - off, off, off)
            except OSError:  # not across these file systems: plain reads and writes
                n = 0
            if n == 0:
                data = os.pread(fin, min(1 << 20, end - off), off)
                if not data:
                    return  # the file shrank meanwhile
                n = os.pwrite(fout, data, off)
            off += n
