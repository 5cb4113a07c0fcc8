"""Measured peak memory of a few real training steps against `rlvr plan`'s estimate.

    python benchmarks/memory.py                      # tiny and default model, full and LoRA
    python benchmarks/memory.py --model default --lora --steps 2
    python benchmarks/memory.py --model default --steps 3 --max-staleness 1
    python benchmarks/memory.py --model default --processes 2 --fsdp   # per rank, 2 gloo processes
    python benchmarks/memory.py --model default --processes 2 --fsdp --beta 0   # no KL reference
    python benchmarks/memory.py --model default --processes 2 --fsdp --server URL   # sampling on a server
                                   # (`rlvr vllm-serve` of the same model, started by you)

Each configuration runs in its own process (peak RSS is per process); with --processes N, under
torchrun, each rank measures its own and the plan is the per-GPU one for N GPUs (plan.trainer_gpu).  The measured number
is the peak resident set (ru_maxrss) minus the RSS just before the model loads, i.e. what
the run added on top of Python, torch and transformers; the plan is sized with the longest
prompt the run really sees (not max_prompt_length), since both are upper bounds.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


RANDOM_REWARD = "import random\ndef noisy(completions, **kw):\n    return [random.random() for _ in completions]\n"


def settings(model: str, lora: bool, steps: int, out: str, staleness: int = 0, fsdp: bool = False, beta: float = 0.04,
             server: str | None = None) -> dict:
    # Random rewards: every group carries signal, so every step really updates (gradients, AdamW state).
    plugin = Path(out).parent / "noisy.py"
    plugin.parent.mkdir(parents=True, exist_ok=True)
    plugin.write_text(RANDOM_REWARD)
    where = {"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": server} if server else {}
    return {**where, "model": model, "use_peft": lora, "reward_funcs": [f"{plugin}:noisy"], "num_generations": 4, "per_device_train_batch_size": 8,
            "gradient_accumulation_steps": 1, "max_completion_length": 32, "max_steps": steps, "beta": beta,
            "save_steps": 1000, "logging_steps": 1, "eval_on_start": False, "eval_on_end": False,
            "report_steps": 0, "output_dir": out, "max_staleness": staleness, "fsdp": fsdp, "use_cpu": True}


def child(model: str, lora: bool, steps: int, staleness: int = 0, fsdp: bool = False, scratch: str | None = None,
          beta: float = 0.04, server: str | None = None) -> dict:
    if scratch is not None:  # several processes: one run directory for all, made by the parent
        return _measure(model, lora, steps, Path(scratch), staleness, fsdp, beta, server)
    with tempfile.TemporaryDirectory(prefix="rlvr-mem-") as scratch:  # the run's checkpoints go with it
        return _measure(model, lora, steps, Path(scratch), staleness, fsdp, beta, server)


def _measure(model: str, lora: bool, steps: int, scratch: Path, staleness: int, fsdp: bool = False, beta: float = 0.04,
             server: str | None = None) -> dict:
    from rlvr.chat import render_prompts, tokenize_prompts
    from rlvr.config import build_config
    from rlvr.models import load_tokenizer, resolve_model_path
    from rlvr.plan import ModelSize, on_trainer, read_model_config
    from rlvr.run import train
    from rlvr.tasks import load_splits

    if model == "tiny":
        model = str(scratch / "tiny-llama")
        if not Path(model).is_dir():
            _make_tiny(model)
    cfg = build_config(settings(model, lora, steps, str(scratch / "run"), staleness, fsdp, beta, server))
    tokenizer = load_tokenizer(resolve_model_path(cfg.model))
    train_examples, _ = load_splits(cfg.data_settings, cfg.seed)
    texts = render_prompts(tokenizer, [e.prompt for e in train_examples[:200]], cfg.system_prompt, cfg.chat_template_kwargs,
                          cfg.text_prompts == "raw")
    longest = max(len(p) for p in tokenize_prompts(tokenizer, texts, cfg.max_prompt_length))
    import dataclasses

    from rlvr.plan import Layout, trainer_gpu

    size, sized = ModelSize.from_config(read_model_config(cfg.model)), dataclasses.replace(cfg, max_prompt_length=longest)
    planned = on_trainer(size, sized) if cfg.processes == 1 else trainer_gpu(size, sized, Layout(gpus=cfg.processes))
    baseline = _rss()
    phases = _watch_phases(baseline) if os.environ.get("RLVR_MEMORY_PHASES") else None
    train(cfg)
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return {"model": "tiny" if "tiny-llama" in str(model) else model, "lora": lora, "plan_bytes": planned["total"],
            "measured_bytes": peak - baseline, "baseline_bytes": baseline, "longest_prompt": longest,
            "rank": int(os.environ.get("RANK", "0")), "processes": cfg.processes, "fsdp": fsdp, "beta": beta, "server": server,
            "plan_rows": {k: v for k, v in planned.items() if k != "total"}, **({"phases": phases} if phases is not None else {})}


def _watch_phases(baseline: int) -> list:
    """RLVR_MEMORY_PHASES=1: (phase, RSS now, peak RSS so far, glibc's heap in use and free), in MiB (RSS above
    the baseline), after the trainer is built and after each sampling round, reference / old log-probs pass and update."""
    import rlvr.rollout.stage
    import rlvr.trainer
    import rlvr.update

    seen = []

    def after(owner, name):
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            out = inner(*args, **kwargs)
            peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
            seen.append((f"{owner.__name__}.{name}", round((_rss() - baseline) / 2**20), round((peak - baseline) / 2**20), _probe()))
            return out
        setattr(owner, name, wrapped)

    after(rlvr.trainer.Trainer, "__init__")
    after(rlvr.rollout.stage.RolloutStage, "sample")
    after(rlvr.update.PolicyUpdate, "prepare")
    after(rlvr.update.PolicyUpdate, "__call__")
    return seen


def _probe() -> dict:
    """glibc's heap now (mallinfo2, every arena): bytes in use and bytes free but kept, in MiB."""
    import ctypes

    class MallInfo2(ctypes.Structure):
        _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks",
                                                     "uordblks", "fordblks", "keepcost")]
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.mallinfo2.restype = MallInfo2
        info = libc.mallinfo2()
    except (OSError, AttributeError):  # not glibc
        return {}
    return {"heap in use": round(info.uordblks / 2**20), "heap free, kept": round(info.fordblks / 2**20)}


def _make_tiny(path: str) -> None:
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import make_tiny_model, make_tokenizer

    tok = make_tokenizer()
    make_tiny_model(len(tok)).save_pretrained(path)
    tok.save_pretrained(path)


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
    ap.add_argument("--processes", type=int, default=1, help="training processes under torchrun (gloo, CPU)")
    ap.add_argument("--fsdp", action="store_true", help="fsdp=true (needs --processes > 1)")
    ap.add_argument("--beta", type=float, default=0.04, help="the KL coefficient: 0 holds no reference")
    ap.add_argument("--server", help="sample on this `rlvr vllm-serve` of the same model (use_vllm=true vllm_mode=server)")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--scratch", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        result = json.dumps(child(ns.model, ns.lora, ns.steps, ns.max_staleness, ns.fsdp, ns.scratch, ns.beta, ns.server))
        if ns.scratch is None:
            print("RESULT " + result, flush=True)
        else:  # each rank its own file: two ranks' lines on one pipe can interleave
            (Path(ns.scratch) / f"result-{os.environ.get('RANK', '0')}.json").write_text(result)
        return
    models = ["tiny", "default"] if ns.model == "both" else [ns.model]
    print(f"{'model':<8} {'mode':<5} {'rank':>4} {'plan MiB':>9} {'measured MiB':>13} {'measured/plan':>14}")
    for model in models:
        for lora in ([True] if ns.lora else [False, True]):
            for r in _run(model, lora, ns):
                mib = 2**20
                print(f"{model:<8} {'lora' if lora else 'full':<5} {r['rank']:>4} {r['plan_bytes'] / mib:9.1f} "
                      f"{r['measured_bytes'] / mib:13.1f} {r['measured_bytes'] / r['plan_bytes']:14.2f}", flush=True)
                for phase, now, peak, probe in r.get("phases", []):
                    heap = ", ".join(f"{k} {v} MiB" for k, v in probe.items())
                    print(f"    after {phase}: {now} MiB now, {peak} MiB peak ({heap})")


def _run(model: str, lora: bool, ns) -> list[dict]:
    """Each rank's result of one configuration, in its own process(es)."""
    args = ["--child", "--model", model, "--steps", str(ns.steps), "--max-staleness", str(ns.max_staleness), "--beta", str(ns.beta)]
    args += ["--server", ns.server] if ns.server else []
    args += (["--lora"] if lora else []) + (["--fsdp"] if ns.fsdp else [])
    if ns.processes == 1:
        out = subprocess.run([sys.executable, __file__, *args], capture_output=True, text=True, check=True).stdout
        return [json.loads(line[7:]) for line in out.splitlines() if line.startswith("RESULT ")]
    with tempfile.TemporaryDirectory(prefix="rlvr-mem-", dir=ROOT / "runs" if (ROOT / "runs").is_dir() else None) as scratch:
        if model == "tiny":
            _make_tiny(str(Path(scratch) / "tiny-llama"))
        launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ns.processes}"]
        done = subprocess.run(launch + [__file__, *args, "--scratch", scratch], capture_output=True, text=True,
                              env={**os.environ, "OMP_NUM_THREADS": "1", "TMPDIR": scratch})  # torchrun's logs go with it
        if done.returncode:
            raise SystemExit(done.stdout[-3000:] + done.stderr[-3000:])
        found = [json.loads(path.read_text()) for path in Path(scratch).glob("result-*.json")]
    return sorted(found, key=lambda r: r["rank"])


if __name__ == "__main__":
    main()
