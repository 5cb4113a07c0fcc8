"""rlvr against TRL's GRPOTrainer, and rlvr's sampler against transformers' generate, on this machine.

    python benchmarks/speed.py                      # everything: fp32 and bf16, TRL included (~25 min on 2 cores)
    python benchmarks/speed.py --precisions fp32 --steps 5 --json out.json
    python benchmarks/speed.py --skip-trl          # rlvr's numbers and the rollout table only

Table 1, GRPO steps (ratio: seconds per completion token, TRL / rlvr): the default model (SmolLM2-135M-Instruct), 4 prompts x G=8
completions per step, max_completion_length 64, temperature 0.8, top_p 0.9,
beta 0, one update per step, the same prompts and seed and the same reward
function.  Each trainer runs in its own process launch; `--warmup` steps are
run and not timed, then `--steps` are measured.  The reward gives every
completion a different score (its length in characters / 100), so no group is
skipped for lack of signal and both trainers do the full update.
Peak memory is the process's peak resident set (VmHWM) on the CPU, and the peak of
memory allocated by torch on a GPU.  Both trainers run on a CUDA GPU when one is visible
(`--device cpu` keeps them on the CPU).

Table 2, rollout: tokens per second of the rlvr sampler and of
`model.generate` at batch 8, 32 and 64 (8 completions per prompt, same sampling
settings, 64 new tokens each, end-of-sequence ignored so both produce the same
number of tokens), and both as a fraction of the machine's roofline: the
matmul FLOP/s measured in the same run divided by the model's FLOPs per token
(2 x parameters).

Update peak fraction: FLOPs of rlvr's forward + backward (6 x parameters per
token processed; each group's prompt once, the output layer only where a
completion token is predicted) per second of update time, divided by the
matmul FLOP/s of that precision.

TRL is a benchmark-only dependency: pip install -e ".[bench]".
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

PROMPTS_PER_STEP, GROUP, MAX_NEW, TEMPERATURE, TOP_P, SEED = 4, 8, 64, 0.8, 0.9, 42
DEVICE = "cpu"  # set by main() from --device


def synchronize() -> None:
    import torch

    if DEVICE.startswith("cuda"):
        torch.cuda.synchronize()


def bench_reward(completions, **kwargs):
    """Every completion a different score, so every group carries signal."""
    texts = [c if isinstance(c, str) else c[-1]["content"] for c in completions]
    return [min(len(t), 300) / 100.0 for t in texts]


def prompts(n: int) -> list[str]:
    from rlvr.tasks.arithmetic import ArithmeticTask

    train, _ = ArithmeticTask.splits({"digits": 2, "operands": 2, "operators": "+-", "num_train": n, "num_test": 10,
                                      "template": "boxed"}, SEED)
    return [ex.prompt for ex in train]


def peak_memory_mb() -> float:
    import torch

    if DEVICE.startswith("cuda"):
        return torch.cuda.max_memory_allocated() / 2**20
    return peak_rss_mb()


def peak_rss_mb() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


# --- one trainer per process ---------------------------------------------------------------


def run_rlvr(precision: str, warmup: int, steps: int) -> dict:
    import torch

    from rlvr.config import build_config
    from rlvr.models import default_model_dir, load_model
    from rlvr.trainer import Trainer
    from rlvr.types import Example

    torch.manual_seed(SEED)
    cfg = build_config({
        "model": str(default_model_dir()),
        "reward_funcs": [f"{Path(__file__).resolve()}:bench_reward"],
        "num_generations": GROUP, "per_device_train_batch_size": PROMPTS_PER_STEP * GROUP,
        "max_completion_length": MAX_NEW, "temperature": TEMPERATURE, "top_p": TOP_P,
        "learning_rate": 1e-6, "beta": 0.0, "num_iterations": 1, "seed": SEED, "bf16": precision == "bf16",
        "task_args": {"num_test": 10},
    })
    model, tokenizer, _ = load_model(cfg.model, device=DEVICE)
    examples = [Example(p, None) for p in prompts(PROMPTS_PER_STEP * (warmup + steps))]
    with tempfile.TemporaryDirectory() as out:
        trainer = Trainer(cfg, model, tokenizer, examples, out, total_steps=warmup + steps)
        trainer.prompts.take = _in_order(examples)  # the same prompts, in the same order, as TRL gets
        rows = []
        for i in range(warmup + steps):
            m = trainer.train_step()
            if i >= warmup:
                rows.append(m)
    n = len(rows)
    update_tokens = sum(m["update_tokens"] for m in rows)
    return {
        "seconds_per_step": sum(m["step_time"] for m in rows) / n,
        "completion_tokens_per_step": sum(m["completions/num_tokens"] for m in rows) / n,
        "rollout_seconds": sum(m["timing/rollout"] for m in rows) / n,
        "reward_seconds": sum(m["timing/reward"] for m in rows) / n,
        "update_seconds": sum(m["timing/update"] for m in rows) / n,
        "update_flops": sum(m["update_flops"] for m in rows) / n,
        "update_tokens_per_step": update_tokens / n,
        "peak_memory_mb": peak_memory_mb(),
    }


def _in_order(examples):
    position = {"next": 0}

    def take(k):
        out = examples[position["next"] : position["next"] + k]
        position["next"] += k
        return out

    return take


def run_trl(precision: str, warmup: int, steps: int) -> dict:
    import torch
    from datasets import Dataset
    from transformers import TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from rlvr.models import default_model_dir

    torch.manual_seed(SEED)
    times, logs = [], []

    class Clock(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            times.append(time.perf_counter() - self.start)

        def on_log(self, args, state, control, logs=None, **kw):
            if logs and "completions/mean_length" in logs:
                logs_seen.append(dict(logs))

    logs_seen = logs
    data = Dataset.from_list([{"prompt": [{"role": "user", "content": p}]} for p in prompts(PROMPTS_PER_STEP * (warmup + steps))])
    with tempfile.TemporaryDirectory() as out:
        args = GRPOConfig(
            output_dir=out, per_device_train_batch_size=PROMPTS_PER_STEP * GROUP, num_generations=GROUP,
            gradient_accumulation_steps=1, max_completion_length=MAX_NEW, temperature=TEMPERATURE, top_p=TOP_P,
            beta=0.0, num_iterations=1, learning_rate=1e-6, max_steps=warmup + steps, logging_steps=1,
            report_to="none", save_strategy="no", use_cpu=DEVICE == "cpu", bf16=precision == "bf16", seed=SEED,
            gradient_checkpointing=False, shuffle_dataset=False, disable_tqdm=True,
        )
        trainer = GRPOTrainer(model=str(default_model_dir()), reward_funcs=bench_reward, args=args, train_dataset=data,
                              callbacks=[Clock()])
        trainer.train()
    measured = times[warmup:]
    lengths = [l["completions/mean_length"] * PROMPTS_PER_STEP * GROUP for l in logs][warmup:]
    return {
        "seconds_per_step": sum(measured) / len(measured),
        "completion_tokens_per_step": sum(lengths) / len(lengths) if lengths else float("nan"),
        "peak_memory_mb": peak_memory_mb(),
    }


# --- rollout throughput, in one process ------------------------------------------------------


def matmul_flops(dtype, n: int = 2048, repeat: int = 5) -> float:
    import torch

    if DEVICE.startswith("cuda"):
        n, repeat = 8192, 20  # a GPU needs a bigger product to reach its peak
    a, b = torch.randn(n, n, dtype=dtype, device=DEVICE), torch.randn(n, n, dtype=dtype, device=DEVICE)
    a @ b
    synchronize()
    start = time.perf_counter()
    for _ in range(repeat):
        a @ b
    synchronize()
    return 2 * n**3 * repeat / (time.perf_counter() - start)


def run_rollout(precisions: list[str], batches: list[int]) -> dict:
    """transformers' generate first, as a user runs it; then rlvr's sampler (which tunes the
    allocator for the process, see rlvr/runtime.py)."""
    import contextlib

    import torch

    from rlvr.chat import encode_prompts
    from rlvr.models import load_model
    from rlvr.rollout import SamplingParams
    from rlvr.rollout.engine import make_sampler

    model, tokenizer, _ = load_model("default", device=DEVICE)
    model.eval()
    params_count = sum(p.numel() for p in model.parameters())  # tied embeddings counted once
    flops_per_token = 2 * params_count
    ids = encode_prompts(tokenizer, prompts(max(batches) // GROUP), None, None)
    out = {"flops_per_token": flops_per_token, "rows": []}
    cases = [(p, b) for p in precisions for b in batches]
    for precision in precisions:
        out[f"matmul_flops_{precision}"] = matmul_flops(torch.bfloat16 if precision == "bf16" else torch.float32)
    generate_speed = {}
    for precision, batch in cases:
        chunk = ids[: batch // GROUP]
        width = max(len(p) for p in chunk)
        x = torch.tensor([[tokenizer.pad_token_id] * (width - len(p)) + p for p in chunk]).to(DEVICE)
        attention = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in chunk])[:, None]).long().to(DEVICE)
        autocast = torch.autocast(DEVICE.split(":")[0], dtype=torch.bfloat16) if precision == "bf16" else contextlib.nullcontext()

        def generate(new):
            with torch.inference_mode(), autocast:
                model.generate(x, attention_mask=attention, do_sample=True, temperature=TEMPERATURE, top_p=TOP_P,
                               max_new_tokens=new, min_new_tokens=new, num_return_sequences=GROUP,
                               pad_token_id=tokenizer.pad_token_id)

        generate(4)
        synchronize()
        start = time.perf_counter()
        generate(MAX_NEW)
        synchronize()
        generate_speed[precision, batch] = batch * MAX_NEW / (time.perf_counter() - start)
        print(f"  generate {precision} batch {batch}: {generate_speed[precision, batch]:.0f} tok/s", file=sys.stderr, flush=True)
    def sample(precision, batch, **kw) -> float:
        chunk = ids[: batch // GROUP]
        sampler = make_sampler(model, tokenizer, eos_token_ids=[], max_batch_size=max(64, batch), bf16=precision == "bf16", **kw)
        sampler.generate(chunk, SamplingParams(n=GROUP, max_tokens=4, temperature=TEMPERATURE, top_p=TOP_P))
        synchronize()
        start = time.perf_counter()
        groups = sampler.generate(chunk, SamplingParams(n=GROUP, max_tokens=MAX_NEW, temperature=TEMPERATURE, top_p=TOP_P),
                                  torch.Generator().manual_seed(SEED))
        synchronize()
        return sum(len(r.completion_ids) for g in groups for r in g) / (time.perf_counter() - start)

    for precision, batch in cases:
        ours = sample(precision, batch)
        hf = generate_speed[precision, batch]
        roofline = out[f"matmul_flops_{precision}"] / flops_per_token
        row = {"precision": precision, "batch": batch, "generate_tokens_per_s": hf, "rlvr_tokens_per_s": ours,
               "speedup": ours / hf, "generate_roofline_fraction": hf / roofline, "rlvr_roofline_fraction": ours / roofline}
        if DEVICE.startswith("cuda"):  # the same sampler launching each kernel (no CUDA graphs)
            row["rlvr_eager_tokens_per_s"] = sample(precision, batch, cuda_graphs=False)
        out["rows"].append(row)
        print(f"  rlvr {precision} batch {batch}: {ours:.0f} tok/s", file=sys.stderr, flush=True)
    return out


# --- driver ------------------------------------------------------------------------------------


def in_subprocess(kind: str, precision: str, warmup: int, steps: int) -> dict:
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        cmd = [sys.executable, __file__, "--worker", kind, "--precision", precision, "--warmup", str(warmup),
               "--steps", str(steps), "--worker-out", f.name, "--device", DEVICE]
        print(f"  running {kind} {precision} ({warmup} warm-up + {steps} measured steps)...", file=sys.stderr, flush=True)
        result = subprocess.run(cmd, stdout=sys.stderr, stderr=sys.stderr)
        if result.returncode != 0:
            return {"error": f"{kind} {precision} exited with status {result.returncode}"}
        return json.loads(Path(f.name).read_text())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precisions", nargs="+", default=["fp32", "bf16"], choices=["fp32", "bf16"])
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--batches", type=int, nargs="+", default=[8, 32, 64])
    parser.add_argument("--skip-trl", action="store_true")
    parser.add_argument("--json", help="also write the numbers as one JSON object to this path")
    parser.add_argument("--device", default="auto", help="cpu, cuda:0, ... (default: cuda:0 when a GPU is visible, else cpu)")
    parser.add_argument("--worker", choices=["rlvr", "trl"], help=argparse.SUPPRESS)
    parser.add_argument("--precision", default="fp32", help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    global DEVICE
    if args.device == "auto":
        from rlvr.distributed import pick_device

        DEVICE = pick_device()
    else:
        DEVICE = args.device

    if args.worker:
        run = run_rlvr if args.worker == "rlvr" else run_trl
        Path(args.worker_out).write_text(json.dumps(run(args.precision, args.warmup, args.steps)))
        return

    steps = {}
    for precision in args.precisions:
        steps[precision] = {"rlvr": in_subprocess("rlvr", precision, args.warmup, args.steps)}
        if not args.skip_trl:
            steps[precision]["trl"] = in_subprocess("trl", precision, args.warmup, args.steps)
    rollout = run_rollout(args.precisions, args.batches)
    report = summarize(steps, rollout)
    report["device"] = DEVICE
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def summarize(steps: dict, rollout: dict) -> dict:
    report = {"steps": steps, "rollout": rollout}
    for precision, pair in steps.items():
        r, t = pair.get("rlvr", {}), pair.get("trl", {})
        if "seconds_per_step" in r:
            peak = rollout.get(f"matmul_flops_{precision}")
            if peak:
                r["update_peak_fraction"] = r["update_flops"] / r["update_seconds"] / peak
                # The whole step against the machine's limit: its FLOPs (the update's, plus 2 x parameters
                # per sampled token; the prompts' prefill is left out, so this is a lower bound) at the
                # matmul peak measured in this run, over the step's seconds.
                r["step_flops"] = r["update_flops"] + r["completion_tokens_per_step"] * rollout["flops_per_token"]
                r["step_limit_fraction"] = r["step_flops"] / peak / r["seconds_per_step"]
        if "seconds_per_step" in r and "seconds_per_step" in t:
            # The two runs sample different completions: compare seconds per completion token,
            # i.e. seconds per step for the same number of completion tokens.
            per_token = lambda m: m["seconds_per_step"] / m["completion_tokens_per_step"]  # noqa: E731
            pair["speedup"] = per_token(t) / per_token(r)
    ratios = {p: pair["speedup"] for p, pair in steps.items() if "speedup" in pair}
    if ratios:  # the headline compares like with like (the same precision), and takes the lower ratio
        report["step_speedup_vs_trl"] = min(ratios.values())
    at32 = [row for row in rollout["rows"] if row["batch"] == 32]
    if at32:
        report["rollout_speedup_vs_generate"] = min(row["speedup"] for row in at32)
        report["rollout_roofline_fraction"] = min(row["rlvr_roofline_fraction"] for row in at32)
    fractions = [pair["rlvr"]["update_peak_fraction"] for pair in steps.values() if "update_peak_fraction" in pair.get("rlvr", {})]
    if fractions:
        report["update_peak_fraction"] = min(fractions)
    for precision, pair in steps.items():
        if "step_limit_fraction" in pair.get("rlvr", {}):
            report[f"step_limit_fraction_{precision}"] = pair["rlvr"]["step_limit_fraction"]
    return report


def format_report(report: dict) -> str:
    lines = ["", f"GRPO step on {report.get('device', 'cpu')}: 4 prompts x 8 completions, max 64 new tokens, beta 0, one update per step",
             f"{'':14}{'s/step':>9}{'compl tok/s':>13}{'peak MB':>9}{'rollout s':>11}{'reward s':>10}{'update s':>10}{'vs TRL':>8}"]
    for precision, pair in report["steps"].items():
        for who in ("trl", "rlvr"):
            m = pair.get(who)
            if not m:
                continue
            if "error" in m:
                lines.append(f"{who + ' ' + precision:14}{m['error']}")
                continue
            tps = m["completion_tokens_per_step"] / m["seconds_per_step"]
            extra = (f"{m['rollout_seconds']:>11.2f}{m['reward_seconds']:>10.3f}{m['update_seconds']:>10.2f}"
                     f"{pair.get('speedup', float('nan')):>7.1f}x") if who == "rlvr" else ""
            lines.append(f"{who + ' ' + precision:14}{m['seconds_per_step']:>9.2f}{tps:>13.0f}{m['peak_memory_mb']:>9.0f}{extra}")
    r = report["rollout"]
    lines += ["", f"Rollout: tokens/s at 64 new tokens, 8 completions per prompt; roofline = matmul FLOP/s / {r['flops_per_token'] / 1e6:.0f} MFLOP per token",
              f"{'':16}{'generate':>10}{'rlvr':>8}{'ratio':>7}{'generate roof':>15}{'rlvr roof':>11}"]
    for row in r["rows"]:
        eager = f"{row['rlvr_eager_tokens_per_s']:>13.0f} without CUDA graphs" if "rlvr_eager_tokens_per_s" in row else ""
        lines.append(f"{row['precision'] + ' batch ' + str(row['batch']):16}{row['generate_tokens_per_s']:>10.0f}{row['rlvr_tokens_per_s']:>8.0f}"
                     f"{row['speedup']:>6.1f}x{row['generate_roofline_fraction']:>14.0%}{row['rlvr_roofline_fraction']:>11.0%}{eager}")
    for precision in ("fp32", "bf16"):
        if f"matmul_flops_{precision}" in r:
            lines.append(f"matmul {precision}: {r[f'matmul_flops_{precision}'] / 1e9:.0f} GFLOP/s")
    for precision, pair in report["steps"].items():
        if "update_peak_fraction" in pair.get("rlvr", {}):
            lines.append(f"update {precision}: {pair['rlvr']['update_peak_fraction']:.0%} of the matmul peak")
        if "step_limit_fraction" in pair.get("rlvr", {}):
            lines.append(f"step {precision}: {pair['rlvr']['step_limit_fraction']:.0%} of the time its FLOPs take at the matmul peak")
    keys = ("step_speedup_vs_trl", "rollout_speedup_vs_generate", "rollout_roofline_fraction", "update_peak_fraction",
            *(f"step_limit_fraction_{p}" for p in report["steps"]))
    for key in keys:
        if key in report:
            lines.append(f"{key}: {report[key]:.2f}")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
