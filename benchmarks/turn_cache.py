"""Seconds per step of the tools demo (`rlvr train tools_demo`) with and without the turn cache: with it
(turn_cache=true, the default) a rollout's later turn runs only its new tokens (the observation and what
follows) on the keys and values kept from its turn before; without it the sampler prefills the rollout's
whole history again every turn (docs/multiturn.md).

    .venv/bin/python benchmarks/turn_cache.py               # 30 steps each, about 20 minutes on 2 cores
    .venv/bin/python benchmarks/turn_cache.py --steps 2     # a quick check that it runs

Both runs train the recipe from the same seed for --steps steps, without evaluation.  Printed: the machine
and the date; per run the seconds of the first step and of the step where the most completions call the
tool (tools/calls_per_completion, its first such step in the run without the cache), each as the whole step
(step_time) and its sampling (timing/rollout), and the mean step; the ratios without / with; and whether
the two runs sampled the same completions (every completion of every step is logged: its turns' texts,
finish reason and reward).  Take the ratios from a quiet machine: other work on it moves them.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]


def machine() -> str:
    cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                if line.startswith("model name")), platform.processor()) if Path("/proc/cpuinfo").exists() else platform.processor()
    return f"{cpu}, {os.cpu_count()} cores, torch {torch.__version__} ({torch.get_num_threads()} threads)"


def run(out: Path, turn_cache: bool, steps: int) -> tuple[dict[int, dict], list[dict]]:
    """Train the tools demo for `steps` steps; (the metrics of each step, every logged completion)."""
    cmd = [sys.executable, "-m", "rlvr.cli", "train", "tools_demo", f"turn_cache={str(turn_cache).lower()}",
           f"max_steps={steps}", "max_train_seconds=0", "eval_on_start=false", "eval_on_end=false", "report_steps=0",
           "save_steps=100000", "num_completions_to_print=null", f"output_dir={out}"]
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    metrics: dict[int, dict] = {}
    for line in (out / "metrics.jsonl").read_text().splitlines():
        row = json.loads(line)
        if "step" in row:
            metrics.setdefault(row["step"], {}).update(row)
    completions = [json.loads(line) for line in (out / "completions.jsonl").read_text().splitlines()]
    return {s: m for s, m in metrics.items() if "step_time" in m}, completions


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=30, help="training steps of each run")
    ns = ap.parse_args()
    print(f"{datetime.date.today()}  {machine()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="rlvr-turn-cache-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as scratch:
        off, off_samples = run(Path(scratch) / "off", False, ns.steps)
        on, on_samples = run(Path(scratch) / "on", True, ns.steps)
    first = min(off)
    calls = {s: m.get("tools/calls_per_completion", 0.0) for s, m in off.items()}
    busiest = max(calls, key=lambda s: (calls[s], -s))
    print(f"{'turn_cache':>10} {'step':>4} {'calls/completion':>16} {'s/step':>7} {'sampling s':>10}")
    for name, metrics in (("false", off), ("true", on)):
        for s in sorted({first, busiest}):
            m = metrics[s]
            print(f"{name:>10} {s:>4} {m.get('tools/calls_per_completion', 0.0):16.2f} {m['step_time']:7.2f} "
                  f"{m.get('timing/rollout', float('nan')):10.2f}")
        print(f"{name:>10} mean {'':>16} {sum(m['step_time'] for m in metrics.values()) / len(metrics):7.2f}")
    for s in sorted({first, busiest}):
        print(f"step {s}: without / with the turn cache {off[s]['step_time'] / on[s]['step_time']:.2f}x a step, "
              f"{off[s].get('timing/rollout', float('nan')) / on[s].get('timing/rollout', float('nan')):.2f}x its sampling")
    same = sum(a == b for a, b in zip(off_samples, on_samples))
    print(f"same completions: {same} of {len(off_samples)} (texts of every turn, finish reasons, rewards)"
          + ("" if len(off_samples) == len(on_samples) else f"; the runs logged {len(off_samples)} and {len(on_samples)}"))
    print("RESULT " + json.dumps({"steps": ns.steps, "first": first, "busiest": busiest, "off": off, "on": on,
                                  "same_completions": same, "completions": len(off_samples)}), flush=True)


if __name__ == "__main__":
    main()
