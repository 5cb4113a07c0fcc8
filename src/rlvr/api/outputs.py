"""What transformers' Trainer offers a script besides train(), for TRL's scripts on rlvr's trainers:
metrics printed and saved ({split}_results.json, all_results.json), trainer_state.json, a model
card (README.md), the push to the Hub (hub.py), the processes as `trainer.accelerator` shows them,
the callbacks added and removed by class or instance, and end().

Files are written by the first process only, as transformers does; `output_dir` is the run's
directory once trained, else the config's."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

__all__ = ["ScriptMethods", "Processes"]


class Processes:
    """accelerate's Accelerator as TRL's scripts use it: which process this is, of how many, on which
    device; wait_for_everyone() and print() (on the first process of each machine).  rlvr reads the
    launch from torchrun's variables (distributed.py) and needs no Accelerator of its own."""

    def __init__(self, use_cpu: bool = False):
        from rlvr.distributed import world_from_env

        self._world = world_from_env(use_cpu=use_cpu)

    @property
    def process_index(self) -> int:
        return self._world.rank

    @property
    def local_process_index(self) -> int:
        return self._world.local_rank

    @property
    def num_processes(self) -> int:
        return self._world.world_size

    @property
    def is_main_process(self) -> bool:
        return self._world.rank == 0

    @property
    def is_local_main_process(self) -> bool:
        return self._world.local_rank == 0

    @property
    def is_last_process(self) -> bool:
        return self._world.rank == self._world.world_size - 1

    @property
    def device(self):
        import torch

        return torch.device(self._world.device)

    def wait_for_everyone(self) -> None:
        import torch

        if torch.distributed.is_available() and torch.distributed.is_initialized():
            torch.distributed.barrier()

    def print(self, *args, **kwargs) -> None:
        if self.is_local_main_process:
            print(*args, **kwargs)

    def unwrap_model(self, model, keep_fp32_wrapper: bool = True):
        return model  # rlvr's trainers hand out the model itself, never a DDP or FSDP wrapper

    def end_training(self) -> None:
        """Nothing to finish: rlvr's run closes its own loggers."""


class ScriptMethods:
    """Mixed into GRPOTrainer (and so SFTTrainer, DPOTrainer): needs self.args, self.cfg, self.callbacks,
    self.state and, after train(), self.output_dir."""

    @property
    def accelerator(self) -> Processes:
        if getattr(self, "_processes", None) is None:
            self._processes = Processes(self.cfg.use_cpu)
        return self._processes

    def is_world_process_zero(self) -> bool:
        return self.accelerator.is_main_process

    def is_local_process_zero(self) -> bool:
        return self.accelerator.is_local_main_process

    def _out(self) -> Path:
        return Path(getattr(self, "output_dir", None) or self.args.output_dir)

    # --- metrics and state ---------------------------------------------------------------------

    def log_metrics(self, split: str, metrics: dict[str, Any]) -> None:
        """Print `metrics` under a `***** {split} metrics *****` heading, one aligned line each (first process)."""
        if not self.is_world_process_zero():
            return
        print(f"***** {split} metrics *****")
        width = max((len(k) for k in metrics), default=0)
        for key in sorted(metrics):
            value = metrics[key]
            shown = f"{value:.4g}" if isinstance(value, float) else value
            print(f"  {key:<{width}} = {shown}")

    def save_metrics(self, split: str, metrics: dict[str, Any], combined: bool = True) -> None:
        """`{split}_results.json` in output_dir; with `combined`, merged into all_results.json too."""
        if not self.is_world_process_zero():
            return
        out = self._out()
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{split}_results.json").write_text(json.dumps(metrics, indent=4, sort_keys=True))
        if combined:
            path = out / "all_results.json"
            merged = json.loads(path.read_text()) if path.exists() else {}
            merged.update(metrics)
            path.write_text(json.dumps(merged, indent=4, sort_keys=True))

    def save_state(self) -> None:
        """transformers' TrainerState of the run as output_dir/trainer_state.json."""
        if self.is_world_process_zero():
            self._out().mkdir(parents=True, exist_ok=True)
            self.state.save_to_json(str(self._out() / "trainer_state.json"))

    # --- callbacks -----------------------------------------------------------------------------

    def add_callback(self, callback) -> None:
        """A callback (a class is made into one) added to the run's."""
        self.callbacks.add(callback)

    def pop_callback(self, callback):
        """The first callback of this class, or this callback, removed and returned; None when absent."""
        return self.callbacks.pop(callback)

    def remove_callback(self, callback) -> None:
        """The first callback of this class, or this callback, removed."""
        self.callbacks.remove(callback)

    # --- the model card and the Hub --------------------------------------------------------------

    @property
    def hub_model_id(self) -> str:
        """The repository push_to_hub uploads to: hub_model_id, else the output_dir's name (under the token's user)."""
        from rlvr.hub import repo_name

        return repo_name(self.cfg.run_settings, self._out())

    def create_model_card(self, model_name: str | None = None, dataset_name: str | None = None,
                          tags: str | list[str] | None = None, **_unused) -> None:
        """README.md in output_dir: the Hub's metadata (base model, datasets, tags) and how it was trained."""
        if not self.is_world_process_zero():
            return
        from importlib.metadata import PackageNotFoundError, version

        try:
            release = f" {version('rlvr')}"
        except PackageNotFoundError:  # run from a source tree
            release = ""
        method = self.args._method
        base = self.cfg.model
        tags = [tags] if isinstance(tags, str) else list(tags or [])
        tags = list(dict.fromkeys(["rlvr", method, *tags]))
        header = {"base_model": base if base and not os.path.isdir(base) else None, "library_name": "transformers",
                  "model_name": model_name or self._out().name, "tags": tags,
                  "datasets": [dataset_name] if dataset_name else None}
        lines = ["---", *(f"{k}: {json.dumps(v)}" for k, v in header.items() if v is not None), "---", "",
                 f"# {header['model_name']}", "",
                 f"Trained from `{base}` with {method.upper()} by rlvr{release}, "
                 "through TRL's Python API" + (f", on `{dataset_name}`." if dataset_name else "."), "",
                 f"Steps: {self.state.global_step}. The run's settings are in config.yaml, its metrics in metrics.jsonl "
                 "when they were saved beside the model.", ""]
        self._out().mkdir(parents=True, exist_ok=True)
        (self._out() / "README.md").write_text("\n".join(lines))

    def push_to_hub(self, commit_message: str | None = "End of training", blocking: bool = True, token: str | None = None,
                    revision: str | None = None, **card) -> str:
        """The model card (create_model_card(**card)), then output_dir uploaded to hub_model_id as
        rlvr's push_to_hub setting does (hub.py: without checkpoints, commit message "End of training");
        returns the repository's URL."""
        import dataclasses

        from rlvr.hub import push

        if revision is not None:
            raise ValueError("push_to_hub(revision=...) is not supported: rlvr pushes to the repository's main branch")
        self.create_model_card(**card)
        if not self.is_world_process_zero():
            return ""
        settings = self.cfg.run_settings
        if token is not None:
            settings = dataclasses.replace(settings, hub_token=token)
        return push(settings, self._out())

    def end(self) -> None:
        """transformers' Trainer.end(): leave the process group, if this process joined one."""
        from rlvr.distributed import shutdown

        shutdown(self.accelerator._world)
