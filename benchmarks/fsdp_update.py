"""The sharded model's update (fsdp=true) through rlvr's packed forward against the model's own forward.

    python benchmarks/fsdp_update.py                             # default model, 2 gloo processes
    python benchmarks/fsdp_update.py --model PATH --processes 2 --steps 5

Under torchrun, each process (CPU, gloo, one thread) holds a GRPO batch like benchmarks/memory.py's:
2 prompts of the default task (chat-rendered) x G=4 completions, one micro-batch of 8 as
per_device_train_batch_size=8, the completions random tokens of 8 to 32 (seeded per rank).  The
model and a reference copy are sharded as fsdp.shard does.  Each step times, on each path in turn,
the update's forward and backward (log-probs, a weighted sum of them, its backward: FSDP's
gathers and reduce-scatters included; the optimizer step, the same on both paths, left out) and
the KL reference's log-probs (no gradient).  A time is the slowest rank's, the median over the
timed steps after one untimed step of each path.
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import time


def worker(model_name: str, steps: int) -> None:
    import copy

    import torch

    from rlvr import distributed, fsdp
    from rlvr.chat import render_prompts, tokenize_prompts
    from rlvr.config import build_config
    from rlvr.logprobs import LogProbs
    from rlvr.models import load_model
    from rlvr.tasks import load_splits
    from rlvr.types import Batch, Rollout

    world = distributed.init(use_cpu=True)
    cfg = build_config({"model": model_name})
    model, tokenizer, _ = load_model(cfg.model)
    train, _ = load_splits(cfg.data_settings, cfg.seed)
    texts = render_prompts(tokenizer, [e.prompt for e in train[2 * world.rank : 2 * world.rank + 2]], cfg.system_prompt)
    prompts = tokenize_prompts(tokenizer, texts, cfg.max_prompt_length)
    g = torch.Generator().manual_seed(world.rank)
    rollouts = []
    for prompt in prompts:
        for _ in range(4):
            completion = torch.randint(0, model.config.vocab_size, (int(torch.randint(8, 33, (1,), generator=g)),), generator=g)
            rollouts.append(Rollout(prompt, completion.tolist(), [0.0] * len(completion), "length", ""))
    batch = Batch.from_rollouts(rollouts, torch.zeros(8), torch.ones(8, dtype=torch.bool), tokenizer.pad_token_id or 0, False, 4)
    reference = fsdp.shard(copy.deepcopy(model).eval(), world.device, world.world_size)
    policy = fsdp.shard(model.train(), world.device, world.world_size)

    def update(fast: bool) -> None:
        logp, _ = LogProbs(fast, temperature=1.0)(policy, batch)
        (logp * batch.completion_mask).sum().backward()
        policy.zero_grad(set_to_none=True)

    def ref(fast: bool) -> None:
        LogProbs(fast, temperature=1.0, micro_batch_size=8).in_chunks(reference, batch)
        reference.reshard()

    times = {(part, fast): [] for part in ("update", "reference") for fast in (True, False)}
    for step in range(steps + 1):
        for (part, fast), seconds in times.items():
            distributed.wait_for_all(world)
            t0 = time.perf_counter()
            (update if part == "update" else ref)(fast)
            elapsed = torch.tensor(time.perf_counter() - t0)
            torch.distributed.all_reduce(elapsed, op=torch.distributed.ReduceOp.MAX)
            if step > 0:
                seconds.append(elapsed.item())
    if world.is_main:
        print(f"{world.world_size} processes, on rank 0: prompts of {[len(p) for p in prompts]} tokens, {len(batch)} completions "
              f"of {int(batch.completion_mask.sum())} tokens; {steps} timed steps (median, slowest rank)")
        for part in ("update", "reference"):
            fast, generic = (statistics.median(times[part, f]) for f in (True, False))
            label = "update (forward + backward)" if part == "update" else "reference log-probs"
            print(f"{label:<28} fast {fast:7.3f} s   generic {generic:7.3f} s   generic / fast {generic / fast:5.2f}")
    distributed.shutdown(world)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="default")
    ap.add_argument("--processes", type=int, default=2)
    ap.add_argument("--steps", type=int, default=3, help="timed steps of each path, after one untimed")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.worker:
        return worker(ns.model, ns.steps)
    launch = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={ns.processes}"]
    args = [__file__, "--worker", "--model", ns.model, "--steps", str(ns.steps)]
    subprocess.run(launch + args, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})


if __name__ == "__main__":
    main()
