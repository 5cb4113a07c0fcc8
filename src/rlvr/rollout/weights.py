"""The policy's weights on their way to a sampler in another process or on another machine.

What is sent (`WeightUpdate`): after an optimizer step, either every weight of the policy under
its Hugging Face name (a LoRA adapter merged in, for an engine that takes no adapters), or with
LoRA only the adapter: its A and B matrices under peft's saved names and its LoraConfig, a few
MB where the merged model is GB.  Frozen weights never change, so the adapter is all that moved.
A merged weight (W + scale B A) is made as it is sent, one at a time (`WeightUpdate.merged`): the
model is never merged in place, where a forward may be running on another thread (a producer's
load during the update), and no merged copy of the whole model is ever held.

How it travels over HTTP (`encode` / `decode`): one stream, written and read a tensor at a time,
so neither side ever holds a second serialised copy of the model:

    8 bytes     little-endian length n of the header
    n bytes     JSON {"meta": {...}, "tensors": [{"name", "dtype", "shape"}, ...]}
    ...         each tensor's raw bytes, in the header's order (C order, little-endian)

Tensors travel in the engine's dtype (`wire_dtype`): bfloat16 for a bf16 engine, half of
float32's bytes; a float32 engine gets float32, since rounding would make the sampler's policy
differ from the trainer's.

From a sharded model (fsdp) an update's tensors are the shards (DTensors): each is gathered whole
only when it is sent (`WeightUpdate.value`), so the trainer never holds the whole model.  A gather
is a collective: when every rank loads the update (vLLM colocated) they gather in the same order;
when rank 0 alone sends it (to servers, with retries and relays), the others follow its requests
(`Relay`).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from rlvr.lora import is_adapted, merged_weight

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class WeightUpdate:
    """tensors: name -> tensor; adapter: the LoraConfig as a dict when `tensors` is a LoRA adapter
    (peft's saved names), else None (the whole policy, Hugging Face names)."""

    tensors: dict[str, torch.Tensor]
    adapter: dict | None = None
    version: int = 0
    meta: dict = field(default_factory=dict)
    gather: Callable[[str], torch.Tensor] | None = None  # set by Relay on rank 0: a shard's whole value, the others joining
    # name -> the LoRA layer whose weight, its adapter merged in, is sent under it (`tensors` holds the base
    # weight, of the same shape and dtype): made when sent (policy_weights)
    merged: dict = field(default_factory=dict)

    def value(self, name: str) -> torch.Tensor:
        """The tensor to send as `name`: a shard gathered whole (a collective), else itself."""
        if self.gather is not None:
            return self.gather(name)
        return self.whole(name)

    def whole(self, name: str) -> torch.Tensor:
        """`name`'s whole value, its adapter merged in where it has one (shards: a collective, every rank)."""
        if name in self.merged:
            with torch.no_grad():
                return whole(merged_weight(self.merged[name]))
        return whole(self.tensors[name])

    def only(self, names, meta: dict | None = None) -> "WeightUpdate":
        """The same update, of `names` alone (a part of the stream), with `meta` if given."""
        return WeightUpdate({n: self.tensors[n] for n in names}, self.adapter, self.version,
                            self.meta if meta is None else meta, self.gather, {n: m for n, m in self.merged.items() if n in names})

    def pairs(self) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, tensor) one at a time, each shard gathered as it comes (every rank in the same order)."""
        for name in self.tensors:
            yield name, self.value(name)

    @property
    def sharded(self) -> bool:
        return any(is_shard(t) for t in self.tensors.values())

    @property
    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def is_shard(t) -> bool:
    return hasattr(t, "full_tensor")


def whole(t: torch.Tensor) -> torch.Tensor:
    """A tensor's whole value: a DTensor's gathered from every rank (a collective), else the tensor."""
    return t.full_tensor() if is_shard(t) else t


class Relay:
    """Rank 0 sends a sharded update alone (to vLLM servers, with relays and retries it decides on
    as it goes), and every shard it sends must be gathered by all ranks together: rank 0 says which
    (a broadcast of its index) before each gather, and the other ranks `follow` until it is `done`.
    Every rank builds the same update (the same names in the same order) first."""

    def __init__(self, update: WeightUpdate, world):
        self.update, self.world, self.names = update, world, list(update.tensors)

    def lead(self) -> None:
        """On rank 0: the update's shards are gathered on request from now on."""
        self.update.gather = self._gather

    def _gather(self, name: str) -> torch.Tensor:
        self._say(self.names.index(name))
        return self.update.whole(name)

    def done(self) -> None:
        """On rank 0: the other ranks stop following."""
        self.update.gather = None
        self._say(-1)

    def follow(self) -> None:
        """On the other ranks: join every gather rank 0 asks for, until done()."""
        while (index := self._say(0)) >= 0:
            self.update.whole(self.names[index])

    def _say(self, index: int) -> int:
        t = torch.tensor([index], dtype=torch.long, device=self.world.device)
        torch.distributed.broadcast(t, src=0)
        return int(t.item())


def policy_weights(model) -> tuple[dict[str, torch.Tensor], dict]:
    """The policy's weights under Hugging Face names, and for a LoRA (peft) model which of them are
    sent with their adapter merged in (name -> its LoRA layer; `WeightUpdate.merged`).

    A tied output layer is not listed (named_parameters() shows the shared tensor once, as the
    embedding): `weight_update` names it as an alias, so that it travels once."""
    if not hasattr(model, "merge_adapter"):
        return {name: p.detach() for name, p in model.named_parameters()}, {}
    weights, merged, seen = {}, {}, set()
    for path, module in model.named_modules():
        for own, p in module.named_parameters(recurse=False):
            name = f"{path}.{own}" if path else own
            if "lora_" in name or id(p) in seen:  # a tied weight once, under its first name (as named_parameters)
                continue
            seen.add(id(p))
            name = name.removeprefix("base_model.model.").replace(".base_layer", "")
            weights[name] = p.detach()
            layer = model.get_submodule(path.removesuffix(".base_layer")) if path.endswith(".base_layer") else None
            if own == "weight" and layer is not None and is_adapted(layer):
                merged[name] = layer
    return weights, merged


def tied_aliases(model, weights: dict) -> dict[str, str]:
    """{"lm_head.weight": "model.embed_tokens.weight"} for a model whose output layer is its embedding:
    vLLM keeps the head as a tensor of its own, which would otherwise stay at its starting value."""
    if "lm_head.weight" not in weights and getattr(model.config, "tie_word_embeddings", False):
        return {"lm_head.weight": "model.embed_tokens.weight"}
    return {}


def with_aliases(pairs, aliases: dict[str, str]):
    """The (name, tensor) pairs, then each alias as a pair of its own (its source kept until then)."""
    wanted = {source: [] for source in aliases.values()}
    for name, tensor in pairs:
        if name in wanted:
            wanted[name].append(tensor)
        yield name, tensor
    for alias, source in aliases.items():
        if wanted.get(source):
            yield alias, wanted[source][0]


def adapter_weights(model) -> tuple[dict[str, torch.Tensor], dict]:
    """A peft model's adapter as peft saves it (names without the adapter's name), and its
    LoraConfig as a JSON-able dict: what adapter_model.safetensors and adapter_config.json hold."""
    from peft import get_peft_model_state_dict

    config = model.peft_config["default"].to_dict()
    config = {k: (sorted(v) if isinstance(v, set) else v) for k, v in config.items()}
    return {k: v.detach() for k, v in get_peft_model_state_dict(model).items()}, config


def weight_update(model, adapter_only: bool, version: int = 0) -> WeightUpdate:
    """What a sampler needs after a step: the adapter alone when it takes adapters and the policy
    has one, else the whole policy."""
    if adapter_only and hasattr(model, "peft_config"):
        tensors, config = adapter_weights(model)
        return WeightUpdate(tensors, config, version)
    weights, merged = policy_weights(model)
    return WeightUpdate(weights, None, version, {"aliases": tied_aliases(model, weights)}, merged=merged)


def wire_dtype(engine_dtype: str) -> torch.dtype:
    return DTYPES.get(engine_dtype, torch.float32)


def encode(update: WeightUpdate, dtype: torch.dtype | None = None) -> tuple[int, Iterator[bytes]]:
    """(total bytes, the stream's pieces); floating-point tensors cast to `dtype` on the way out.
    An adapter keeps its own dtype (float32 in peft): it is small, and vLLM casts it itself."""
    names = list(update.tensors)
    described = describe(update, dtype)
    entries = described["tensors"]
    header = json.dumps(described).encode()
    total = 8 + len(header) + sum(nbytes(e) for e in entries)

    def pieces() -> Iterator[bytes]:
        yield struct.pack("<Q", len(header)) + header
        for name, entry in zip(names, entries):
            t = update.value(name).detach().to("cpu", DTYPES.get(entry["dtype"], update.tensors[name].dtype))
            yield t.contiguous().view(torch.uint8).numpy().tobytes()

    return total, pieces()


def describe(update: WeightUpdate, dtype: torch.dtype | None = None) -> dict:
    """The stream's header: {"meta": {...}, "tensors": [{"name", "dtype", "shape"}, ...]}, each
    floating-point tensor's dtype `dtype` (an adapter's kept as it is)."""
    cast = None if update.adapter is not None else dtype
    entries = []
    for name, t in update.tensors.items():
        out = cast if cast is not None and t.is_floating_point() else t.dtype
        entries.append({"name": name, "dtype": str(out).removeprefix("torch."), "shape": list(t.shape)})
    return {"meta": {**update.meta, "version": update.version, "adapter": update.adapter}, "tensors": entries}


def entry_dtype(entry: dict) -> torch.dtype:
    return DTYPES[entry["dtype"]] if entry["dtype"] in DTYPES else getattr(torch, entry["dtype"])


def decode(read: Callable[[int], bytes]) -> tuple[dict, Iterator[tuple[str, torch.Tensor]]]:
    """(meta, (name, tensor) pairs read one at a time from `read(n)`, which returns exactly n bytes)."""
    (n,) = struct.unpack("<Q", read_exactly(read, 8))
    header = json.loads(read_exactly(read, n))

    def tensors() -> Iterator[tuple[str, torch.Tensor]]:
        for entry in header["tensors"]:
            data = bytearray(read_exactly(read, nbytes(entry)))
            flat = torch.frombuffer(data, dtype=torch.uint8) if data else torch.empty(0, dtype=torch.uint8)
            yield entry["name"], flat.view(entry_dtype(entry)).reshape(entry["shape"])

    return header["meta"], tensors()


def read_exactly(read: Callable[[int], bytes], n: int) -> bytes:
    parts, left = [], n
    while left:
        chunk = read(left)
        if not chunk:
            raise ConnectionError(f"the weight stream ended {left} bytes early")
        parts.append(chunk)
        left -= len(chunk)
    return b"".join(parts)


def nbytes(entry: dict) -> int:
    count = 1
    for size in entry["shape"]:
        count *= size
    return count * torch.empty(0, dtype=entry_dtype(entry)).element_size()
