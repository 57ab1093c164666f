"""Durable file writes: the one place that does temp + fsync + rename.

A crash at any instant leaves either the old file or the new one, never a torn mix, and the
rename itself is made durable by fsyncing the directory. Every state file Gyre's resume logic
reads (state.json, cells.json, ledgers' checkpoints, weights manifests) goes through here.
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any


def fsync_path(path: str | os.PathLike) -> None:
    """fsync a file or directory by path."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write_bytes(path: str | os.PathLike, data: bytes, *, mode: int = 0o600) -> Path:
    """Write `data` to `path` atomically and durably; the file is private (0600) by default."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.parent / f".{path.name}.tmp-{uuid.uuid4().hex[:8]}"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, mode)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_path(path.parent)
    return path


def atomic_write_text(path: str | os.PathLike, text: str, *, mode: int = 0o600) -> Path:
    return atomic_write_bytes(path, text.encode(), mode=mode)


def atomic_write_json(path: str | os.PathLike, obj: Any, *, mode: int = 0o600, indent: int | None = None) -> Path:
    return atomic_write_bytes(path, json.dumps(obj, indent=indent).encode(), mode=mode)
