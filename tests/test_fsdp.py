"""The sharded model (fsdp.py) through rlvr's fast path (llama.py): on 2 gloo processes under torchrun,
the log-probs and the gathered gradients of the model's own (generic) forward, with full fine-tuning,
gradient checkpointing and LoRA, a rank with fewer rows running an empty micro-batch beside the other,
and the reference's log-probs in lockstep.  Runs of the whole trainer are in test_distributed.py."""

import json

import pytest

from test_distributed import _launch

WORKER = '''
import copy, json, sys

import torch
from torch.distributed.tensor import DTensor

from rlvr import distributed, fsdp
from rlvr.logprobs import LogProbs
from rlvr.lora import unwrap
from rlvr.models import load_model
from rlvr.types import Batch, Rollout

world = distributed.init(use_cpu=True)
base, _, _ = load_model(sys.argv[1])


def rank_batch(rank: int, rows: int) -> Batch:
    """Groups of 2 completions (1 to 6 tokens) on prompts of 3 to 9 tokens, different on each rank."""
    g = torch.Generator().manual_seed(10 + rank)
    prompts = [torch.randint(4, base.config.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3)]
    rollouts = []
    for i in range(rows):
        completion = torch.randint(4, base.config.vocab_size, (1 + (3 * i + rank) % 6,), generator=g).tolist()
        rollouts.append(Rollout(prompts[i // 2 % 3], completion, [0.0] * len(completion), "stop", ""))
    batch = Batch.from_rollouts(rollouts, torch.zeros(rows), torch.ones(rows, dtype=torch.bool), 0, False)
    batch.group_ids = torch.arange(rows) // 2
    return batch


def one_pass(model, fast: bool, micro_batches: list[Batch]):
    """Log-probs of each micro-batch and the gradients (gathered whole) of a weighted sum of them."""
    logprobs, found, sharded = LogProbs(fast, temperature=0.7, micro_batch_size=4), [], []
    model.zero_grad(set_to_none=True)
    for micro in micro_batches:
        logp, _ = logprobs(model, micro)
        # between forward and backward FSDP has freed every decoder layer's gathered parameters
        sharded.append(all(isinstance(p, DTensor) for p in unwrap(model).model.layers.parameters()))
        weights = torch.linspace(-1, 1, logp.numel()).view(logp.shape)
        (logp * weights * micro.completion_mask).sum().backward()
        found.append(torch.where(micro.completion_mask, logp.detach(), 0.0))
    grads = {name: p.grad.full_tensor() for name, p in model.named_parameters() if p.grad is not None}
    return found, grads, all(sharded)


results = {}
for case in ("full", "checkpointing", "lora"):
    model = copy.deepcopy(base)
    if case == "checkpointing":
        model.activation_checkpointing_enable({"use_reentrant": False})
    if case == "lora":
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"]))
        with torch.no_grad():  # B starts at zero: an adapter that changes the output
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(len(name))) * 0.3)
    calls = []  # of q_proj, in every layer: once a forward, and again in the backward with checkpointing
    for layer in unwrap(model).model.layers:
        layer.self_attn.q_proj.register_forward_hook(lambda *args: calls.append(1))
    model = fsdp.shard(model.train(), "cpu", world.world_size)
    batch = rank_batch(world.rank, 8 if world.rank == 0 else 3)
    # rank 0: two micro-batches of 4; rank 1: 3 rows, then an empty one in lockstep
    micro = [batch.select(slice(0, 4)), batch.select(slice(4, 8)) if world.rank == 0 else Batch.empty()]
    fast_logp, fast_grads, freed = one_pass(model, True, micro)
    fast_calls = len(calls)
    generic_logp, generic_grads, _ = one_pass(model, False, micro)
    reference = fsdp.shard(copy.deepcopy(base), "cpu", world.world_size)
    with torch.no_grad():  # the sharded reference: chunks of 2 rows, as many on each rank as the busiest
        at_least = distributed.max_count(-(-len(batch) // 2), world)
        ref_fast = LogProbs(True, 0.7, micro_batch_size=2).in_chunks(reference, batch, at_least)
        ref_generic = LogProbs(False, 0.7, micro_batch_size=2).in_chunks(reference, batch, at_least)
    results[case] = {
        "logp": max((a - b).abs().max().item() for a, b in zip(fast_logp, generic_logp)),
        "grad": max(((fast_grads[k] - generic_grads[k]).abs().max() / generic_grads[k].abs().max()).item() for k in generic_grads),
        "same_params": sorted(fast_grads) == sorted(generic_grads), "trained": len(generic_grads), "freed": freed,
        "calls": fast_calls, "ref_logp": (ref_fast - ref_generic).where(batch.completion_mask, 0.0).abs().max().item(),
    }
json.dump(results, open(sys.argv[2] + str(world.rank), "w"))
distributed.shutdown(world)
'''


@pytest.mark.processes
def test_the_sharded_model_on_the_fast_path_gives_the_log_probs_and_gradients_of_its_own_forward(tiny_model_dir, tmp_path):
    """fsdp=true trains through rlvr's packed forward: each decoder layer runs as that layer's call, so
    FSDP2 gathers its parameters around it and reduce-scatters its gradients; the same numbers as the
    Hugging Face forward on the same batch, on both ranks."""
    pytest.importorskip("peft")
    script = tmp_path / "worker.py"
    script.write_text(WORKER)
    out = _launch([str(tiny_model_dir), str(tmp_path / "rank")], processes=2, timeout=240, script=script)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    for rank in (0, 1):
        results = json.loads((tmp_path / f"rank{rank}").read_text())
        for case, r in results.items():
            # measured on both ranks: log-probs and the reference's 4.8e-7, gradients 5.2e-7 (LoRA 8.2e-7) relative
            assert r["logp"] < 1e-5 and r["ref_logp"] < 1e-5 and r["grad"] < 1e-5, (case, rank, r)
            assert r["same_params"] and r["trained"] == (12 if case == "lora" else 20), (case, r)  # A, B of 3 modules x 2 layers
            assert r["freed"], (case, rank)  # the layers' gathered parameters are not kept from forward to backward
            # 2 layers x 2 micro-batches, each layer run again in the backward pass with checkpointing
            assert r["calls"] == (8 if case == "checkpointing" else 4), (case, rank, r["calls"])
