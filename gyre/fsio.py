"""Durable file writes: the one place that does temp + fsync + rename.

A crash at any instant leaves either the old file (or directory) or the new one, never a torn
mix, and the rename itself is made durable by fsyncing the directory. Every file Gyre's resume
logic or a reader trusts (state.json, cells.json, ledgers' checkpoints, shards, exported weights,
weights manifests) goes through here:

- ``atomic_write_bytes`` / ``_text`` / ``_json``: a whole file from memory;
- ``atomic_open``: a file written as a stream (a CSV trace);
- ``atomic_path``: a temporary name for a writer that wants a path (h5py);
- ``atomic_dir``: a whole directory (weights, checkpoints), replacing the old one;
- ``storage_full``: a full disk or inode table, said with what to free.
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shutil
import uuid
from pathlib import Path
from typing import IO, Any, Iterator


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | os.PathLike) -> None:
    """fsync every file and directory under ``root``, and ``root``."""
    root = Path(root)
    for path in sorted(root.rglob("*")) + [root]:
        fsync_path(path)


def _temp_sibling(path: Path) -> Path:
    return path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"


@contextlib.contextmanager
def atomic_path(path: str | os.PathLike, *, mode: int | None = None,
                tmp: str | os.PathLike | None = None) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write (by name); when the block completes it is
    fsynced (made ``mode`` first if given) and renamed to ``path``, and the directory fsynced;
    if the block raises, the temporary file is removed and ``path`` is untouched. ``tmp``: the
    caller's own temporary name (one its readers know to skip)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tmp) if tmp is not None else _temp_sibling(path)
    try:
        yield tmp
        if mode is not None:
            os.chmod(tmp, mode)
        fsync_path(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)


@contextlib.contextmanager
def atomic_open(path: str | os.PathLike, how: str = "wb", *, mode: int = 0o600, **open_kw) -> Iterator[IO]:
    """``open`` for writing a new version of ``path`` as a stream (``how``: "wb" or "w"; text
    options such as ``newline`` pass on); it replaces ``path`` only once the block completes."""
    if how not in ("w", "wb"):
        raise ValueError(f"atomic_open writes a new file: how must be 'w' or 'wb', not {how!r}")
    with atomic_path(path) as tmp:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
        with os.fdopen(fd, how, **open_kw) as f:
            yield f
            f.flush()


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> Path:
    """Write `data` to `path` atomically and durably; the file is private (0600) by default."""
    with atomic_open(path, "wb", mode=mode) as f:
        f.write(data)
    return Path(path)


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = 0o600) -> Path:
    return atomic_write_bytes(path, text.encode(), mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, mode: int = 0o600, indent: int | None = None) -> Path:
    return atomic_write_bytes(path, json.dumps(obj, indent=indent).encode(), mode=mode)


def replace_dir(tmp: str | os.PathLike, final: str | os.PathLike) -> None:
    """Make the complete directory ``tmp`` durable and put it at ``final`` (rename cannot replace
    a non-empty directory, so an old one is moved aside first and removed after)."""
    tmp, final = Path(tmp), Path(final)
    fsync_tree(tmp)
    old = None
    if final.exists():
        old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


@contextlib.contextmanager
def atomic_dir(final: str | os.PathLike) -> Iterator[Path]:
    """Yield a temporary directory that replaces ``final`` only if the block completes."""
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _temp_sibling(final)
    tmp.mkdir(mode=0o700)
    try:
        yield tmp
        replace_dir(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_FULL_WORDS = ("No space left on device", "Disk quota exceeded", "errno = 28", "errno = 122")


def storage_full(error: BaseException, path: str | os.PathLike, setting: str = "run.dir") -> str | None:
    """If ``error`` (from writing under ``path``) says its file system is out of space or inodes,
    a message naming the file system, what is free and what to do; else None. HDF5 reports a
    full disk in its message, not in ``errno``, so the message is read as well."""
    if not isinstance(error, OSError):
        return None
    if error.errno not in _FULL_ERRNOS and not any(w in str(error) for w in _FULL_WORDS):
        return None
    where = Path(path)
    while not where.exists() and where != where.parent:
        where = where.parent
    try:
        st = os.statvfs(where)
        free = f"{st.f_bavail * st.f_frsize / 2**20:.1f} MB and {st.f_favail} inodes free"
    except OSError:
        free = "free space unknown"
    return (f"the file system of {path} is full ({free}; {os.strerror(error.errno if error.errno in _FULL_ERRNOS else errno.ENOSPC)}): free space "
            f"and inodes there (old run directories, workspaces under run.dir) or set {setting} to another file "
            f"system, then run again with --resume; everything recorded so far is kept")
