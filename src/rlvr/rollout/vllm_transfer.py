"""rlvr's weight-transfer engine for vLLM's own server (`vllm serve`), loaded into vLLM as a plugin.

vLLM's server takes weight updates itself (dev mode: /init_weight_transfer_engine,
/start_weight_update, /update_weights, /finish_weight_update, /weight_info) and leaves the
transport to a registered engine.  The engines vLLM ships (nccl, ipc, sparse_nccl, sharded_rdt,
nccl_m2n) all move tensors between GPUs; none runs on a CPU, and none crosses a network without
a GPU collective.  This one carries the update in the HTTP request itself: each /update_weights
body holds a chunk of rlvr's weight stream (rollout/weights.py's format, base64 in the JSON),
a few dozen MB, so neither side holds a serialised copy of the whole model.  The load follows
vLLM's own lifecycle for checkpoint-format weights, as its NCCL engine does: layerwise reload
opened at start, each chunk through the model's load_weights (Hugging Face names; vLLM fuses
q/k/v and gate/up itself), the kernels' repacking redone at finish.

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
    init_info_cls = ChunkInit
    update_info_cls = Chunk
    supports_draft_weight_update = False

    def init_transfer_engine(self, init_info: ChunkInit) -> None:
        pass

    def start_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def receive_weights(self, update_info: Chunk) -> None:
        data = io.BytesIO(base64.b64decode(update_info.stream))
        meta, tensors = decode(data.read)
        if meta.get("adapter") is not None:
            raise ValueError("vllm_server_impl=vllm takes whole weights (a LoRA adapter merged in), not adapters")
        self.model.load_weights(with_aliases(tensors, meta.get("aliases") or {}))

    def finish_weight_update(self) -> None:
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        pass


def register() -> None:
    """The vllm.general_plugins entry point: vLLM calls it in each of its processes, maybe more than once."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory

    try:
        WeightTransferEngineFactory.register_engine(NAME, __name__, "HTTPChunks")
    except ValueError:  # registered already, by an earlier call in this process
        pass
