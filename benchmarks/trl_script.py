"""One TRL script, run twice: with `from trl import GRPOConfig, GRPOTrainer` and with
`from rlvr import GRPOConfig, GRPOTrainer`, nothing else changed.  Prints the seconds per
step of each and the ratio per completion token (the two libraries sample different
completions, so their lengths differ).

    pip install -e ".[bench]"                       # TRL, a benchmark-only dependency
    python benchmarks/trl_script.py                 # both (about 10 minutes on 2 CPU cores)
    python benchmarks/trl_script.py --only rlvr     # one of them

The script (SCRIPT below) is the quick start of TRL's documentation grown to a real run: the
default model loaded once and given as a model object (TRL cannot load rlvr's embedded GGUF by
name), a datasets.Dataset of arithmetic prompts, a reward function, and a GRPOConfig with 4
prompts x 8 completions per step, max_completion_length 64, temperature 0.8, top_p 0.9,
beta 0, fp32 on the CPU.  Each library runs in its own process; the first --warmup steps are not
timed (a TrainerCallback takes the time at each on_step_end, in both).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

SCRIPT = '''
import time
from datasets import Dataset
from transformers import TrainerCallback
from {library} import GRPOConfig, GRPOTrainer

from rlvr.models import load_model

def reward_len(completions, **kwargs):
    """Every completion a different score, so every group carries signal and both do the full update."""
    return [min(len(c), 300) / 100.0 for c in completions]

class StepTimes(TrainerCallback):
    def __init__(self):
        self.times = []
    def on_step_end(self, args, state, control, **kwargs):
        self.times.append(time.perf_counter())

model, tokenizer, _ = load_model("default")
dataset = Dataset.from_list([{{"prompt": f"What is {{a}} + {{b}}? Answer with the number."}}
                             for a in range(10, 40) for b in range(3, 7)])
training_args = GRPOConfig(
    output_dir="{output_dir}", max_steps={steps}, per_device_train_batch_size=8, gradient_accumulation_steps=4,
    num_generations=8, max_completion_length=64, temperature=0.8, top_p=0.9, learning_rate=1e-6, beta=0.0,
    logging_steps=1, save_strategy="no", report_to="none", use_cpu=True, bf16=False, gradient_checkpointing=False,
    seed=42,
)
timer = StepTimes()
trainer = GRPOTrainer(model=model, reward_funcs=reward_len, args=training_args, train_dataset=dataset,
                      processing_class=tokenizer, callbacks=[timer])
start = time.perf_counter()
trainer.train()
lengths = [row["completions/mean_length"] for row in trainer.state.log_history if "completions/mean_length" in row]
print("RESULT", {{"step_ends": [t - start for t in timer.times], "mean_lengths": lengths}})
'''


def run(library: str, steps: int) -> dict:
    with tempfile.TemporaryDirectory(prefix=f"trl-script-{library}-") as tmp:
        script = Path(tmp) / "script.py"
        script.write_text(SCRIPT.format(library=library, output_dir=Path(tmp) / "out", steps=steps))
        env = {**os.environ, "PYTHONUNBUFFERED": "1", "TOKENIZERS_PARALLELISM": "false"}
        proc = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, env=env, cwd=tmp)
    line = next((x for x in proc.stdout.splitlines() if x.startswith("RESULT ")), None)
    if proc.returncode or line is None:
        raise SystemExit(f"{library} failed ({proc.returncode}):\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    import ast

    return ast.literal_eval(line[len("RESULT "):])


def summarize(result: dict, warmup: int) -> dict:
    ends = result["step_ends"]
    step_times = [b - a for a, b in zip(ends[warmup - 1:], ends[warmup:])] if warmup else [ends[0], *[b - a for a, b in zip(ends, ends[1:])]]
    lengths = result["mean_lengths"][warmup:]
    seconds = statistics.median(step_times)
    tokens = 32 * statistics.mean(lengths)  # 4 prompts x 8 completions
    return {"seconds_per_step": seconds, "completion_tokens_per_step": tokens, "seconds_per_completion_token": seconds / tokens,
            "steps_timed": len(step_times)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=5, help="steps timed")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--only", choices=["trl", "rlvr"])
    parser.add_argument("--json", help="write the numbers here")
    args = parser.parse_args()
    libraries = [args.only] if args.only else ["trl", "rlvr"]
    out = {lib: summarize(run(lib, args.steps + args.warmup), args.warmup) for lib in libraries}
    for lib, r in out.items():
        print(f"{lib:5s} {r['seconds_per_step']:7.2f} s/step  {r['completion_tokens_per_step']:6.0f} completion tokens/step  "
              f"{r['seconds_per_completion_token'] * 1000:6.1f} ms per completion token  (median of {r['steps_timed']} steps)")
    if len(out) == 2:
        out["rlvr_vs_trl_per_completion_token"] = out["trl"]["seconds_per_completion_token"] / out["rlvr"]["seconds_per_completion_token"]
        out["rlvr_vs_trl_per_step"] = out["trl"]["seconds_per_step"] / out["rlvr"]["seconds_per_step"]
        print(f"rlvr vs TRL: {out['rlvr_vs_trl_per_completion_token']:.2f}x per completion token, "
              f"{out['rlvr_vs_trl_per_step']:.2f}x per step")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
