"""The guide's comparison table, made with rlvr alone: base vs SFT vs RFT vs DPO vs GRPO vs
SFT->GRPO, each trained for the same wall-clock budget on this machine, each evaluated by the
same `rlvr eval` (greedy pass@1, and pass@k / maj@k of k samples), shown by `rlvr compare`.

    python benchmarks/guide_table.py --budget 150 --out runs/guide-table

Runs and evaluations already finished in --out are kept, so an interrupted table continues.

Tasks: the built-in arithmetic task as the demo trains it (src/rlvr/configs/demo.yaml), and the
GSM8K-format file tests/data/gsm8k_style (400 train / 100 test word problems, worked solutions
ending in `#### N`; benchmarks/gsm8k_style.py).  Methods and what they train on:

    base       the default model, untrained
    sft        rlvr sft on the task's worked solutions (arithmetic: Task.solution; GSM8K: `answer`)
    rft        rlvr rft: rounds of num_generations samples per prompt, the verifier-correct ones kept
    dpo        rlvr dpo self_samples=true: pairs of a correct and an incorrect sample per prompt
    grpo       rlvr train
    sft-grpo   rlvr sft for half the budget, then rlvr train from it for the other half

Every run stops at max_train_seconds (the budget, counted from its first step, without model
loading); the schedule is constant so that stopping early does not change what a step does.
Learning rates: 2e-5 for SFT, RFT and GRPO (TRL's SFTConfig default, and the demo's GRPO
rate), 5e-6 for DPO (TRL's DPOConfig default is 1e-6, meant for far longer runs; its pairwise
loss moves log-ratios faster than the token losses, hence a lower rate than the others).  The runs go one after another: run it on a quiet
machine, since a busy one gives a method fewer steps in the same budget.
"""

from __future__ import annotations

import argparse
import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

RLVR = [sys.executable, "-m", "rlvr"]
GSM8K = str(Path(__file__).resolve().parent.parent / "tests" / "data" / "gsm8k_style")
TASKS = {
    "arithmetic": {"config": "demo", "settings": ["eval_max_examples=100"]},
    "gsm8k": {"config": None, "settings": [
        f"dataset={GSM8K}", "max_completion_length=128", "stop_strings=[]", "eval_max_examples=50",
        "system_prompt=Solve the problem step by step. End with a line of the form '#### <number>'.",
        "num_generations=8", "per_device_train_batch_size=16", "temperature=0.8", "top_p=0.9"]},
}
COMMON = ["lr_scheduler_type=constant", "max_steps=100000", "save_strategy=no", "eval_on_start=false", "eval_on_end=false",
          "logging_steps=5", "report_steps=0"]
METHODS = {  # name -> [(command, extra settings, share of the budget)]
    "sft": [("sft", ["learning_rate=2e-5", "per_device_train_batch_size=8"], 1.0)],
    "rft": [("rft", ["learning_rate=2e-5", "per_device_train_batch_size=8", "self_round_prompts=8", "self_round_steps=4"], 1.0)],
    "dpo": [("dpo", ["self_samples=true", "learning_rate=5e-6", "per_device_train_batch_size=4", "self_round_prompts=8",
                     "self_round_steps=4"], 1.0)],
    "grpo": [("train", ["learning_rate=2e-5"], 1.0)],
    "sft-grpo": [("sft", ["learning_rate=2e-5", "per_device_train_batch_size=8"], 0.5), ("train", ["learning_rate=2e-5"], 0.5)],
}


def run(cmd: list[str], log: Path) -> None:
    t0 = time.perf_counter()
    log.parent.mkdir(parents=True, exist_ok=True)
    with log.open("w") as f:
        done = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT)
    print(f"  {' '.join(cmd[2:4])} ... {time.perf_counter() - t0:.0f}s", flush=True)
    if done.returncode:
        sys.exit(f"failed ({done.returncode}): {' '.join(cmd)}\n{log.read_text()[-3000:]}")


def train(task: str, method: str, budget: float, out: Path) -> str:
    """Train `method` on `task` within `budget` seconds; the model directory."""
    spec, model = TASKS[task], "default"
    for i, (command, extra, share) in enumerate(METHODS[method]):
        run_dir = out / task / (method if len(METHODS[method]) == 1 else f"{method}-{i}")
        start, model = model, str(run_dir)  # each stage starts from the one before
        if (run_dir / "summary.json").is_file():  # finished by an earlier invocation with the same --out
            print(f"  {command}: kept {run_dir}", flush=True)
            continue
        args = ([spec["config"]] if spec["config"] else []) + spec["settings"] + COMMON + extra + [
            f"model={start}", f"output_dir={run_dir}", f"max_train_seconds={budget * share:g}"]
        run([*RLVR, command, *args], run_dir.with_suffix(".log"))
        for checkpoint in run_dir.glob("checkpoint-*"):  # the stop at the budget saves one; the final model is what is evaluated
            shutil.rmtree(checkpoint)
        summary = json.loads((run_dir / "summary.json").read_text())
        print(f"    {summary['steps']} steps in {summary['train_seconds']}s", flush=True)
    return model


def evaluate(task: str, model: str, out: Path, k: int) -> dict:
    """Greedy pass@1 and k samples at temperature 0.7 on the task's test split: one result each."""
    spec, results = TASKS[task], []
    for how, settings in (("greedy", ["eval_num_samples=1", "eval_temperature=0"]),
                          (f"{k} samples", [f"eval_num_samples={k}", "eval_temperature=0.7"])):
        path = out / task / f"eval-{Path(model).name}-{how.split()[0]}.json"
        args = ([spec["config"]] if spec["config"] and model == "default" else []) + spec["settings"] + settings
        if not path.is_file():  # else kept from an earlier invocation with the same --out
            run([*RLVR, "eval", f"model={model}", *args, f"eval_output={path}"], path.with_suffix(".log"))
        data = json.loads(path.read_text())
        result = data["results"][0] if "results" in data else data
        result["task"] = f"{task} ({how})"
        results.append(result)
    return {"results": results}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--budget", type=float, default=150, help="training seconds per method and task")
    ap.add_argument("--out", type=Path, default=Path("runs/guide-table"))
    ap.add_argument("--tasks", default="arithmetic,gsm8k")
    ap.add_argument("--methods", default="base,sft,rft,dpo,grpo,sft-grpo")
    ap.add_argument("-k", type=int, default=4, help="samples per problem for pass@k")
    a = ap.parse_args()
    columns: dict[str, list] = {}
    for task in a.tasks.split(","):
        for method in a.methods.split(","):
            print(f"{task} / {method}", flush=True)
            model = "default" if method == "base" else train(task, method, a.budget, a.out)
            columns.setdefault(method, []).extend(evaluate(task, model, a.out, a.k)["results"])
    files = []
    for method, results in columns.items():  # one eval.json per method, both tasks: one column of the table
        (a.out / method).mkdir(parents=True, exist_ok=True)
        (a.out / method / "eval.json").write_text(json.dumps({"results": results}, indent=1))
        files.append(str(a.out / method))
    print(f"budget {a.budget:g} s of training per method and task; rlvr compare {' '.join(files)}")
    subprocess.run([*RLVR, "compare", *files], check=True)


if __name__ == "__main__":
    main()
