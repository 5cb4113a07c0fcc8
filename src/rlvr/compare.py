"""Eval results side by side: `rlvr compare A B ...`.

Each argument is an eval.json written by `rlvr eval` (one result object, or
{"results": [...]} for several tasks; the trainer's eval_before.json /
eval_after.json work too), or a run directory holding an eval.json.  The table
has one column per argument and one row per task and metric: accuracy first,
then pass@k and maj@k as far as any of the results has them (mean@k is the
accuracy of a result with k samples).
"""

from __future__ import annotations

import json
import math
import re
from pathlib import Path

REQUIRED_KEYS = ("accuracy",)
UNNAMED_TASK = "held-out"


class EvalFileError(ValueError):
    pass


def load_results(arg: str) -> list[dict]:
    """The result objects of one eval.json (or of <run dir>/eval.json)."""
    path = Path(arg).expanduser()
    if path.is_dir():
        if not (path / "eval.json").is_file():
            raise FileNotFoundError(f"{path} holds no eval.json; run `rlvr eval model={path}` first")
        path = path / "eval.json"
    elif not path.is_file():
        raise FileNotFoundError(f"eval result not found: {path} (give an eval.json or a run directory)")
    try:
        data = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EvalFileError(f"{path} is not valid JSON ({e}); expected the eval.json that `rlvr eval` writes") from None
    results = data.get("results") if isinstance(data, dict) and "results" in data else [data]
    if not isinstance(results, list) or not results:
        raise EvalFileError(f"{path}: \"results\" must be a non-empty list of eval results")
    for i, result in enumerate(results):
        where = path if len(results) == 1 else f"{path} (result {i})"
        if not isinstance(result, dict):
            raise EvalFileError(f"{where}: expected an eval result object, got {type(result).__name__}")
        missing = [key for key in REQUIRED_KEYS if key not in result]
        if missing:
            raise EvalFileError(f"{where} is not an `rlvr eval` result: missing key(s) {', '.join(map(repr, missing))}")
    return results


def column_labels(args: list[str]) -> list[str]:
    """Short names for the columns: a run directory's name, or the file's (its directory's for eval.json)."""
    labels = []
    for arg in args:
        path = Path(arg)
        labels.append(path.parent.name if path.name == "eval.json" and path.parent.name else (path.stem or arg))
    return labels if len(set(labels)) == len(labels) else list(args)


def compare_rows(columns: list[list[dict]]) -> list[tuple[str, str, list[float | None]]]:
    """(task, metric, value per column or None) for every task and metric any column has, in first-seen order."""
    tasks: dict[str, list[dict | None]] = {}
    for c, results in enumerate(columns):
        for result in results:
            cells = tasks.setdefault(str(result.get("task") or UNNAMED_TASK), [None] * len(columns))
            cells[c] = result
    rows = []
    for task, cells in tasks.items():
        names = ["accuracy"]
        for result in cells:
            names += [m for m in (result or {}).get("at_k", {}) if m not in names and not m.startswith("mean@")]
        for name in sorted(names, key=metric_order):
            rows.append((task, name, [_value(result, name) for result in cells]))
    return rows


def format_cell(value: float | None) -> str:
    return "-" if value is None or (isinstance(value, float) and math.isnan(value)) else f"{value:.1%}"


def _value(result: dict | None, name: str) -> float | None:
    if result is None:
        return None
    value = result["accuracy"] if name == "accuracy" else result.get("at_k", {}).get(name)
    return float(value) if isinstance(value, (int, float)) else None


def metric_order(name: str) -> tuple[int, int]:
    match = re.fullmatch(r"(pass|maj|mean)@(\d+)", name)
    if match is None:
        return (0, 0)
    return ({"pass": 1, "maj": 2, "mean": 3}[match[1]], int(match[2]))
