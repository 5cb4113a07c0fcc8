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
  number of micro-batches (`empty_micro_batch` on the ranks with fewer);
- gradients are summed across ranks (divide factor 1), as the loss is already normalised by
  the totals over all ranks;
- with LoRA (use_peft) the peft model is sharded by the decoder layers of the model inside it,
  each layer's frozen weights and its adapter in one group; only the adapter is trained, so the
  full copy (a peft model too) is refreshed with the adapter alone, and the reference (adapter
  off) is that copy's: its forward is no collective, so each rank runs it at its own pace.
"""

from __future__ import annotations

import torch

from rlvr.lora import unwrap
from rlvr.models import WeightCopy
from rlvr.types import Batch


def shard(model, device: str, world_size: int):
    """Shard `model` (a Hugging Face causal LM) in place across the process group; returns it."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.split(":")[0], (world_size,))
    layers = unwrap(model).model.layers  # under peft: model.base_model.model.model.layers
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
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


def empty_micro_batch(pad_id: int) -> Batch:
    """One row with no completion token: a forward and backward that contribute zero loss and
    zero gradient, for a rank with fewer micro-batches than the others."""
    one = torch.full((1, 1), pad_id, dtype=torch.long)
    return Batch(one, torch.ones((1, 1), dtype=torch.bool), one.clone(), torch.zeros((1, 1), dtype=torch.bool),
                 torch.zeros(1), group_ids=torch.zeros(1, dtype=torch.long), sampler_logprobs=torch.zeros((1, 1)))
