"""Measured peak memory of a few real training steps against `rlvr plan`'s estimate.

    python benchmarks/memory.py                      # tiny and default model, full and LoRA
    python benchmarks/memory.py --model default --lora --steps 2
    python benchmarks/memory.py --model default --steps 3 --max-staleness 1

Each configuration runs in its own process (peak RSS is per process).  The measured number
is the peak resident set (ru_maxrss) minus the RSS just before the model loads, i.e. what
the run added on top of Python, torch and transformers; the plan is sized with the longest
prompt the run really sees (not max_prompt_length), since both are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


RANDOM_REWARD = "import random\ndef noisy(completions, **kw):\n    return [random.random() for _ in completions]\n"


def settings(model: str, lora: bool, steps: int, out: str, staleness: int = 0) -> dict:
    # Random rewards: every group carries signal, so every step really updates (gradients, AdamW state).
    plugin = Path(out).parent / "noisy.py"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(RANDOM_REWARD)
    return {"model": model, "use_peft": lora, "reward_funcs": [f"{plugin}:noisy"], "num_generations": 4, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "max_completion_length": 32, "max_steps": steps, "beta": 0.04,
            "save_steps": 1000, "logging_steps": 1, "eval_on_start": False, "eval_on_end": False,
            "report_steps": 0, "output_dir": out, "max_staleness": staleness}


def child(model: str, lora: bool, steps: int, staleness: int = 0) -> dict:
    with tempfile.TemporaryDirectory(prefix="rlvr-mem-") as scratch:  # the run's checkpoints go with it
        return _measure(model, lora, steps, Path(scratch), staleness)


def _measure(model: str, lora: bool, steps: int, scratch: Path, staleness: int) -> dict:
    from rlvr.chat import render_prompts, tokenize_prompts
    from rlvr.config import build_config
    from rlvr.models import load_tokenizer, resolve_model_path
    from rlvr.plan import ModelSize, estimate, read_model_config
    from rlvr.run import train
    from rlvr.tasks import load_splits

    if model == "tiny":
        sys.path.insert(0, str(ROOT / "tests"))
        from conftest import make_tiny_model, make_tokenizer

        model = str(scratch / "tiny-llama")
        tok = make_tokenizer()
        make_tiny_model(len(tok)).save_pretrained(model)
        tok.save_pretrained(model)
    cfg = build_config(settings(model, lora, steps, str(scratch / "run"), staleness))
    tokenizer = load_tokenizer(resolve_model_path(cfg.model))
    train_examples, _ = load_splits(cfg.data_settings, cfg.seed)
    texts = render_prompts(tokenizer, [e.prompt for e in train_examples[:200]], cfg.system_prompt, cfg.chat_template_kwargs,
                          cfg.text_prompts == "raw")
    longest = max(len(p) for p in tokenize_prompts(tokenizer, texts, cfg.max_prompt_length))
    import dataclasses

    planned = estimate(ModelSize.from_config(read_model_config(cfg.model)), dataclasses.replace(cfg, max_prompt_length=longest))
    baseline = _rss()
    train(cfg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": "tiny" if "tiny-llama" in str(model) else model, "lora": lora, "plan_bytes": planned["total"],
            "measured_bytes": peak - baseline, "baseline_bytes": baseline, "longest_prompt": longest}


def _rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", choices=["tiny", "default", "both"], default="both")
    ap.add_argument("--lora", action="store_true", help="only LoRA (default: full and LoRA)")
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--max-staleness", type=int, default=0, choices=[0, 1], help="sample the next batch during the update")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        print("RESULT " + json.dumps(child(ns.model, ns.lora, ns.steps, ns.max_staleness)), flush=True)
        return
    models = ["tiny", "default"] if ns.model == "both" else [ns.model]
    print(f"{'model':<8} {'mode':<5} {'plan MiB':>9} {'measured MiB':>13} {'measured/plan':>14}")
    for model in models:
        for lora in ([True] if ns.lora else [False, True]):
            cmd = [sys.executable, __file__, "--child", "--model", model, "--steps", str(ns.steps),
                   "--max-staleness", str(ns.max_staleness)] + (["--lora"] if lora else [])
            out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout
            r = json.loads(next(l for l in out.splitlines() if l.startswith("RESULT "))[7:])
            mib = 2**20
            print(f"{model:<8} {'lora' if lora else 'full':<5} {r['plan_bytes'] / mib:9.1f} {r['measured_bytes'] / mib:13.1f} "
                  f"{r['measured_bytes'] / r['plan_bytes']:14.2f}", flush=True)


if __name__ == "__main__":
    main()
