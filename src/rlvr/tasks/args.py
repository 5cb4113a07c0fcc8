"""What the built-in tasks share in reading their task_args."""

from __future__ import annotations


def with_defaults(args: dict, defaults: dict) -> dict:
    """`args` over the task's `defaults`; a key the task does not have is an error that lists its keys."""
    unknown = set(args) - set(defaults)
    if unknown:
        raise ValueError(f"unknown key(s) {sorted(unknown)}; known: {sorted(defaults)}")
    return {**defaults, **args}
