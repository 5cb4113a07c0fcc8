"""The run directory: one run per directory (a lock), which checkpoint a resumed run continues
from, logs that hold each step once, and the final model moved in whole.

A run holds an exclusive `flock` on `<output_dir>/.lock` (with its PID) from before it decides
anything until it ends; a second writer is refused with that PID.  The kernel drops the lock
when its process dies, so a lock left by a killed run is simply taken over.  A process forked
from the run (a reward function's child, a reward or tool worker) closes its copy of the lock at
once: otherwise it would hold the lock after the run died, and refuse the resume.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import socket
import time
import weakref
from pathlib import Path
from typing import TYPE_CHECKING

from rlvr import distributed, lora
from rlvr.checkpoint import CheckpointError, DiskFull, checkpoints, clean_leftovers, is_disk_full, resumable, verify
from rlvr.errors import ConfigError
from rlvr.models import latest_checkpoint

if TYPE_CHECKING:
    from rlvr.config import DataSettings, OutputSettings

LOCK = ".lock"


class RunLocked(RuntimeError):
    pass


_OPEN_LOCKS: "weakref.WeakSet[RunLock]" = weakref.WeakSet()


def _forget_locks_in_child() -> None:
    """In a forked child: close the inherited lock descriptors without unlocking (the parent holds them)."""
    for lock in list(_OPEN_LOCKS):
        if lock.fd >= 0:
            with contextlib.suppress(OSError):
                os.close(lock.fd)
            lock.fd = -1


os.register_at_fork(after_in_child=_forget_locks_in_child)


class RunLock:
    """An exclusive lock on a run directory, held while this object is open."""

    def __init__(self, output_dir: Path, say=print):
        output_dir.mkdir(parents=True, exist_ok=True)
        self.path = output_dir / LOCK
        self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = self._holder()
            os.close(self.fd)
            raise RunLocked(f"{output_dir} is in use by another rlvr run ({holder}); wait for it to end, "
                            "or pick another output_dir") from None
        previous = self._holder()
        if previous:
            say(f"{output_dir}: the lock of an earlier run ({previous}) was left behind; taken over")
        _OPEN_LOCKS.add(self)
        os.ftruncate(self.fd, 0)
        os.pwrite(self.fd, f"pid {os.getpid()} on {socket.gethostname()} since {time.strftime('%Y-%m-%d %H:%M:%S')}\n".encode(), 0)

    def _holder(self) -> str:
        return os.pread(self.fd, 200, 0).decode(errors="replace").strip()

    def close(self) -> None:
        if self.fd >= 0:
            os.ftruncate(self.fd, 0)
            fcntl.flock(self.fd, fcntl.LOCK_UN)
            os.close(self.fd)
            self.fd = -1


def prepare_output_dir_once(settings: OutputSettings, default_dir: Path, current: dict, world: distributed.World, say=print):
    """prepare_output_dir on rank 0, its answer (or its error) on every rank; the lock is rank 0's."""
    if not world.enabled:
        return prepare_output_dir(settings, default_dir, current, say)
    answer, lock = None, None
    if world.is_main:
        try:
            *answer, lock = prepare_output_dir(settings, default_dir, current, say)
        except (FileExistsError, FileNotFoundError, CheckpointError, RunLocked, SettingsChanged) as e:
            answer = e
    answer = distributed.broadcast(answer, world)
    if isinstance(answer, Exception):
        raise answer
    return (*answer, lock)


def prepare_output_dir(settings: OutputSettings, default_dir: Path, current: dict, say=print):
    """(the run's directory, the checkpoint to resume from or None, the lock).  default_dir: where
    a new run goes without output_dir (default_output_dir); current: every setting of the run as
    config.yaml holds it (Config.without_secrets().to_dict()), for compare_settings.

    resume=true takes the newest checkpoint that verifies (checkpoint.py), reporting the ones it
    skips; a run that stopped before its first checkpoint starts over in its directory.  The
    logs keep the steps up to the checkpoint, each once (rows of replayed steps are dropped).
    Nothing is looked at or changed before the directory's lock is held."""
    if settings.resume_checkpoint:  # TRL's resume_from_checkpoint=<path>
        output_dir = Path(settings.output_dir) if settings.output_dir else Path(settings.resume_checkpoint).parent
    elif settings.resume:
        output_dir = Path(settings.output_dir) if settings.output_dir else latest_run_dir()
    else:
        output_dir = Path(settings.output_dir) if settings.output_dir else Path(default_dir)
    lock = RunLock(output_dir, say)
    try:  # any error from here on lets go of the directory
        checkpoint = _checkpoint_to_resume(settings, output_dir, say)
        step = _step_of(checkpoint) if checkpoint else 0
        changed_course = checkpoint is not None and compare_settings(current, output_dir, step, settings.resume_override, say)
        later = [p for p in checkpoints(output_dir) if _step_of(p) > step] if checkpoint is not None else []
        aside = set_aside(output_dir, step, later, say) if later or changed_course else None
        _keep_logs_until(output_dir, step, say, aside)
    except BaseException:
        lock.close()
        raise
    return output_dir, checkpoint, lock


def _checkpoint_to_resume(settings: OutputSettings, output_dir: Path, say) -> Path | None:
    """The checkpoint the run continues from, or None for a new run (or one with no checkpoint yet)."""
    if settings.resume_checkpoint:
        checkpoint = Path(settings.resume_checkpoint)
        problem = verify(checkpoint, settings.trust_unverified_checkpoint)
        if problem is not None:
            raise CheckpointError(f"resume_from_checkpoint={checkpoint}: {problem}")
        return checkpoint
    if settings.resume:
        for name in clean_leftovers(output_dir):
            say(f"removed {name}: left by an interrupted save")
        checkpoint = resumable(output_dir, say, settings.trust_unverified_checkpoint)
        if checkpoint is None and checkpoints(output_dir):
            raise CheckpointError(f"resume=true but no checkpoint in {output_dir} verifies (see above); "
                                  "resume_from_checkpoint=<dir> resumes from one you choose")
        finished = any((output_dir / name).is_file() for name in ("config.json", "adapter_config.json"))  # its final model
        if checkpoint is None and finished:  # starting over would drop its logs
            raise CheckpointError(f"resume=true but {output_dir} holds a finished run without a checkpoint (save_strategy=no "
                                  f"keeps none): there is nothing to continue from. Train on from its final model in a "
                                  f"new run: model={output_dir} output_dir=<another dir>")
        if checkpoint is None:
            say(f"{output_dir} has no checkpoint yet: the run starts over there")
        return checkpoint
    if (output_dir / "metrics.jsonl").exists() or checkpoints(output_dir):
        raise FileExistsError(
            f"{output_dir} already holds a training run; continue it with resume=true, or pick another output_dir"
        )
    return None


# Settings a resumed run may change: what it logs, saves, evaluates and alerts on, how long it
# runs, and where it connects; any other change alters the run's course from the checkpoint.
FREE_TO_CHANGE = {
    "output_dir", "resume", "resume_checkpoint", "resume_override", "on_save_error", "trust_unverified_checkpoint", "logging_steps", "save_steps",
    "save_total_limit", "log_completions", "num_completions_to_print", "report_to", "report_steps", "on_alert",
    "eval_on_start", "eval_on_end", "eval_strategy", "eval_steps", "eval_num_samples", "eval_num_shots",
    "eval_max_examples", "eval_temperature", "eval_batch_size", "eval_output", "max_steps", "num_train_epochs",
    "vllm_server_host", "vllm_server_port", "vllm_server_timeout", "vllm_weight_transfer", "ray_address", "rollout_workers",
    "vllm_gpu_memory_utilization", "vllm_kv_cache_gb", "use_cpu", "save_strategy", "run_name", "push_to_hub",
    "hub_model_id", "hub_token", "hub_private_repo", "metric_for_best_model", "greater_is_better", "load_best_model_at_end",
}


class SettingsChanged(ConfigError):
    pass


def compare_settings(current: dict, output_dir: Path, step: int, override: bool, say=print) -> bool:
    """Resuming with other settings (`current`, as config.yaml holds them) than the run's config.yaml:
    free ones are reported, the others refused unless `override` (resume_override=true; then True:
    the run takes another course from `step`).  The previous config.yaml is kept as
    config.before-step-<N>.yaml."""
    saved_path = output_dir / "config.yaml"
    if not saved_path.is_file():
        return False
    import yaml

    saved = yaml.safe_load(saved_path.read_text()) or {}
    current = yaml.safe_load(yaml.safe_dump(current, sort_keys=False))  # the same YAML round trip
    changed = {k: (saved[k], v) for k, v in current.items() if k in saved and saved[k] != v}
    course = {k: d for k, d in changed.items() if k not in FREE_TO_CHANGE and not k.startswith("alert_")}
    free = {k: d for k, d in changed.items() if k not in course and k not in ("output_dir", "resume", "resume_checkpoint", "resume_override")}
    listing = "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in course.items())
    if course and not override:
        raise SettingsChanged(f"resume with settings that change the run's course from step {step}: {listing}. "
                              "Resume with the run's own settings (its config.yaml), or add resume_override=true")
    if course:
        say(f"resume_override=true: continuing from step {step} with {listing}")
    if free:
        say("resumed with " + "; ".join(f"{k}: {a!r} -> {b!r}" for k, (a, b) in free.items()))
    if course or free:
        shutil.copyfile(saved_path, output_dir / f"config.before-step-{step}.yaml")
    return bool(course)


LOGS = ("metrics.jsonl", "completions.jsonl", "alerts.jsonl", "audit.jsonl")


def _step_of(checkpoint: Path) -> int:
    return int(checkpoint.name.split("-")[-1])


# What a finished run leaves beside its logs: its final model (rundir.save_final_model), summary and last evaluation.
FINAL_FILES = ("config.json", "generation_config.json", "adapter_config.json", "*.safetensors", "model.safetensors.index.json",
               "tokenizer*", "special_tokens_map.json", "chat_template.jinja", "vocab.json", "merges.txt", "summary.json",
               "eval_after.json")


def set_aside(output_dir: Path, step: int, later: list[Path], say=print) -> Path:
    """A resume that leaves a timeline: from an older checkpoint than the newest (resume_from_checkpoint),
    or with resume_override=true.  The checkpoints after `step`, the final model of the run being
    left and (by _keep_logs_until) the log rows after `step` move to abandoned/<time>-after-step-<step>/,
    so that nothing of that timeline is mixed into the new one, and nothing of it is lost."""
    aside = output_dir / "abandoned" / f"{time.strftime('%Y%m%d-%H%M%S')}-after-step-{step}"
    aside.mkdir(parents=True, exist_ok=True)
    moved = list(later)
    moved += [p for pattern in FINAL_FILES for p in sorted(output_dir.glob(pattern)) if p.is_file()]
    for path in moved:
        os.replace(path, aside / path.name)
    names = ", ".join(p.name for p in later) or "no later checkpoint"
    say(f"a new timeline from step {step}: {names}{' and the final model' if len(moved) > len(later) else ''} "
        f"and the logged rows after step {step} moved to {aside}")
    return aside


def _keep_logs_until(output_dir: Path, step: int, say=print, aside: Path | None = None) -> None:
    """Drop the rows of steps after `step` (a resumed run writes them again; into `aside` when the run
    takes another timeline) and torn lines."""
    for name in LOGS:
        path = output_dir / name
        if not path.is_file():
            continue
        kept, later, torn = [], [], 0
        for line in path.read_text(errors="replace").splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                torn += bool(line.strip())
                continue
            if isinstance(row, dict) and isinstance(row.get("step"), int) and row["step"] > step:
                later.append(line)
                continue
            kept.append(line)
        if aside is not None and later:
            (aside / name).write_text("".join(line + "\n" for line in later))
        if later or torn:
            tmp = path.with_name(f".{name}.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            os.replace(tmp, path)
            say(f"{name}: kept the rows up to step {step}" + (f", dropped {len(later)} of later steps" if later and aside is None else "")
                + (f", {torn} torn line{'s' * (torn > 1)}" if torn else ""))


def latest_run_dir(root: Path = Path("runs")) -> Path:
    runs = [p for p in root.glob("*") if p.is_dir() and latest_checkpoint(p) is not None]
    if not runs:
        raise FileNotFoundError(f"resume=true without output_dir, and no run with a checkpoint under {root}/")
    return max(runs, key=lambda p: latest_checkpoint(p).stat().st_mtime)


def default_output_dir(settings: OutputSettings, data: DataSettings, command: str) -> Path:
    """runs/<run_name>-<date>-<time>; without a run_name, the dataset's or the task's name (after
    the command's for rlvr sft / rft / dpo: runs/sft-arithmetic-...; `command`: FinetuneSettings.command)."""
    name = settings.run_name or (Path(data.dataset).stem if data.dataset else data.task)
    if not settings.run_name and command != "train":
        name = f"{command}-{name}"
    return Path("runs") / f"{name.replace('/', '-')}-{time.strftime('%Y%m%d-%H%M%S')}"


def save_final_model(model, tokenizer, output_dir: Path, how: str, write=None) -> None:
    """The final model in the run directory, written beside it first and moved in with its
    config.json (or adapter_config.json) last: a stop half way leaves no config, and `rlvr eval`
    of the run then takes its newest checkpoint instead of a model without weights.  `write(directory)`
    writes the model's files in place of `model`'s save_pretrained (fsdp: streamed from the shards)."""
    tmp = output_dir / ".final.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir()
        if write is not None:
            write(tmp)
        else:
            lora.save_final(model, tmp, how)  # with LoRA: the adapter, or the merged model
        tokenizer.save_pretrained(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise DiskFull(f"disk full: could not write the final model into {output_dir} "
                           f"({shutil.disk_usage(output_dir).free / 1e9:.2f} GB free); the checkpoints stay") from None
        raise
    configs = ("config.json", "adapter_config.json")
    for path in sorted(tmp.iterdir(), key=lambda p: p.name in configs):  # the configs last
        os.replace(path, output_dir / path.name)
    shutil.rmtree(tmp, ignore_errors=True)
