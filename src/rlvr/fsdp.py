"""FSDP2 (`torch.distributed.fsdp.fully_shard`): the trained model's parameters, gradients and
optimizer state are sharded across the processes of a torchrun launch (fsdp=true).

How it fits the trainer:
- the trained model is sharded per decoder layer and at the root, and runs through its own
  forward (the generic path): FSDP gathers a layer's parameters in hooks on the module's
  forward, which rlvr's fast path (llama.py) bypasses;
- sampling, evaluation, old log-probs and saving use a full, unsharded copy of the weights
  (`FullCopy`), refreshed after every optimizer step through `Trainer.weight_subscribers`, so
  each rank samples its groups at its own pace with no collective; the copy costs one set of
  parameters per process, while the gradients and the optimizer state (3x the parameters with
  AdamW) stay sharded;
- every forward and backward of the sharded model is a collective, so every rank runs the same
  number of micro-batches (`Batch.empty` on the ranks with fewer);
- gradients are summed across ranks (divide factor 1), as the loss is already normalised by
  the totals over all ranks;
- the KL reference (beta > 0, full fine-tuning) is sharded the same way (`shard`): every rank
  keeps 1/N of it, and its forwards run in lockstep like the update's (LogProbs.in_chunks(at_least=...)); the TR-DPO sync mixes the
  policy into each rank's shard locally (`mix_into`), and a checkpoint gathers it whole (`full_state`);
- with LoRA (use_peft) the peft model is sharded by the decoder layers of the model inside it,
  each layer's frozen weights and its adapter in one group; only the adapter is trained, so the
  full copy (a peft model too) is refreshed with the adapter alone, and the reference (adapter
  off) is that copy's: its forward is no collective, so each rank runs it at its own pace;
- with fsdp_offload_params (GPUs only) every sharded module, the reference's too, takes FSDP2's
  CPUOffloadPolicy: the shards of the weights, gradients and AdamW state live in pinned CPU memory,
  a layer's are copied to the GPU to be gathered for its use, gradients come back to the CPU after
  their reduce-scatter, and the optimizer steps on the CPU.  The collectives over those CPU
  tensors (the gradient norm, the full copy's gather) take the default group's gloo side
  (distributed.backend_for).
"""

from __future__ import annotations

import torch

from rlvr.lora import unwrap
from rlvr.models import WeightCopy


def shard(model, device: str, world_size: int, offload: bool = False):
    """Shard `model` (a Hugging Face causal LM) in place across the process group; returns it.
    offload: its shards kept in CPU memory between uses (CPUOffloadPolicy; pinned, which needs a GPU)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import CPUOffloadPolicy, OffloadPolicy, fully_shard

    mesh = init_device_mesh(device.split(":")[0], (world_size,))
    policy = CPUOffloadPolicy(pin_memory=device.startswith("cuda")) if offload else OffloadPolicy()
    layers = unwrap(model).model.layers  # under peft: model.base_model.model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh, offload_policy=policy)
    fully_shard(model, mesh=mesh, offload_policy=policy)
    for module in [*layers, model]:  # each sharded module reduces its own gradients
        module.set_gradient_divide_factor(1.0)
        module.set_force_sum_reduction_for_comms(True)  # a plain SUM: gloo has no PREMUL_SUM
    return model


def load_full_state_dict(model, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def full_optimizer_state(model, optimizer) -> dict:
    """The optimizer's state over all shards (a collective), as one process would save it."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


class FullOptimizerState:
    """A sharded model's optimizer as a checkpoint part: saved and loaded whole (collectives)."""

    def __init__(self, model, optimizer):
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict:
        return full_optimizer_state(self.model, self.optimizer)

    def load_state_dict(self, state: dict) -> None:
        load_full_optimizer_state(self.model, self.optimizer, state)


class FullCopy(WeightCopy):
    """A weight subscriber: keeps an unsharded model equal to the sharded one after each step.
    Only the trained parameters are gathered (collectives): frozen ones (LoRA's base) never change."""

    @torch.no_grad()
    def update_weights(self, sharded) -> None:
        self.load({name: p.full_tensor() for name, p in sharded.named_parameters() if p.requires_grad})


@torch.no_grad()
def mix_into(sharded, policy, alpha: float) -> None:
    """sharded <- (1 - alpha) x sharded + alpha x policy, each rank on its own shard with no
    communication: `policy` is the trained model, sharded the same way (shard())."""
    for model in (sharded, policy):
        model.reshard()  # every parameter in its sharded form (a forward leaves the root's gathered)
    source = dict(policy.named_parameters())
    for name, param in sharded.named_parameters():
        param.mul_(1.0 - alpha).add_(source[name].detach().to(param.dtype), alpha=alpha)


def full_state(model) -> dict:
    """A model's weights whole, on the CPU; a sharded one's gathered (a collective: every rank calls it)."""
    if not hasattr(model, "reshard"):
        return {k: v.detach().cpu() for k, v in model.state_dict().items()}
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
