"""Appending rows to a run's JSON-lines logs (metrics.jsonl, completions.jsonl, alerts.jsonl)
so that a failed write loses nothing: the rows stay with their owner until they are on disk."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def append_rows(path: Path, rows: list[dict], dump, on_error=None) -> dict | None:
    """Append `rows` to the JSON-lines file `path` and empty the list; the last row, or None.
    A write that fails leaves the list and (where it can) the file as they were, and raises; or,
    with `on_error(path, error)`, lets that decide (loop.py: a full disk with on_save_error=continue
    keeps the rows for the next write and goes on)."""
    if not rows:
        return None
    data = "".join(dump(row) + "\n" for row in rows).encode()
    fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    size = os.fstat(fd).st_size
    try:
        _write_all(fd, data)
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.ftruncate(fd, size)
        if on_error is None or not isinstance(e, OSError):
            raise
        on_error(path, e)  # raises, or keeps the rows for the next write
        return rows[-1]
    finally:
        os.close(fd)
    last = rows[-1]
    rows.clear()
    return last


def _write_all(fd: int, data: bytes) -> None:
    while data:
        data = data[os.write(fd, data):]


def sync(paths) -> None:
    """fsync each of `paths` that exists: logs are on disk before a checkpoint that counts on them."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            os.fsync(f.fileno())
