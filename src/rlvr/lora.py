"""LoRA through peft: wrapping the policy, the reference as the same model with its adapter
disabled, the weights the sampler sees, and saving or loading an adapter.

With `use_peft=true` every target linear layer W gets a trainable low-rank update,
y = x W^T + scale * dropout(x) A^T B^T with scale = lora_alpha / lora_r (Hu et al. 2021,
https://arxiv.org/abs/2106.09685); W stays frozen.  Because W is the starting policy,
the KL reference needs no second copy of the model: it is the policy with the adapter
switched off (peft's `disable_adapter()`).  Checkpoints hold only the adapter; the final
save is the adapter (peft format) or the merged plain model (`lora_save`).
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from rlvr.errors import LoraError  # noqa: F401 - raised here, defined in the leaf errors.py

if TYPE_CHECKING:
    from rlvr.config import ModelSettings

PEFT_MISSING = 'use_peft=true needs peft, which is not installed. Install it with: pip install "peft>=0.13"'
# lora_target_modules=null: every linear layer of attention and MLP (for Llama: q/k/v/o_proj,
# gate/up/down_proj); peft's "all-linear" means exactly that, never the output layer.
ALL_LINEAR = "all-linear"


def require_peft() -> None:
    try:
        import peft  # noqa: F401
    except ImportError:
        raise LoraError(PEFT_MISSING) from None


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")


def unwrap(model):
    """The transformers model inside a PeftModel (its LoRA layers injected); any other model as is."""
    return model.get_base_model() if is_peft(model) else model


def wrap(model, settings: ModelSettings, base_path: str, seed: int):
    """The model with a fresh LoRA adapter; only the adapter's parameters require gradients.
    `seed` (the run's) alone decides the adapter's random init."""
    require_peft()
    from peft import LoraConfig, get_peft_model

    targets = list(settings.lora_target_modules) if settings.lora_target_modules else ALL_LINEAR
    config = LoraConfig(r=settings.lora_r, lora_alpha=settings.lora_alpha, lora_dropout=settings.lora_dropout,
                        target_modules=targets, bias="none", task_type="CAUSAL_LM")
    try:
        with torch.random.fork_rng(devices=[]):  # the adapter's random init depends on the seed alone
            torch.manual_seed(seed)
            peft_model = get_peft_model(model, config)
    except ValueError as e:  # peft: "Target modules {...} not found in the base model ..."
        raise LoraError(f"lora_target_modules={settings.lora_target_modules!r} does not fit this model: {e}") from None
    # The adapter records where its base model is; an absolute path keeps it loadable from anywhere.
    path = Path(base_path)
    peft_model.peft_config["default"].base_model_name_or_path = str(path.resolve()) if path.is_dir() else base_path
    return peft_model


def reference_off(model):
    """Context in which the policy is its own reference: the adapter disabled (nothing for other models)."""
    return model.disable_adapter() if is_peft(model) else contextlib.nullcontext()


def is_adapted(module) -> bool:
    return hasattr(module, "lora_A") and hasattr(module, "base_layer")


def effective_weight(module):
    """The weight a linear layer applies: W, or W + scale * B A for each active, unmerged adapter."""
    weight = module.weight
    if not is_adapted(module) or module.disable_adapters or module.merged:
        return weight
    for name in module.active_adapters:
        if name in module.lora_A:
            weight = weight + module.get_delta_weight(name).to(weight.dtype)
    return weight


def adapters_enabled(model) -> bool:
    return not any(getattr(m, "disable_adapters", False) for m in model.modules() if is_adapted(m))


def save_final(model, output_dir: Path, how: str) -> None:
    """The run's final model: a plain model as before; with LoRA the adapter (peft format) or,
    with how="merged", W + scale * B A merged into a plain model (done in place: after this the
    model computes the same function without adapter layers)."""
    if not is_peft(model):
        model.save_pretrained(output_dir)
    elif how == "merged":
        model.merge_and_unload().save_pretrained(output_dir)
    else:
        model.save_pretrained(output_dir)


def is_adapter_dir(path) -> bool:
    return (Path(path) / "adapter_config.json").is_file()


def load_merged(path: str, dtype):
    """A saved adapter (a run dir or checkpoint) on its base model, merged into a plain model."""
    require_peft()
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base_path = json.loads((Path(path) / "adapter_config.json").read_text())["base_model_name_or_path"]
    base = AutoModelForCausalLM.from_pretrained(base_path, dtype=dtype)
    return PeftModel.from_pretrained(base, path).merge_and_unload()
