"""Appending rows to a run's JSON-lines logs (metrics.jsonl, completions.jsonl, alerts.jsonl)
so that a failed write loses nothing: the rows stay with their owner until they are on disk."""

from __future__ import annotations

import contextlib
import os
from pathlib import Path


def append_rows(path: Path, rows: list[dict], dump, on_error=None) -> dict | None:
    """Append `rows` to the JSON-lines file `path` and empty the list; the last row, or None.
    A write that fails leaves the list and (where it can) the file as they were, and raises; or,
    with `on_error(path, error)`, lets that decide (run.py: a full disk with on_save_error=continue
    keeps the rows for the next write and goes on)."""
    if not rows:
        return None
    data = "".join(dump(row) + "\n" for row in rows).encode()
    with path.open("ab", buffering=0) as f:
        size = f.tell()
        try:
            done = 0
            while done < len(data):
                done += f.write(data[done:])
        except BaseException as e:
            with contextlib.suppress(OSError):
                f.truncate(size)
            if on_error is None or not isinstance(e, OSError):
                raise
            on_error(path, e)  # raises, or keeps the rows for the next write
            return rows[-1]
    last = rows[-1]
    rows.clear()
    return last


def sync(paths) -> None:
    """fsync each of `paths` that exists: logs are on disk before a checkpoint that counts on them."""
    for path in paths:
        with contextlib.suppress(FileNotFoundError), open(path, "rb") as f:
            os.fsync(f.fileno())
