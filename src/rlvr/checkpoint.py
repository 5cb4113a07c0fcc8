"""Atomic checkpoints and exact resume.

A checkpoint directory `checkpoint-<step>` holds the model (with LoRA only the
adapter, in peft format) and tokenizer in Hugging Face format plus
`trainer_state.pt`: optimizer, scheduler, step, data position, every RNG
state, the metrics window, and the generated batch still
being trained on when num_iterations > 1.  It is written to a temporary
directory and renamed into place, so a crash mid-save never leaves a broken
checkpoint that resume would pick.
"""

from __future__ import annotations

import os
import random
import shutil
from pathlib import Path

import torch

from rlvr.lora import is_peft
from rlvr.models import latest_checkpoint

STATE_FILE = "trainer_state.pt"


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, state: dict, save_total_limit: int | None) -> Path:
    final = Path(output_dir) / f"checkpoint-{step}"
    tmp = Path(output_dir) / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
    if final.exists():
        shutil.rmtree(final)
    os.replace(tmp, final)
    _rotate(Path(output_dir), save_total_limit)
    return final


def load_checkpoint(path: Path, model) -> dict:
    """Load weights into `model` and return the trainer state (RNG states restored)."""
    from safetensors.torch import load_file

    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))
    if not shards or not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete rlvr checkpoint (needs *.safetensors and {STATE_FILE})")
    weights = {}
    for shard in shards:
        weights.update(load_file(shard))
    if is_peft(model):  # a LoRA checkpoint holds only the adapter; the frozen base is the model's own
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        missing = [k for k in result.missing_keys if "lora_" in k]
        unexpected = result.unexpected_keys
    else:
        missing, unexpected = model.load_state_dict(weights, strict=False)
    # Tied output embeddings are saved once; anything else missing is a real mismatch.
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise RuntimeError(f"checkpoint {path} does not match the model: missing {missing[:5]}, unexpected {unexpected[:5]}")
    state = torch.load(path / STATE_FILE, weights_only=False, map_location="cpu")
    set_rng_state(state.pop("rng"))
    return state


def find_resume_checkpoint(output_dir: Path) -> Path:
    ckpt = latest_checkpoint(Path(output_dir))
    if ckpt is None:
        raise FileNotFoundError(f"resume=true but {output_dir} has no checkpoint-* directory to resume from")
    return ckpt


def _is_tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def _rotate(output_dir: Path, limit: int | None) -> None:
    if not limit:
        return
    ckpts = sorted(
        (p for p in output_dir.glob("checkpoint-*") if p.name.split("-")[-1].isdigit()),
        key=lambda p: int(p.name.split("-")[-1]),
    )
    for old in ckpts[:-limit]:
        shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
