"""A run, assembled for every method alike (methods.py says what differs): its settings checked,
its directory, its data, the model (LoRA, gradient checkpointing, fsdp), the reference and the
method's trainer; then loop.Run drives the trainer's steps and records each (evaluation, metrics
and loggers, alerts, the live report, checkpoints), and leaves the final model and the summary."""

from __future__ import annotations

import dataclasses
import shutil
from pathlib import Path

from rlvr import distributed, fsdp, lora, methods, qlora
from rlvr.config import Config, ConfigError, save_config
from rlvr.loop import Run
from rlvr.models import disable_dropout, load_model, load_tokenizer, make_reference
from rlvr.monitor import build_loggers, make_console
from rlvr.rundir import default_output_dir, prepare_output_dir_once
from rlvr.runtime import slow_bf16_note
from rlvr.settings import check_runnable
from rlvr.trainer import RunCore, RunData
from rlvr.trl_settings import loss_note, meaning_note


def train(cfg: Config, console=None, objects=None) -> dict:
    """Train as configured: before/after evaluation, checkpoints, final model. Returns the summary.
    Under torchrun / accelerate launch, each process trains on its share of the groups
    (distributed.py); only rank 0 prints, evaluates and writes files.  `objects` (api.RunObjects):
    the model, tokenizer, examples (or rows) and callbacks given to a TRL trainer as objects; the trained
    model and tokenizer are left in it."""
    world = distributed.init(use_cpu=cfg.use_cpu)
    try:
        summary = _train(cfg.for_processes(world.world_size), console, world, objects)
        distributed.wait_for_all(world)  # rank 0 is still writing the final model when the others finish
        return summary
    finally:
        distributed.shutdown(world)


def _train(cfg: Config, console, world: distributed.World, objects=None) -> dict:
    console = console or make_console()
    if not world.is_main:
        from rich.console import Console

        console = Console(quiet=True)
    check_runnable(cfg, world)  # settings, launch and environment, before any directory is made or model loaded
    say = lambda text: console.print(f"[yellow]{text}[/]")  # noqa: E731
    default_dir = default_output_dir(cfg.run_settings, cfg.data_settings, cfg.command)
    output_dir, checkpoint, lock = prepare_output_dir_once(cfg.run_settings, default_dir, cfg.without_secrets().to_dict(), world, say=say)
    cfg = dataclasses.replace(cfg, output_dir=str(output_dir))
    try:
        return _train_in(cfg, output_dir, checkpoint, console, say, world, objects)
    except Exception:  # an error before anything was written (a bad dataset row) leaves no directory behind;
        # an interrupted run keeps its directory, so that resume=true can start it over
        if lock is not None:
            lock.close()
            lock = None
        if world.is_main and output_dir.is_dir() and {p.name for p in output_dir.iterdir()} <= {".lock"}:
            shutil.rmtree(output_dir, ignore_errors=True)
        raise
    finally:
        if lock is not None:
            lock.close()


def _train_in(cfg: Config, output_dir: Path, checkpoint: Path | None, console, say, world: distributed.World, objects=None) -> dict:
    """The run in its (locked) directory; `say` prints a warning."""
    method = methods.get(cfg.method)
    data = method.load_data(cfg, objects)
    data.test_examples = data.test_examples[: cfg.eval_max_examples or None]
    loggers = build_loggers(cfg.run_settings, output_dir, cfg.without_secrets().to_dict()) if world.is_main else []  # a missing logger package fails before the model loads
    model, tokenizer, model_path = _load_model(cfg, world, objects)
    model = _prepare_model(cfg, model, model_path)
    trainer = _make_trainer(cfg, method, model, tokenizer, data, output_dir, world)
    if checkpoint is not None:
        trainer.resume(checkpoint)
        console.print(f"resumed from {checkpoint} at step {trainer.step}")
    if world.is_main:
        save_config(cfg.without_secrets(), output_dir / "config.yaml")  # no hub_token on disk, nor on the Hub
    console.print(f"[bold]rlvr {cfg.command}[/] -> {output_dir}  model: {model_path} on {world.device}  "
                  f"train/test: {len(data.train_examples)}/{len(data.test_examples)}  steps: {trainer.total_steps}")
    for note in (slow_bf16_note(cfg.bf16, world.device), meaning_note(cfg.method, cfg.dpo_loss_type, cfg.label_smoothing),
                 loss_note(cfg.update_settings) if cfg.method == "grpo" else None):
        if note is not None:
            console.print(f"[yellow]{note}[/]")
    run = Run(cfg, method, trainer, data, model_path, console, say, loggers, objects.callbacks if objects is not None else None)
    run.train()
    return run.finish(objects)


# --- the run's parts, prepared ---------------------------------------------------------------

def _load_model(cfg: Config, world: distributed.World, objects=None):
    """(model, tokenizer, model path): by name or path, or the objects given to the Python API."""
    given_model, given_tokenizer = (objects.model, objects.tokenizer) if objects is not None else (None, None)
    # With fsdp the whole model is loaded into CPU memory; sharding moves each rank's 1/N to its device.
    device = "cpu" if cfg.fsdp else world.device
    if given_model is not None:  # a loaded model given to GRPOTrainer
        placed = given_model if qlora.bits(given_model) else given_model.to(device)  # quantized: where it was loaded
        model, model_path, tokenizer = placed, cfg.model, None
    else:
        model, tokenizer, model_path = load_model(cfg.model, cfg.dtype, device, cfg.model_init_kwargs, cfg.trust_remote_code,
                                                  cfg.trust_unverified_checkpoint, qlora.quantization_config(cfg.model_settings))
    tokenizer = given_tokenizer or tokenizer or load_tokenizer(model.name_or_path, trust_remote_code=cfg.trust_remote_code)
    context = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    if isinstance(context, int) and cfg.max_prompt_length and cfg.max_prompt_length >= context:
        raise ConfigError(f"max_prompt_length={cfg.max_prompt_length} leaves no room for a completion in the model's context "
                          f"of {context} tokens (max_position_embeddings): set it below {context}")
    return model, tokenizer, model_path


def _prepare_model(cfg: Config, model, model_path):
    """The model as it trains: a 4-bit model readied for its adapter (QLoRA), dropout off, the LoRA
    adapter, gradient checkpointing."""
    model = qlora.prepare(model, cfg.use_peft)
    if cfg.use_peft:
        model = lora.wrap(model, cfg.model_settings, model_path, cfg.seed)
    if cfg.disable_dropout:
        disable_dropout(model)  # after LoRA, as TRL: the adapter's dropout is off too
    if cfg.gradient_checkpointing:
        _checkpoint_layers(model)
    return model


def _checkpoint_layers(model) -> None:
    """Gradient checkpointing on each decoder layer, for the Hugging Face forward and rlvr's own (llama.py).
    Non-reentrant (transformers 5's default): parameters inside a checkpointed layer get their
    gradients even when its input needs none (LoRA's frozen embeddings)."""
    if hasattr(model, "activation_checkpointing_enable"):  # transformers >= 5
        model.activation_checkpointing_enable({"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable({"use_reentrant": False})


def _make_trainer(cfg: Config, method: methods.Method, model, tokenizer, data: RunData, output_dir: Path,
                  world: distributed.World) -> RunCore:
    """The method's trainer, with its reference (a frozen copy of the starting model, when its beta
    is > 0 and there is no LoRA) and, with fsdp, the sharded model it trains.  With fsdp `model` (in
    CPU memory) is sharded in place, and the model that samples is an unsharded copy of it without
    weights, gathered into it from the shards while it samples (fsdp.GatheredCopy)."""
    reference = make_reference(model, method.reference_beta(cfg))
    if not cfg.fsdp:
        return method.trainer_class().for_run(cfg, model, tokenizer, data, output_dir, reference, world)
    offload = cfg.fsdp_offload_params
    if reference is not None:  # 1/N of the reference on each process, as of the policy
        reference = fsdp.shard(reference, world.device, world.world_size, offload)
    unsharded = fsdp.without_weights(model).to(world.device)  # its buffers on the device; its weights come when gathered
    trained = fsdp.shard(model, world.device, world.world_size, offload)
    return method.trainer_class().for_run(cfg, trained, tokenizer, data, output_dir, reference, world, full_model=unsharded)
