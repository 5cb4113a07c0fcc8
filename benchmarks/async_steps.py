"""Seconds per step and held-out accuracy after a fixed training time, for several max_staleness /
weight_sync_steps settings, on the demo recipe with its rollouts on an `rlvr vllm-serve` server.

    .venv-vllm/bin/python benchmarks/async_steps.py                       # k = 0, 1, 2, 4; 150 s each
    .venv-vllm/bin/python benchmarks/async_steps.py --seconds 60 --settings 0:1 1:1 2:1:free

Each setting is k:N (max_staleness=k, weight_sync_steps=N; N <= k, or N = 1 for k = 0), or k:N:free
for async_mode=free (a producer keeping k generations in flight; without it, lockstep).  The server
is pinned to CPU core 0 and the trainer to core 1 (`taskset`; --no-pin to leave them both on all
cores), one server for every run, each run starting from the same weights (the server is sent them
when a run starts).  Each run trains for --seconds of training time (max_train_seconds), then
evaluates the demo's 100 held-out prompts; the table prints the steps done, the mean seconds per step
after the first, the held-out accuracy before and after, and the mean trainer and sampler idle seconds
of the overlapped steps (timing/trainer_idle, timing/sampler_idle).  Needs vLLM: `make vllm`.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def pinned(core: int | None, cmd: list[str]) -> list[str]:
    return cmd if core is None or shutil.which("taskset") is None else ["taskset", "-c", str(core), *cmd]


def start_server(log: Path, core: int | None) -> tuple[subprocess.Popen, str]:
    cmd = pinned(core, [sys.executable, "-m", "rlvr.cli", "vllm-serve", "vllm_server_port=0", "vllm_server_host=127.0.0.1",
                        "vllm_kv_cache_gb=0.5", "max_prompt_length=256", "max_completion_length=256"])
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, "OMP_NUM_THREADS": "1"})
    for _ in range(600):
        found = re.search(r"(http://127\.0\.0\.1:\d+) answers 503", log.read_text())
        if found:
            url = found.group(1)
            break
        if proc.poll() is not None:
            raise SystemExit(f"rlvr vllm-serve ended:\n{log.read_text()[-3000:]}")
        time.sleep(0.5)
    else:
        proc.kill()
        raise SystemExit("rlvr vllm-serve did not say where it listens")
    for _ in range(900):
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as reply:
                if json.loads(reply.read()).get("ok"):
                    return proc, url
        except OSError:
            pass
        if proc.poll() is not None:
            raise SystemExit(f"rlvr vllm-serve ended:\n{log.read_text()[-3000:]}")
        time.sleep(1)
    proc.kill()
    raise SystemExit("rlvr vllm-serve did not load the model in 15 minutes")


def run(out: Path, url: str, k: int, n: int, seconds: float, core: int | None, mode: str = "lockstep") -> dict:
    cmd = pinned(core, [sys.executable, "-m", "rlvr.cli", "train", "demo", "use_vllm=true", "vllm_mode=server",
                        f"vllm_server_base_url={url}", f"max_staleness={k}", f"weight_sync_steps={n}", f"async_mode={mode}",
                        f"max_train_seconds={seconds}", "max_steps=1000", "save_steps=100000", "report_steps=0",
                        "eval_on_start=true", "eval_on_end=true", "max_prompt_length=256", f"output_dir={out}"])
    t0 = time.perf_counter()
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
    summary = json.loads((out / "summary.json").read_text())
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    steps = [r for r in rows if "step_time" in r]
    overlapped = [r for r in steps if "timing/trainer_idle" in r]
    mean = lambda values: sum(values) / len(values) if values else float("nan")  # noqa: E731
    return {"k": k, "N": n, "mode": mode, "steps": summary["steps"], "train_seconds": summary["train_seconds"],
            "seconds_per_step": mean([r["step_time"] for r in steps[1:]]),
            "before": summary["eval_before"]["accuracy"] if summary.get("eval_before") else None,
            "after": summary["eval_after"]["accuracy"] if summary.get("eval_after") else None,
            "trainer_idle": mean([r["timing/trainer_idle"] for r in overlapped]),
            "sampler_idle": mean([r["timing/sampler_idle"] for r in overlapped]),
            "staleness_mean": mean([r.get("sampling/staleness_mean", r.get("sampling/staleness", 0)) for r in steps]),
            "dropped_groups": sum(r.get("sampling/stale_dropped_groups", 0) for r in steps),
            "wall_seconds": round(time.perf_counter() - t0, 1)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--settings", nargs="+", default=["0:1", "1:1", "1:1:free", "2:1:free", "4:1:free"],
                    help="k:N or k:N:free")
    ap.add_argument("--seconds", type=float, default=150.0, help="training seconds of each run (max_train_seconds)")
    ap.add_argument("--no-pin", action="store_true", help="do not pin the server to core 0 and the trainer to core 1")
    ns = ap.parse_args()
    cores = (None, None) if ns.no_pin else (0, 1)
    with tempfile.TemporaryDirectory(prefix="rlvr-async-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as scratch:
        proc, url = start_server(Path(scratch) / "serve.log", cores[0])
        try:
            print(f"{'k':>2} {'N':>2} {'mode':>8} {'steps':>5} {'s/step':>7} {'before':>7} {'after':>6} {'trainer idle':>13} "
                  f"{'sampler idle':>13} {'staleness':>9} {'dropped':>7}")
            for setting in ns.settings:
                parts = setting.split(":")
                k, n, mode = int(parts[0]), int(parts[1]), parts[2] if len(parts) > 2 else "lockstep"
                r = run(Path(scratch) / f"k{k}n{n}{mode}", url, k, n, ns.seconds, cores[1], mode)
                print(f"{k:>2} {n:>2} {mode:>8} {r['steps']:>5} {r['seconds_per_step']:7.2f} {r['before']:7.2f} {r['after']:6.2f} "
                      f"{r['trainer_idle']:13.2f} {r['sampler_idle']:13.2f} {r['staleness_mean']:9.2f} {r['dropped_groups']:7}", flush=True)
                print("RESULT " + json.dumps(r), flush=True)
        finally:
            proc.terminate()
            proc.wait(timeout=60)


if __name__ == "__main__":
    main()
