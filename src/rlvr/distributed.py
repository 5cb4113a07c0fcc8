"""Several training processes (torchrun, accelerate launch): who this process is, and the few
collectives the trainer needs.

Every rank draws the same prompts for a step and samples, scores and trains on its own share
of whole groups.  The scored groups are then gathered, so every rank computes the advantages
and the step's metrics over all of them, exactly as one process would.  Each rank's loss is
normalised by the totals over all ranks (LossNorm), and the gradients are summed across
ranks with `all_reduce` after the backward: the sum is then the gradient one process computes
on the whole batch.  rlvr's fast path (llama.py) runs the layers without model.forward, so
a DistributedDataParallel wrapper's hooks would never fire; summing the gradients ourselves
works for both paths.  With one process (no WORLD_SIZE in the environment) every helper here
is a no-op.

The sampling side (rollout/generation.py) gathers its groups in a process group of its own,
`World.sampling_group`, never in the default group that the update's collectives use (gradient
sums, counts, FSDP's own).  With max_staleness=1 the next generation is sampled in a thread while
the update runs: on one shared group the two threads' collectives pair up differently on each
rank (seen: a hang, or the update's gather of metrics receiving the thread's groups); on two groups
each one's collectives come in the same order on every rank.  The sampling group is gloo also
between GPUs: it carries pickled Python objects, and NCCL's user guide asks that operations on two
communicators never run at once ("Using multiple NCCL communicators concurrently").
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from rlvr.errors import ConfigError


@dataclass(frozen=True)
class World:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    device: str = "cpu"
    sampling_group: Any = field(default=None, compare=False, repr=False)  # see the module docstring; None: the default group

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0


SINGLE = World()


def world_from_env(env=None, use_cpu: bool = False) -> World:
    """The launch that torchrun or accelerate launch describes in WORLD_SIZE / RANK / LOCAL_RANK;
    each process on cuda:LOCAL_RANK when GPUs are visible and use_cpu is off."""
    env = os.environ if env is None else env
    size = int(env.get("WORLD_SIZE", "1"))
    if size <= 1:
        return World(device=pick_device(use_cpu))
    if "RANK" not in env:
        raise ConfigError("WORLD_SIZE is set but RANK is not: launch with torchrun or accelerate launch")
    rank, local = int(env["RANK"]), int(env.get("LOCAL_RANK", env["RANK"]))
    device = pick_device(use_cpu, local)
    here, gpus = int(env.get("LOCAL_WORLD_SIZE", size)), torch.cuda.device_count()
    if device != "cpu" and here > gpus:  # NCCL cannot put two ranks on one GPU
        raise ConfigError(f"{here} processes on this machine but {gpus} GPU(s): start one process per GPU "
                          f"(torchrun --nproc-per-node={gpus}), or set use_cpu=true to train on the CPU")
    return World(rank, size, local, device)


def pick_device(use_cpu: bool = False, local_rank: int = 0) -> str:
    """Where a process trains and samples: its CUDA GPU (cuda:LOCAL_RANK under torchrun) when
    one is visible, else the CPU."""
    if use_cpu or not torch.cuda.is_available():
        return "cpu"
    return f"cuda:{local_rank}"


def backend_for(device: str) -> str:
    """gloo between CPU processes; between GPUs nccl for CUDA tensors and gloo for CPU ones (torch's own
    default pair), which FSDP's CPU offload needs: its shards and gradients are CPU tensors there."""
    return "cuda:nccl,cpu:gloo" if device.startswith("cuda") else "gloo"


def init(env=None, use_cpu: bool = False) -> World:
    """Join the process group of a distributed launch (once): gloo between CPU processes,
    nccl (and gloo for CPU tensors) between GPUs; and make the sampling group (every rank calls this, at the same point).
    A World of one process when there is no launch."""
    world = world_from_env(env, use_cpu)
    if not world.enabled:
        return world
    if not torch.distributed.is_initialized():
        if world.device.startswith("cuda"):
            torch.cuda.set_device(world.local_rank)
        torch.distributed.init_process_group(backend_for(world.device), rank=world.rank, world_size=world.world_size)
    return replace(world, sampling_group=torch.distributed.new_group(backend="gloo"))


def shard(n: int, world: World) -> range:
    """The indices of the n groups of a step that this rank samples and trains on (contiguous)."""
    per_rank = n // world.world_size
    return range(world.rank * per_rank, (world.rank + 1) * per_rank)


def owners(n: int, world: World) -> list[int]:
    """The rank that trains each of n groups sampled for every process by one (a free-running producer on
    rank 0): contiguous, as even as n allows (a rank may get none)."""
    return [i * world.world_size // n for i in range(n)]


def gather(obj, world: World, group=None) -> list:
    """[the obj of rank 0, of rank 1, ...] on every rank; in `group` (None: the default group)."""
    if not world.enabled:
        return [obj]
    out = [None] * world.world_size
    torch.distributed.all_gather_object(out, obj, group=group)
    return out


def broadcast(obj, world: World):
    """Rank 0's obj on every rank."""
    if not world.enabled:
        return obj
    box = [obj if world.is_main else None]
    torch.distributed.broadcast_object_list(box, src=0)
    return box[0]


def sum_counts(counts: list[int], world: World) -> list[int]:
    """Element-wise sum over ranks of a few integers (exact, in int64)."""
    if not world.enabled:
        return list(counts)
    t = torch.tensor(counts, dtype=torch.long, device=world.device)
    torch.distributed.all_reduce(t)
    return t.tolist()


GRADIENT_BUCKET_BYTES = 25 * 2**20  # DistributedDataParallel's default bucket_cap_mb


def sum_gradients(params, world: World) -> None:
    """Replace every trainable parameter's gradient by its sum over ranks (all_reduce), a bucket of
    about 25 MiB at a time as DistributedDataParallel sends them, so that no rank holds a second whole
    copy of the gradients (one flat buffer of them all was 4 bytes a trainable parameter more at the
    update's end: 28 GB for 7B).  A rank that had nothing to train on takes part with zeros."""
    if not world.enabled:
        return
    bucket, size = [], 0
    for p in params:
        if not p.requires_grad:
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        if p.numel() * 4 >= GRADIENT_BUCKET_BYTES:  # a large one alone (the embedding), as it is
            _sum_bucket([p])
            continue
        bucket.append(p)
        size += p.numel() * 4
        if size >= GRADIENT_BUCKET_BYTES:
            _sum_bucket(bucket)
            bucket, size = [], 0
    if bucket:
        _sum_bucket(bucket)


def _sum_bucket(params: list) -> None:
    """The gradients of `params` summed over ranks in one all_reduce, in float32 (a bf16 gradient too)."""
    if len(params) == 1 and params[0].grad.dtype == torch.float32 and params[0].grad.is_contiguous():
        torch.distributed.all_reduce(params[0].grad)
        return
    flat = torch.cat([p.grad.reshape(-1).float() for p in params])
    torch.distributed.all_reduce(flat)
    offset = 0
    for p in params:
        n = p.numel()
        p.grad.copy_(flat[offset : offset + n].view_as(p.grad))
        offset += n


def merge_sums(parts: list[dict]) -> dict:
    """Metric sums from every rank: summed, except keys ending in /max or /min (the maximum, the minimum)."""
    out: dict = {}
    for part in parts:
        for k, v in part.items():
            if k not in out:
                out[k] = v
            elif k.endswith(("/max", "/min")):
                out[k] = max(out[k], v) if k.endswith("/max") else min(out[k], v)
            else:
                out[k] += v
    return out


def wait_for_all(world: World) -> None:
    """Every process here before any goes on.  Leaving the group while another process still
    works in it was seen to abort a gloo process at exit (SIGABRT, once in about 15 runs)."""
    if world.enabled:
        torch.distributed.barrier()


def shutdown(world: World) -> None:
    if world.enabled and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()


def max_count(n: int, world: World) -> int:
    """The largest n over ranks."""
    if not world.enabled:
        return n
    t = torch.tensor([n], dtype=torch.long, device=world.device)
    torch.distributed.all_reduce(t, op=torch.distributed.ReduceOp.MAX)
    return int(t.item())
