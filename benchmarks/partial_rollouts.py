"""Seconds per step, completion tokens per second and held-out accuracy after a fixed training time, with
and without partial rollouts, on the demo recipe sampled in the training process by the free-running
producer (async_mode=free).

    .venv/bin/python benchmarks/partial_rollouts.py                          # the settings below, 150 s each
    .venv/bin/python benchmarks/partial_rollouts.py --seconds 60 --settings 2:0 2:16 2:16:128

Each setting is k:P or k:P:L: max_staleness=k, partial_rollout_tokens=P (0: off), max_completion_length=L
(the demo's 48 when left out; longer lets the completions that ramble on run further, a longer tail).
Each run trains for --seconds of training time (max_train_seconds), then evaluates the demo's 100
held-out prompts (35% before training, docs/training.md).  The table prints the steps done, the mean
seconds per step after the first, completion tokens trained per second, the held-out accuracy after,
the mean trainer idle seconds per step (waiting for a generation), the sampling rounds per generation
beyond the first, the groups carried on per generation, the mean and largest staleness per token, and
the groups dropped as too old.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def run(out: Path, k: int, partial: int, length: int | None, seconds: float) -> dict:
    cmd = [sys.executable, "-m", "rlvr.cli", "train", "demo", f"max_staleness={k}", "async_mode=free",
           f"partial_rollout_tokens={partial}", f"max_train_seconds={seconds}", "max_steps=1000", "save_steps=100000",
           "report_steps=0", "eval_on_start=false", "eval_on_end=true", f"output_dir={out}",
           *([f"max_completion_length={length}"] if length else [])]
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env=os.environ)
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    steps = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if '"step_time"' in line]
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    later = steps[1:]  # the first step waits for the first generation with nothing to overlap
    return {"k": k, "partial": partial, "max_completion_length": length or 48, "steps": summary["steps"],
            "train_seconds": summary["train_seconds"], "seconds_per_step": mean([r["step_time"] for r in later]),
            "tokens_per_second": sum(r["completions/num_tokens"] for r in later) / max(sum(r["step_time"] for r in later), 1e-9),
            "after": summary["eval_after"]["accuracy"] if summary.get("eval_after") else None,
            "trainer_idle": mean([r["timing/trainer_idle"] for r in later]),
            "rounds": mean([r.get("sampling/rounds", 0) for r in steps]),
            "carried": mean([r.get("sampling/carried_groups", 0) for r in steps]),
            "staleness_mean": mean([r["sampling/staleness_mean"] for r in steps]),
            "staleness_max": max(r["sampling/staleness_max"] for r in steps),
            "dropped_groups": sum(r.get("sampling/stale_dropped_groups", 0) for r in steps),
            "wall_seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["2:0", "2:16", "2:0:128", "2:16:128"], help="k:P or k:P:L")
    ap.add_argument("--seconds", type=float, default=150.0, help="training seconds of each run (max_train_seconds)")
    ns = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="rlvr-partial-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as scratch:
        print(f"{'k':>2} {'P':>3} {'L':>4} {'steps':>5} {'s/step':>7} {'tok/s':>6} {'after':>6} {'trainer idle':>13} "
              f"{'rounds':>6} {'carried':>7} {'staleness':>9} {'max':>3} {'dropped':>7}")
        for setting in ns.settings:
            parts = [int(x) for x in setting.split(":")]
            k, partial, length = parts[0], parts[1], parts[2] if len(parts) > 2 else None
            r = run(Path(scratch) / setting.replace(":", "-"), k, partial, length, ns.seconds)
            print(f"{k:>2} {partial:>3} {r['max_completion_length']:>4} {r['steps']:>5} {r['seconds_per_step']:7.2f} "
                  f"{r['tokens_per_second']:6.1f} {r['after']:6.2f} {r['trainer_idle']:13.2f} {r['rounds']:6.2f} "
                  f"{r['carried']:7.2f} {r['staleness_mean']:9.2f} {r['staleness_max']:3} {r['dropped_groups']:7}", flush=True)
            print("RESULT " + json.dumps(r), flush=True)


if __name__ == "__main__":
    main()
