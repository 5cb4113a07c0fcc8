"""Atomic, self-checking checkpoints and exact resume.

A checkpoint directory `checkpoint-<step>` holds the model (with LoRA only the
adapter, in peft format) and tokenizer in Hugging Face format plus
`trainer_state.pt`: optimizer, scheduler, step, data position, every RNG
state, the metrics window, and the generated batch still
being trained on when num_iterations > 1.  It is written to a temporary
directory, `manifest.json` (every file's size and SHA-256) last, then renamed
into place, so a crash mid-save never leaves a broken checkpoint that resume
would pick.  Resume checks the manifest of the newest checkpoint and falls back
to older ones, saying which it skipped and why (a flipped byte, a missing or
truncated file); leftovers of interrupted saves are removed.  A full disk is
one clear error, and the partial directory is removed; the previous
checkpoint stays.

A sharded run (fsdp) writes no whole model: `dcp/` holds the trained weights' and the
optimizer state's shards (and a moved KL reference's), each rank its own file, written by
torch.distributed.checkpoint; rank 0 writes the rest (the model's config, with LoRA the adapter
in peft's format, the tokenizer, trainer_state.pt) and the manifest over every rank's files.
The output directory must be one that every rank sees (as torch.distributed.checkpoint needs).
Such a checkpoint also loads in one process (`load_weights`: `rlvr eval` of it), and a run resumes
from it without fsdp, the optimizer state and a moved reference read whole (`load_shards`).
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import random
import shutil
import warnings
from pathlib import Path

import torch

from rlvr import distributed, jsonl
from rlvr.lora import is_peft
from rlvr.errors import CheckpointError, DiskFull  # noqa: F401 - raised here, defined in the leaf errors.py

STATE_FILE = "trainer_state.pt"
MANIFEST = "manifest.json"
DCP_DIR = "dcp"  # a sharded checkpoint's torch.distributed.checkpoint directory


def save_checkpoint(output_dir: Path, step: int, model, tokenizer, state: dict, save_total_limit: int | None,
                    keep: Path | None = None) -> Path:
    """checkpoint-<step> written atomically (see the module docstring), then the oldest checkpoints
    beyond save_total_limit removed, never the newest nor `keep` (the best one, load_best_model_at_end)."""
    output_dir = Path(output_dir)
    jsonl.sync(sorted(output_dir.glob("*.jsonl")))  # the logs the checkpoint's state counts rows of, on disk first
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp"
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
        write_manifest(tmp)
    except BaseException as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if is_disk_full(e):
            raise DiskFull(_disk_full_message(final, output_dir)) from None
        raise
    replace_dir(tmp, final)
    _rotate(output_dir, save_total_limit, keep)
    return final


def save_sharded_checkpoint(output_dir: Path, step: int, write_model, tokenizer, state: dict, shards: dict,
                            save_total_limit: int | None, world, keep: Path | None = None) -> Path | None:
    """save_checkpoint for a sharded run (fsdp); every rank calls it.  `shards` (the trained weights',
    the optimizer's, each rank's own) go into dcp/ by torch.distributed.checkpoint, each rank writing
    its file; rank 0 writes the rest, `write_model(directory)` the model's files (its config; with
    LoRA the adapter), the manifest over every rank's files last, and renames the directory into
    place.  The path on rank 0, None on the others; a failure on any rank fails the save on every
    rank, a full disk as DiskFull with the partial directory removed."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    output_dir = Path(output_dir)
    final = output_dir / f"checkpoint-{step}"
    tmp = output_dir / f".checkpoint-{step}.tmp"
    failure = None
    if world.is_main:
        try:
            jsonl.sync(sorted(output_dir.glob("*.jsonl")))
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        except Exception as e:  # noqa: BLE001 - every rank is told below, then it is raised
            failure = e
    failed = distributed.broadcast(_failure(failure), world)
    if failed is None:
        try:
            dcp.save(shards, checkpoint_id=tmp / DCP_DIR)  # a failure on one rank is raised on every rank
        except (Exception, CheckpointException) as e:  # noqa: BLE001 - CheckpointException is a BaseException
            failure = e
        if world.is_main and failure is None:
            try:
                write_model(tmp)
                tokenizer.save_pretrained(tmp)
                torch.save({**state, "rng": rng_state()}, tmp / STATE_FILE)
                write_manifest(tmp)
                replace_dir(tmp, final)
                _rotate(output_dir, save_total_limit, keep)
            except Exception as e:  # noqa: BLE001
                failure = e
        failed = distributed.broadcast(_failure(failure) if world.is_main else None, world)
        if failed is None and failure is not None:  # the save failed on every rank (dcp), rank 0 saw it
            failed = _failure(failure)
    if failed is None:
        return final if world.is_main else None
    if world.is_main:
        shutil.rmtree(tmp, ignore_errors=True)
    if failed[0] == "disk full":
        raise DiskFull(_disk_full_message(final, output_dir)) from None
    if isinstance(failure, Exception):
        raise failure
    raise CheckpointError(f"checkpoint-{step} could not be written: {failed[1]}")


def _failure(error: BaseException | None) -> tuple[str, str] | None:
    """What every rank is told of a failed save: ("disk full" or "error", one line), None if none."""
    if error is None:
        return None
    return ("disk full" if is_disk_full(error) else "error", _one_line(error))


def _one_line(error: BaseException) -> str:
    """An error in one line; torch.distributed.checkpoint's, which holds every failed rank's traceback,
    as its last line (the error itself)."""
    lines = [line.strip() for line in str(error).splitlines() if line.strip()]
    if type(error).__name__ == "CheckpointException":  # torch.distributed.checkpoint's, not imported for this
        return lines[-1] if lines else "CheckpointException"
    return f"{error.__class__.__name__}: {lines[0] if lines else ''}"


def replace_dir(tmp: Path, final: Path) -> None:
    """Put `tmp` in the place of `final`; a crash in between leaves one of them whole."""
    old = final.with_name(f".{final.name}.old")
    if final.exists():
        shutil.rmtree(old, ignore_errors=True)
        os.replace(final, old)
    os.replace(tmp, final)
    _fsync_dir(final.parent)
    shutil.rmtree(old, ignore_errors=True)


def write_manifest(directory: Path) -> None:
    """manifest.json: every file's size and SHA-256, written (and synced) after them."""
    files = {}
    for path in sorted(p for p in directory.rglob("*") if p.is_file()):
        _fsync_file(path)
        files[str(path.relative_to(directory))] = {"bytes": path.stat().st_size, "sha256": _sha256(path)}
    manifest = directory / MANIFEST
    manifest.write_text(json.dumps({"files": files}, indent=1) + "\n")
    _fsync_file(manifest)


def verify(directory: Path, trust_unverified: bool = False) -> str | None:
    """None if the checkpoint is whole, else what is wrong with it (one line).  Whole means: every
    file its manifest lists is there with its size and SHA-256, and no other file is (a shard it
    does not list would be loaded beside the others).  A checkpoint without a manifest cannot be
    checked and is refused, unless `trust_unverified` (trust_unverified_checkpoint=true) and it
    has weights and a trainer state."""
    directory = Path(directory)
    if not directory.is_dir():
        return "not a directory"
    manifest = directory / MANIFEST
    if not manifest.is_file():
        if not any(directory.iterdir()):
            return "empty"
        weights = list(directory.glob("*.safetensors")) or is_sharded(directory)
        if not ((directory / STATE_FILE).is_file() and weights):
            return f"incomplete: no {MANIFEST}"
        if trust_unverified:
            return None
        return (f"no {MANIFEST}, so its files cannot be checked (a checkpoint of an rlvr before manifests, or not "
                "written by rlvr); trust_unverified_checkpoint=true loads it unchecked")
    try:
        files = json.loads(manifest.read_text())["files"]
        if not isinstance(files, dict) or not all(isinstance(w, dict) for w in files.values()):
            raise TypeError
    except (ValueError, KeyError, TypeError):
        return f"{MANIFEST} is unreadable"
    for name, want in files.items():
        path = directory / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != want.get("bytes"):
            return f"{name} has {path.stat().st_size} bytes, the manifest says {want.get('bytes')}"
        if _sha256(path) != want.get("sha256"):
            return f"{name} does not match its SHA-256 in the manifest (corrupted)"
    unlisted = sorted(str(p.relative_to(directory)) for p in directory.rglob("*") if p.is_file() and p != manifest
                      and str(p.relative_to(directory)) not in files)
    if unlisted:
        return f"files its {MANIFEST} does not list: {', '.join(unlisted[:5])}{' ...' if len(unlisted) > 5 else ''}"
    if STATE_FILE not in files:
        return f"incomplete: no {STATE_FILE}"
    return None


def checkpoints(output_dir: Path) -> list[Path]:
    """checkpoint-<step> directories, newest first."""
    found = [p for p in Path(output_dir).glob("checkpoint-*") if p.is_dir() and p.name.split("-")[-1].isdigit()]
    return sorted(found, key=lambda p: int(p.name.split("-")[-1]), reverse=True)


def clean_leftovers(output_dir: Path) -> list[str]:
    """Remove what interrupted saves left (`.checkpoint-*.tmp`, `.*.old`, empty checkpoint dirs); their names."""
    removed = []
    for path in sorted(Path(output_dir).glob(".checkpoint-*")) + [p for p in checkpoints(output_dir) if not any(p.iterdir())]:
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path.name)
    return removed


def resumable(output_dir: Path, say=print, trust_unverified: bool = False) -> Path | None:
    """The newest checkpoint that verifies; each one skipped is reported with its reason."""
    for path in checkpoints(output_dir):
        problem = verify(path, trust_unverified)
        if problem is None:
            return path
        say(f"skipping {path.name}: {problem}")
    return None


def is_disk_full(error: BaseException) -> bool:
    """ENOSPC / EDQUOT, also as torch's zip writer (a RuntimeError naming the failed write) and
    safetensors (a SafetensorError quoting the OS error) report it."""
    while error is not None:
        if isinstance(error, OSError) and error.errno in (errno.ENOSPC, errno.EDQUOT):
            return True
        text = str(error)
        if isinstance(error, RuntimeError) and "unexpected pos" in text:
            return True
        if any(sign in text for sign in ("No space left", "Disk quota exceeded", "os error 28)", "os error 122)")):
            return True
        error = error.__cause__ or error.__context__
    return False


def _disk_full_message(final: Path, output_dir: Path) -> str:
    free = shutil.disk_usage(output_dir).free
    previous = next((p for p in checkpoints(output_dir) if p != final), None)
    need = sum(f.stat().st_size for f in previous.rglob("*") if f.is_file()) if previous else None
    needed = f"about {_gb(need)} needed (the size of {previous.name}), " if need else ""
    kept = f"; {previous.name} stays" if previous else ""
    return (f"disk full: could not write {final} ({needed}{_gb(free)} free in {output_dir}); the partial checkpoint "
            f"was removed{kept}. Free some space, then continue with resume=true")


def _gb(n: int) -> str:
    return f"{n / 1e9:.2f} GB" if n >= 1e8 else f"{n / 1e6:.1f} MB"


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _fsync_file(path: Path) -> None:
    with path.open("rb") as f:
        os.fsync(f.fileno())


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def load_checkpoint(path: Path, model) -> dict:
    """Load weights into `model` and return the trainer state (RNG states restored)."""
    path = Path(path)
    if not (path / STATE_FILE).is_file():
        raise FileNotFoundError(f"{path} is not a complete rlvr checkpoint (needs *.safetensors and {STATE_FILE})")
    load_weights(path, model)
    return load_trainer_state(path)


def load_trainer_state(path: Path) -> dict:
    """A checkpoint's trainer_state.pt, its RNG states restored."""
    state = torch.load(Path(path) / STATE_FILE, weights_only=False, map_location="cpu")
    set_rng_state(state.pop("rng"))
    return state


def is_sharded(path: Path) -> bool:
    """Whether a checkpoint was written by a sharded run (its weights and optimizer state in dcp/)."""
    return (Path(path) / DCP_DIR / ".metadata").is_file()


def load_shards(path: Path, shards: dict) -> None:
    """Fill `shards` (laid out as save_sharded_checkpoint was given them) from a sharded checkpoint:
    every rank reads its own part (a collective); onto another number of ranks too, and whole in one
    process (a run resumed without fsdp)."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        _dcp_load(path, shards, checkpoint_id=Path(path) / DCP_DIR)
        return
    with warnings.catch_warnings():  # it says it assumes one process, which is what this is
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(path, shards, checkpoint_id=Path(path) / DCP_DIR, no_dist=True)


def _dcp_load(path: Path, shards: dict, **how) -> None:
    """torch.distributed.checkpoint.load(shards, **how) of checkpoint `path`, whose failure (a
    CheckpointException: a BaseException holding every failed rank's traceback) is one CheckpointError line."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        dcp.load(shards, **how)
    except CheckpointException as e:
        raise CheckpointError(f"{path}: its shards (dcp/) could not be read: {_one_line(e)}") from None


def _sharded_weights(path: Path) -> dict:
    """A sharded checkpoint's trained weights, whole, read in this one process."""
    import torch.distributed.checkpoint as dcp

    reader = dcp.FileSystemReader(str(Path(path) / DCP_DIR))
    weights = {}
    for key, item in reader.read_metadata().state_dict_metadata.items():
        if key.startswith("model.") and isinstance(item, dcp.metadata.TensorStorageMetadata):
            weights[key.removeprefix("model.")] = torch.empty(item.size, dtype=item.properties.dtype)
    with warnings.catch_warnings():  # it says it assumes one process, which is what this is
        warnings.simplefilter("ignore", UserWarning)
        _dcp_load(path, {"model": weights}, storage_reader=reader, no_dist=True)
    return weights


def load_weights(path: Path, model) -> None:
    """A checkpoint's weights into `model` (with LoRA, the adapter's); nothing else of the checkpoint."""
    from safetensors.torch import load_file

    path = Path(path)
    shards = sorted(path.glob("*.safetensors"))  # a sharded LoRA run's checkpoint has its adapter here too
    if not shards and not is_sharded(path):
        raise FileNotFoundError(f"{path} is not a complete rlvr checkpoint (needs *.safetensors and {STATE_FILE})")
    weights = {} if shards else _sharded_weights(path)
    for shard in shards:
        weights.update(load_file(shard))
    if is_peft(model):  # a LoRA checkpoint holds only the adapter; the frozen base is the model's own
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(model, weights)
        missing = [k for k in result.missing_keys if "lora_" in k]
        unexpected = result.unexpected_keys
    else:
        try:
            missing, unexpected = model.load_state_dict(weights, strict=False)
        except RuntimeError as e:  # torch lists every mismatched shape: the first says enough
            detail = next((line.strip() for line in str(e).splitlines() if "size mismatch" in line), str(e).splitlines()[0])
            raise CheckpointError(f"checkpoint {path} does not fit the model ({detail}); resume with the model it was "
                                  "trained from") from None
    # Tied output embeddings are saved once; anything else missing is a real mismatch.
    missing = [k for k in missing if not _is_tied(model, k)]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {path} does not fit the model: missing {missing[:5]}, unexpected {unexpected[:5]}; "
                              "resume with the model it was trained from")


def trainer_state(step: int, parts: dict, **values) -> dict:
    """What trainer_state.pt holds besides the RNG states: the step, the state_dict() of each part
    (optimizer, scheduler, prompt stream, ...) under its name, and plain values."""
    return {"step": step, **{name: part.state_dict() for name, part in parts.items()}, **values}


def restore_trainer_state(state: dict, parts: dict) -> None:
    """Load each part's state from `state`; a part a checkpoint of an older rlvr lacks keeps its own."""
    if "kl" not in state and "beta" in state:  # before the KL state had a name of its own
        state["kl"] = {"beta": state["beta"], "kl_control": state.get("kl_control")}
    for name, part in parts.items():
        if state.get(name) is not None:
            part.load_state_dict(state[name])


class GeneratorState:
    """A torch.Generator as a checkpoint part."""

    def __init__(self, generator: torch.Generator):
        self.generator = generator

    def state_dict(self):
        return self.generator.get_state()

    def load_state_dict(self, state) -> None:
        self.generator.set_state(state)


def _is_tied(model, key: str) -> bool:
    return key.endswith("lm_head.weight") and getattr(model.config, "tie_word_embeddings", False)


def _rotate(output_dir: Path, limit: int | None, keep: Path | None = None) -> None:
    """Remove the oldest checkpoints until `limit` are left, keeping the newest and `keep` whatever the
    limit (transformers' rotate_checkpoints: save_total_limit=1 with a best checkpoint keeps two)."""
    if not limit:
        return
    found = checkpoints(output_dir)  # newest first
    protected = {found[0].name} if found else set()
    if keep is not None:
        protected.add(Path(keep).name)
    extra = len(found) - max(limit, len(protected & {p.name for p in found}))
    for old in [p for p in reversed(found) if p.name not in protected][:max(extra, 0)]:
        shutil.rmtree(old, ignore_errors=True)


def rng_state() -> dict:
    return {"python": random.getstate(), "torch": torch.get_rng_state()}


def set_rng_state(state: dict) -> None:
    random.setstate(state["python"])
    torch.set_rng_state(state["torch"])
