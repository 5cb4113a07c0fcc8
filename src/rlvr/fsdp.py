"""FSDP2 (`torch.distributed.fsdp.fully_shard`): the trained model's parameters, gradients and
optimizer state are sharded across the processes of a torchrun launch (fsdp=true).

How it fits the trainer:
- the trained model is sharded per decoder layer and at the root; FSDP gathers a module's
  parameters in hooks on its call, so rlvr's fast path (llama.py) runs as the model's own call
  and each decoder layer's computation as that layer's call, and FSDP gathers the layer's
  parameters around it and reduce-scatters its gradients (the generic path, the model's own
  forward, for a model the fast path does not cover);
- no rank keeps the whole model: the model is loaded into CPU memory and sharded in place (each
  rank's 1/N moved to its device), and the model that samples and evaluates is an unsharded
  copy without weights (`without_weights`), into which the shards are gathered one tensor at a
  time only while it does so (`GatheredCopy`, a collective every rank enters), then dropped: a
  rank's peak is the larger of sampling and the update, not their sum; old log-probs run on the
  sharded model; only sampling ahead (max_staleness=1), which samples while the policy trains,
  keeps a whole copy for good (`FullCopy`); engines outside (vLLM) are sent the weights gathered a
  tensor at a time (rollout/weights.py);
- checkpoints hold each rank's shards, written by torch.distributed.checkpoint (checkpoint.py:
  the trained weights, the optimizer state, a moved reference), and the final model is streamed
  into safetensors shards a tensor at a time (`save_streamed`): saving gathers no whole model
  (with LoRA only the adapter, and a merged final model from the gathered weights);
- every forward and backward of the sharded model is a collective, so every rank runs the same
  number of micro-batches (`Batch.empty` on the ranks with fewer);
- gradients are summed across ranks (divide factor 1), as the loss is already normalised by
  the totals over all ranks;
- the KL reference (beta > 0, full fine-tuning) is sharded the same way (`shard`): every rank
  keeps 1/N of it, and its forwards run in lockstep like the update's (LogProbs.in_chunks(at_least=...)); the TR-DPO sync mixes the
  policy into each rank's shard locally (`mix_into`), and a checkpoint saves each rank's shard of it;
- with LoRA (use_peft) the peft model is sharded by the decoder layers of the model inside it,
  each layer's frozen weights and its adapter in one group; only the adapter is trained, and the
  reference (adapter off) is the sharded policy's, its forwards in lockstep like the update's;
- with fsdp_offload_params (GPUs only) every sharded module, the reference's too, takes FSDP2's
  CPUOffloadPolicy: the shards of the weights, gradients and AdamW state live in pinned CPU memory,
  a layer's are copied to the GPU to be gathered for its use, gradients come back to the CPU after
  their reduce-scatter, and the optimizer steps on the CPU.  The collectives over those CPU
  tensors (the gradient norm, the gathers of GatheredCopy) take the default group's gloo side
  (distributed.backend_for).
"""

from __future__ import annotations

import contextlib
import copy

import torch

from rlvr import distributed
from rlvr.lora import unwrap
from rlvr.models import WeightCopy
from rlvr.runtime import configure_allocator, heap_from_decoding, map_large_blocks, release_free_memory


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


def without_weights(model):
    """A copy of `model` whose parameters are empty tensors (its structure, buffers and config
    copied; shared parameters stay shared), made without a second copy of the weights."""
    params = dict(model.named_parameters())
    kept = {name: p.data for name, p in params.items()}
    try:
        for p in params.values():
            p.data = torch.empty(0, dtype=p.dtype, device=p.device)
        return copy.deepcopy(model)
    finally:
        for name, p in params.items():
            p.data = kept[name]


def model_shards(model, trained_only: bool = True) -> dict:
    """This rank's shards of `model`'s weights by name (DTensors, no copy), for torch.distributed.checkpoint:
    by default only the trained ones (a LoRA model's adapter; frozen weights never change)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=trained_only))


def load_model_shards(model, shards: dict) -> None:
    """Put `shards` (model_shards of this model, filled by torch.distributed.checkpoint.load) into the model."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, shards, options=StateDictOptions(strict=False))


def optimizer_shards(model, optimizer) -> dict:
    """This rank's shards of the optimizer state (AdamW's moments of its parameters' shards)."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    return get_optimizer_state_dict(model, optimizer)


def load_optimizer_shards(model, optimizer, shards: dict) -> None:
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, shards)


def load_full_state_dict(model, state: dict) -> None:
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))


def load_full_optimizer_state(model, optimizer, state: dict) -> None:
    """The optimizer state of a checkpoint written whole (by an rlvr before sharded checkpoints) into the shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_optimizer_state_dict

    set_optimizer_state_dict(model, optimizer, state, options=StateDictOptions(full_state_dict=True))


class FullCopy(WeightCopy):
    """A weight subscriber: keeps an unsharded model equal to the sharded one after each step, for a
    sampler that runs while the policy trains (max_staleness): the one layout that holds a whole copy
    for good.  Only the trained parameters are gathered (collectives): frozen ones (LoRA's base) never change."""

    @torch.no_grad()
    def update_weights(self, sharded) -> None:
        self.load({name: p.full_tensor() for name, p in sharded.named_parameters() if p.requires_grad})


class GatheredCopy:
    """The unsharded model that samples and evaluates, holding its weights only inside `gathered()`.

    Outside it every parameter of `full` is an empty tensor (its module structure, buffers and
    config stay), so the whole model exists on a rank only while it samples: the peak is the larger
    of sampling (the whole weights, the KV cache) and the update (the shards, one layer gathered at
    a time), not their sum.  Entering gathers every parameter from the sharded model one tensor at a
    time (`DTensor.full_tensor()`, a collective: every rank enters together, also the ranks that do
    not evaluate); leaving drops them and tells `on_release` (the samplers' caches built from them).
    A tied output layer is the embedding's parameter, so it is gathered once, as it is listed once."""

    def __init__(self, full, sharded):
        self.full, self.sharded, self.depth = full, sharded, 0
        self.device = next(iter(full.buffers()), next(full.parameters())).device  # where it samples
        self.on_release: list = []
        self._params = dict(full.named_parameters())
        missing = set(self._params) ^ {name for name, _ in sharded.named_parameters()}
        if missing:
            raise ValueError(f"the sharded model and its unsharded copy differ in parameters: {sorted(missing)[:5]}")
        if self.device.type == "cpu":
            configure_allocator()  # as the sampler would; _free then maps the sharded phases' large blocks
        self._free()

    @contextlib.contextmanager
    def gathered(self):
        """The whole weights in `full` for the body (nested uses gather once)."""
        if self.depth == 0:
            self._fill()
        self.depth += 1
        try:
            yield self.full
        finally:
            self.depth -= 1
            if self.depth == 0:
                self._free()

    @contextlib.contextmanager
    def trained(self):
        """Only the trained parameters gathered into `full` for the body (a LoRA model's adapter, which
        a checkpoint saves in peft's format); the frozen ones stay empty."""
        if self.depth:  # the whole weights are here already
            yield self.full
            return
        self._fill(trained_only=True)
        try:
            yield self.full
        finally:
            self._free()

    def hold(self) -> None:
        """Gather the whole weights and keep them (a collective): the run is over and hands the model back."""
        if self.depth == 0:
            self._fill()
        self.depth += 1

    @torch.no_grad()
    def _fill(self, trained_only: bool = False) -> None:
        if self.device.type == "cpu":  # what the update freed, given back before the whole weights come
            release_free_memory()
        for name, shard in self.sharded.named_parameters():
            if trained_only and not shard.requires_grad:
                continue
            self._params[name].data = shard.full_tensor().detach().to(self.device)  # offloaded shards gather on the CPU
        if self.device.type == "cpu":  # the sampler's copy of them mapped too; the decoding's blocks kept for reuse
            heap_from_decoding()

    def _free(self) -> None:
        for param in self._params.values():
            param.data = torch.empty(0, dtype=param.dtype, device=param.device)
        for release in self.on_release:
            release()
        if self.device.type == "cpu":  # the whole weights and the sampler's copy of them, given back
            release_free_memory()
            map_large_blocks(True)  # the sharded phases: large blocks unmapped when freed


def save_config(model, directory) -> None:
    """A model's config.json and generation_config.json, as its save_pretrained writes them."""
    model.config.save_pretrained(directory)
    if getattr(model, "generation_config", None) is not None and model.can_generate():
        model.generation_config.save_pretrained(directory)


SHARD_BYTES = 5 * 10**9  # transformers' max_shard_size of 5GB: a rank writes at most this much at once


@torch.no_grad()
def save_streamed(sharded, like, directory, shard_bytes: int = SHARD_BYTES) -> None:
    """The whole model in Hugging Face's layout, config.json, generation_config.json and safetensors
    shards (with their index when there are several), with no rank ever holding it whole: each
    tensor is gathered from the shards in turn (a collective: every rank calls this), rank 0 keeps
    it until its safetensors shard is full, writes the shard and drops it.  `like`: the unsharded
    copy (without weights), whose config is saved; `directory`: where rank 0 writes, None on the
    other ranks.  A tied weight is saved once, as transformers does.  If a write fails rank 0 goes
    on gathering (the other ranks wait in those collectives) and raises the error at the end."""
    import json

    from safetensors.torch import save_file

    params = dict(sharded.named_parameters())  # a tied weight once, under its first name
    every = {name for name, _ in sharded.named_parameters(remove_duplicate=False)}
    state = [(name, params.get(name, tensor)) for name, tensor in sharded.state_dict().items()
             if name in params or name not in every]  # the parameters and the persistent buffers
    files, size = [[]], 0  # the names in each shard, in the model's order (a shard is a run of layers)
    for name, tensor in state:
        nbytes = tensor.numel() * tensor.element_size()
        if files[-1] and size + nbytes > shard_bytes:
            files.append([])
            size = 0
        files[-1].append(name)
        size += nbytes
    names = (["model.safetensors"] if len(files) == 1 else
             [f"model-{i + 1:05d}-of-{len(files):05d}.safetensors" for i in range(len(files))])
    tensors, failure = dict(state), None
    if directory is not None:
        try:
            save_config(like, directory)
        except Exception as e:  # noqa: BLE001 - raised once the others are through the gathers
            failure = e
    for file, keys in zip(names, files):
        shard = {}
        for key in keys:
            value = tensors[key]
            value = value.full_tensor() if hasattr(value, "full_tensor") else value
            if directory is not None and failure is None:
                shard[key] = value.detach().cpu().contiguous()
        if shard:
            try:
                save_file(shard, str(directory / file), metadata={"format": "pt"})
            except Exception as e:  # noqa: BLE001
                failure = e
    if directory is not None and failure is None and len(files) > 1:
        total = sum(t.numel() * t.element_size() for _, t in state)
        index = {"metadata": {"total_size": total}, "weight_map": {k: f for f, keys in zip(names, files) for k in keys}}
        try:
            (directory / "model.safetensors.index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
        except Exception as e:  # noqa: BLE001
            failure = e
    if failure is not None:
        raise failure


@torch.no_grad()
def lockstep_logprobs(logprobs, model, batch, world) -> torch.Tensor:
    """Log-probs of `batch` under a sharded model (logprobs.LogProbs): its forwards are collectives,
    so every rank runs as many as the busiest (empty ones past its batch); its parameters are left
    sharded again (FSDP keeps the root module's gathered after a forward)."""
    out = logprobs.in_chunks(model, batch, at_least=distributed.max_count(logprobs.chunks(batch), world))
    model.reshard()
    if out.device.type == "cpu":  # the forwards' gathered layers and activations, given back before the update
        release_free_memory()
    return out


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
