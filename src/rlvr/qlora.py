"""QLoRA: the model's linear layers loaded in 4 bits by bitsandbytes and frozen, a LoRA adapter
(lora.py) trained over them (Dettmers et al. 2023, https://arxiv.org/abs/2305.14314).

load_in_4bit=true (with use_peft=true) loads the model through transformers' BitsAndBytesConfig,
built from TRL's ModelConfig names as TRL's get_quantization_config builds it (the compute dtype
is the weights' dtype setting), then prepares it with peft's prepare_model_for_kbit_training
(every weight frozen, the norms and embeddings of a bf16 model in fp32) before the adapter is
added.  Such a model runs through its own forward: bitsandbytes unpacks the weights in its layers,
which rlvr's fast path (llama.py) does not read.  The KL reference is the model with its adapter
off, as for any LoRA run; checkpoints and the final save hold the adapter only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rlvr.errors import ConfigError
from rlvr.lora import unwrap

if TYPE_CHECKING:
    from rlvr.config import ModelSettings

BNB_MISSING = ("load_in_4bit=true needs bitsandbytes, which is not installed. Install it with: "
               "pip install 'rlvr[qlora]'  (or: pip install 'bitsandbytes>=0.50')")


def require_bitsandbytes() -> None:
    """Fail at once (before a model loads) when bitsandbytes is not installed; does not import it."""
    import importlib.util

    if importlib.util.find_spec("bitsandbytes") is None:
        raise ConfigError(BNB_MISSING)


def quantization_config(settings: ModelSettings):
    """transformers' BitsAndBytesConfig for these settings, or None without load_in_4bit."""
    if not settings.load_in_4bit:
        return None
    from transformers import BitsAndBytesConfig

    from rlvr.models import DTYPES

    storage = {"bnb_4bit_quant_storage": settings.bnb_4bit_quant_storage} if settings.bnb_4bit_quant_storage else {}
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_compute_dtype=DTYPES[settings.dtype],
                              bnb_4bit_quant_type=settings.bnb_4bit_quant_type,
                              bnb_4bit_use_double_quant=settings.use_bnb_nested_quant, **storage)


def bits(model) -> int | None:
    """4 or 8 for a model that bitsandbytes loaded in that many bits (under a peft wrapper too), else None."""
    base = unwrap(model)
    if getattr(base, "is_loaded_in_4bit", False):
        return 4
    return 8 if getattr(base, "is_loaded_in_8bit", False) else None


def prepare(model, use_peft: bool):
    """A 4-bit model made ready for its adapter (peft's prepare_model_for_kbit_training); any other as it is.
    Refused: an 8-bit model, and a quantized one without LoRA (its packed weights cannot be trained)."""
    loaded = bits(model)
    if loaded is None:
        return model
    if loaded == 8:
        raise ConfigError("the model is loaded in 8 bits: 8-bit loading (LLM.int8) is not supported; QLoRA is a 4-bit "
                          "model (load_in_4bit=true) with use_peft=true")
    if not use_peft:
        raise ConfigError("the model is loaded in 4 bits, whose packed weights cannot be trained: train a LoRA adapter over "
                          "it (use_peft=true, or GRPOTrainer(peft_config=LoraConfig(...)))")
    from peft import prepare_model_for_kbit_training

    # Checkpointing is rlvr's own switch (non-reentrant: no need for peft's input-gradient hook).
    model = prepare_model_for_kbit_training(model, use_gradient_checkpointing=False)
    _keep_trainable_layout(model)
    return model


def _keep_trainable_layout(model) -> None:
    """bitsandbytes 0.50 repacks a 4-bit layer's weights, in place, the first time the layer runs on a
    CPU with AVX512-BF16 in eval mode without gradients (rlvr's sampling), into a layout for inference
    whose kernel has no backward (torch warns once that backpropagating through it "may lead to silently
    incorrect behavior"): measured on this project's CPU, every adapter's gradient then differed from
    LoRA's over the same weights, and in one run the first layer's got none.  Turning that repacking off
    keeps every pass on the kernel that trains (tests/test_qlora.py); on a GPU it never happens."""
    for module in model.modules():
        if hasattr(module, "support_avx512bf16_for_cpu"):
            module.support_avx512bf16_for_cpu = False
