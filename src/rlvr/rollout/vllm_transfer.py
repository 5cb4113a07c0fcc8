"""rlvr's weight-transfer engine for vLLM's own server (`vllm serve`), loaded into vLLM as a plugin.

vLLM's server takes weight updates itself (dev mode: /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /weight_info) and leaves the
transport to a registered engine.  The engines vLLM ships (nccl, ipc, sparse_nccl, sharded_rdt,
nccl_m2n) all move tensors between GPUs; none runs on a CPU, and none crosses a network without
a GPU collective.  This one carries the update in the HTTP request itself: each /update_weights
body holds a chunk of rlvr's weight stream (rollout/weights.py's format, base64 in the JSON),
a few dozen MB, so neither side holds a serialised copy of the whole model.  The load follows
vLLM's own lifecycle for checkpoint-format weights, as its NCCL engine does: layerwise reload
opened with the first chunk, each chunk through the model's load_weights (Hugging Face names; vLLM
fuses q/k/v and gate/up itself), the kernels' repacking redone at finish.  A LoRA adapter (a few MB)
is written where vLLM's filesystem LoRA resolver looks, under a name per version, and the trainer's
requests name it: vLLM loads it for them.

Registered under the name "rlvr" by `register`, which pyproject.toml names as a
`vllm.general_plugins` entry point, so any vLLM in an environment where rlvr is installed has it:

    VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --weight-transfer-config '{"backend": "rlvr"}'

(`rlvr vllm-serve vllm_server_impl=vllm` starts exactly that.)  The trainer's side is
rollout/vllm_client.py.
"""

from __future__ import annotations

import base64
import io
from dataclasses import dataclass

from vllm.distributed.weight_transfer.base import WeightTransferEngine, WeightTransferInitInfo, WeightTransferUpdateInfo

from rlvr.rollout.weights import decode, with_aliases

NAME = "rlvr"


@dataclass
class ChunkInit(WeightTransferInitInfo):
    """Nothing to set up: every chunk arrives in its own request."""


@dataclass
class Chunk(WeightTransferUpdateInfo):
    """One piece of a weight update: a weight stream (rollout/weights.py) of some of the tensors, base64."""

    stream: str = ""


class HTTPChunks(WeightTransferEngine[ChunkInit, Chunk]):
    """Whole weights go into the model, inside vLLM's layerwise reload (opened at the first chunk, so that an
    update that is only a LoRA adapter leaves the model alone); an adapter is written where vLLM's filesystem
    LoRA resolver finds it by name (VLLM_LORA_RESOLVER_CACHE_DIR), the request naming it loading it."""

    init_info_cls = ChunkInit
    update_info_cls = Chunk
    supports_draft_weight_update = False
    reloading = False

    def init_transfer_engine(self, init_info: ChunkInit) -> None:
        pass

    def start_weight_update(self) -> None:
        self.reloading = False

    def receive_weights(self, update_info: Chunk) -> None:
        data = io.BytesIO(base64.b64decode(update_info.stream))
        meta, tensors = decode(data.read)
        if meta.get("adapter") is not None:
            return write_adapter(meta, dict(tensors))
        if not self.reloading:
            from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

            initialize_layerwise_reload(self.model)
            self.reloading = True
        self.model.load_weights(with_aliases(tensors, meta.get("aliases") or {}))

    def finish_weight_update(self) -> None:
        if self.reloading:
            from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

            finalize_layerwise_reload(self.model, self.model_config)
            self.reloading = False

    def shutdown(self) -> None:
        pass


def write_adapter(meta: dict, tensors: dict) -> None:
    """The adapter in peft's format, as VLLM_LORA_RESOLVER_CACHE_DIR/<meta["adapter_name"]>, for vLLM's
    filesystem resolver to load when a request names it; older rlvr adapters there are removed but the last."""
    import json
    import os
    import shutil
    from pathlib import Path

    from safetensors.torch import save_file

    root = os.environ.get("VLLM_LORA_RESOLVER_CACHE_DIR")
    if not root:
        raise ValueError("a LoRA adapter needs VLLM_LORA_RESOLVER_CACHE_DIR and VLLM_ALLOW_RUNTIME_LORA_UPDATING=1 on the "
                         "server (rlvr vllm-serve vllm_server_impl=vllm use_peft=true sets them)")
    path, tmp = Path(root) / meta["adapter_name"], Path(root) / f".{meta['adapter_name']}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir()
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
    (tmp / "adapter_config.json").write_text(json.dumps({**meta["adapter"], "base_model_name_or_path": meta["base_model"]}))
    tmp.rename(path)  # whole, or not there
    older = sorted((p for p in Path(root).glob("rlvr-policy-*") if p != path), key=lambda p: p.stat().st_mtime)
    for old in older[:-1]:
        shutil.rmtree(old, ignore_errors=True)


def register() -> None:
    """The vllm.general_plugins entry point: vLLM calls it in each of its processes, maybe more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "HTTPChunks")
    except ValueError:  # registered already, by an earlier call in this process
        pass
