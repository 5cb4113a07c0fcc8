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
# lora_target_modules=[all-linear]: every linear layer of attention and MLP (for Llama: q/k/v/o_proj,
# gate/up/down_proj), never the output layer; null: peft's own choice for the architecture.
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


def peft_config(settings: ModelSettings):
    """The peft LoraConfig of these settings: `lora_config` (a LoraConfig as given, every option) when
    set, else the lora_* settings as TRL's scripts make one (peft's defaults for what is not set)."""
    from peft import LoraConfig

    if settings.lora_config is not None:
        return LoraConfig(**{k: v for k, v in settings.lora_config.items() if k != "peft_type"})
    targets = settings.lora_target_modules
    if targets is not None:
        targets = ALL_LINEAR if tuple(targets) == (ALL_LINEAR,) else list(targets)
    extra = {"target_parameters": list(settings.lora_target_parameters)} if settings.lora_target_parameters else {}
    return LoraConfig(task_type=settings.lora_task_type, r=settings.lora_r, lora_alpha=settings.lora_alpha,
                      lora_dropout=settings.lora_dropout, target_modules=targets, bias="none", use_rslora=settings.use_rslora,
                      use_dora=settings.use_dora, modules_to_save=list(settings.lora_modules_to_save or ()) or None, **extra)


def as_settings(config) -> dict:
    """A peft LoraConfig as rlvr settings: `lora_config` holds every option (plain JSON values, so a
    checkpoint's config.yaml and the rollout workers carry it); lora_r / lora_alpha / lora_dropout
    mirror it for what reads them (vLLM's LoRA slots, `rlvr plan`)."""
    import json

    values = json.loads(json.dumps(config.to_dict(), default=lambda v: sorted(v) if isinstance(v, (set, frozenset)) else str(v)))
    values.pop("peft_type", None)
    ranks = [config.r, *(config.rank_pattern or {}).values()]
    return {"use_peft": True, "lora_config": values, "lora_r": int(max(ranks)), "lora_alpha": config.lora_alpha,
            "lora_dropout": float(config.lora_dropout)}


def wrap(model, settings: ModelSettings, base_path: str, seed: int):
    """The model with a fresh LoRA adapter; only the adapter's parameters (and any modules_to_save)
    require gradients.  `seed` (the run's) alone decides the adapter's random init."""
    require_peft()
    from peft import get_peft_model

    config = peft_config(settings)
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


def unplain(model) -> str | None:
    """What keeps a LoRA model's weights from being W + scale * B A on linear layers alone (what
    rlvr's fast path computes, llama.py), or None: DoRA, modules trained whole, trained biases,
    adapted parameters or embeddings."""
    if not is_peft(model):
        return None
    config = model.peft_config[model.active_adapter]
    options = [(getattr(config, "use_dora", False), "use_dora"), (config.modules_to_save, "modules_to_save"),
               (getattr(config, "bias", "none") != "none" or getattr(config, "lora_bias", False), "a trained bias"),
               (getattr(config, "target_parameters", None), "target_parameters"),
               (getattr(config, "trainable_token_indices", None), "trainable_token_indices"),
               (any(getattr(m, "lora_embedding_A", None) for m in model.modules()), "an adapted embedding")]
    return next((name for given, name in options if given), None)


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


def merged_weight(module):
    """W + scale * B A for each active adapter of a LoRA layer, the policy's weight, also while its
    adapter is disabled (a reference pass, on another thread); the module is not changed."""
    weight = module.weight
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
