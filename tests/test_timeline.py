"""Which checkpoint a run continues from, and what every load of a checkpoint checks first:
resuming from an older checkpoint starts a new timeline, and nothing unverified is loaded."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlvr import cli
from rlvr.checkpoint import CheckpointError, MANIFEST, verify
from rlvr.run import train
from rlvr.trainer import Trainer

SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(autouse=True)
def text_reward(monkeypatch):
    """Rewards of the text alone, so every group carries signal and every step moves the weights."""
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])


def _weights(path: Path) -> dict:
    return load_file(str(path / "model.safetensors"))


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def _rows(path: Path) -> list[dict]:
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")}
            for r in rows]


@contextlib.contextmanager
def _stopped_after(monkeypatch, step: int):
    """Within: a Ctrl-C once `step` steps are done (the run saves a checkpoint of that step and stops)."""
    real = Trainer.train_step

    def stop(self, on_step=None):
        if self.step == step:
            raise KeyboardInterrupt
        return real(self, on_step)

    with monkeypatch.context() as m:
        m.setattr(Trainer, "train_step", stop)
        yield


def _cfg(tiny_run_config, out, **kw):
    return tiny_run_config(out, **{"max_steps": 6, "save_steps": 2, **kw})


@pytest.mark.trains
def test_resuming_from_an_older_checkpoint_starts_a_new_timeline(tiny_run_config, tmp_path, monkeypatch, capsys):
    """A finished 6-step run is taken back to checkpoint-2 with a lower learning rate; that run is
    stopped after step 4, then continued with resume=true.  It must continue its own step 4 (not
    the abandoned run's checkpoint-6), end with the weights of the same change made without a
    stop, and keep the abandoned checkpoints and rows apart, whole."""
    first = tmp_path / "first"
    train(_cfg(tiny_run_config, first))
    wanted = tmp_path / "wanted"  # the change, made without a stop, in a directory of its own
    train(_cfg(tiny_run_config, wanted, resume_checkpoint=str(first / "checkpoint-2"), learning_rate=5e-4,
               resume_override=True))

    out = tmp_path / "run"
    shutil.copytree(first, out)
    old_rows = _rows(out / "metrics.jsonl")
    with _stopped_after(monkeypatch, 4), pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, out, resume_checkpoint=str(out / "checkpoint-2"), learning_rate=5e-4, resume_override=True))
    said = capsys.readouterr().out
    assert "a new timeline from step 2: checkpoint-6, checkpoint-4 and the final model" in said
    train(_cfg(tiny_run_config, out, resume=True, learning_rate=5e-4))  # the settings of the timeline it continues
    assert "resumed from " + str(out / "checkpoint-4") in capsys.readouterr().out

    assert _same(_weights(out), _weights(wanted)) and not _same(_weights(out), _weights(first))
    rows = _rows(out / "metrics.jsonl")
    assert rows[:2] == old_rows[:2] and rows[2:] == _rows(wanted / "metrics.jsonl")
    [aside] = (out / "abandoned").iterdir()
    assert aside.name.endswith("-after-step-2")
    assert sorted(p.name for p in aside.glob("checkpoint-*")) == ["checkpoint-4", "checkpoint-6"]
    assert _same(load_file(str(aside / "model.safetensors")), _weights(first))  # the abandoned final model, whole
    assert _rows(aside / "metrics.jsonl") == old_rows[2:]  # the abandoned rows, set aside, not lost


@pytest.mark.trains
def test_resume_true_after_a_stop_sets_nothing_aside(tiny_run_config, tmp_path, monkeypatch):
    out = tmp_path / "run"
    with _stopped_after(monkeypatch, 3), pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, out))
    train(_cfg(tiny_run_config, out, resume=True))
    assert not (out / "abandoned").exists()


# --- every load verifies ------------------------------------------------------------------------

@pytest.mark.trains
def test_a_checkpoint_without_a_manifest_is_trusted_only_when_told(tiny_run_config, tmp_path, capsys):
    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, max_steps=4))
    (out / "model.safetensors").unlink()
    (out / "config.json").unlink()
    (out / "checkpoint-4" / MANIFEST).unlink()
    problem = verify(out / "checkpoint-4")
    assert "no manifest.json, so its files cannot be checked" in problem and "trust_unverified_checkpoint=true" in problem
    assert verify(out / "checkpoint-4", trust_unverified=True) is None
    with pytest.raises(CheckpointError, match="no manifest.json"):
        train(_cfg(tiny_run_config, out, max_steps=4, resume_checkpoint=str(out / "checkpoint-4")))
    train(_cfg(tiny_run_config, out, max_steps=4, resume=True))  # falls back to checkpoint-2, saying why
    said = capsys.readouterr().out
    assert "skipping checkpoint-4: no manifest.json" in said and "resumed from " + str(out / "checkpoint-2") in said


@pytest.mark.trains
def test_a_shard_the_manifest_does_not_list_is_refused(tiny_run_config, tmp_path):
    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, max_steps=2))
    ckpt = out / "checkpoint-2"
    weights = load_file(str(ckpt / "model.safetensors"))
    save_file({k: v + 1 for k, v in weights.items()}, str(ckpt / "model-extra.safetensors"))
    assert verify(ckpt) == "files its manifest.json does not list: model-extra.safetensors"


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x10
    path.write_bytes(bytes(data))


@pytest.mark.trains
def test_model_a_run_verifies_its_checkpoint_for_eval_sample_and_train(tiny_model_dir, tiny_run_config, tmp_path, capsys):
    """A run without its final model: `model=<run>` takes the newest checkpoint that verifies,
    naming the one it skips; with none left it refuses in one line (a flipped byte used to load)."""
    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, max_steps=4))
    for name in ("model.safetensors", "config.json"):
        (out / name).unlink()
    _flip_a_byte(out / "checkpoint-4" / "model.safetensors")
    assert cli.main(["sample", f"model={out}", "prompt=what is 1+1?", "n=1", "max_completion_length=4"]) == 0
    said = capsys.readouterr().out
    assert "skipping checkpoint-4: model.safetensors does not match its SHA-256" in said and "using checkpoint-2" in said
    _flip_a_byte(out / "checkpoint-2" / "model.safetensors")
    for args in (["sample", f"model={out}", "prompt=hi", "n=1"], ["eval", f"model={out}", "eval_max_examples=2"],
                 ["train", f"model={out}", f"output_dir={tmp_path / 'next'}", "max_steps=1"]):
        assert cli.main(args) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "neither a final model nor a checkpoint that verifies" in err[0], err
    assert cli.main(["sample", f"model={out / 'checkpoint-2'}", "prompt=hi", "n=1"]) == 2
    assert "checkpoint-2: model.safetensors does not match its SHA-256" in capsys.readouterr().err


@pytest.mark.trains
def test_resume_override_onto_another_model_is_one_line(tiny_model_dir, tmp_path, capsys):
    """The tiny model's checkpoint resumed with resume_override=true and a model of other shapes."""
    from transformers import LlamaConfig, LlamaForCausalLM

    other = tmp_path / "other-model"
    config = LlamaConfig.from_pretrained(tiny_model_dir)
    config.intermediate_size *= 2
    LlamaForCausalLM(config).save_pretrained(other)
    for name in os.listdir(tiny_model_dir):
        if name.startswith(("tokenizer", "special_tokens", "chat_template")):
            shutil.copy(Path(tiny_model_dir) / name, other / name)
    out = tmp_path / "run"
    base = [f"model={tiny_model_dir}", "task_args.num_train=50", "task_args.num_test=8", "reward_funcs=[boxed_format]",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=6", "max_steps=2", "save_steps=2",
            "eval_on_start=false", "eval_on_end=false", f"output_dir={out}"]
    assert cli.main(["train", *base]) == 0
    capsys.readouterr()
    assert cli.main(["train", f"output_dir={out}", "resume=true", "max_steps=3", f"model={other}", "resume_override=true"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "does not fit the model" in err[0] and "checkpoint-2" in err[0], err


# --- the run's lock ----------------------------------------------------------------------------

@pytest.mark.processes
def test_a_child_forked_by_the_run_does_not_keep_its_lock(tmp_path):
    """A reward function's forked child outlives the trainer, which was killed: resume must not be
    refused as 'in use' while that child lives."""
    out = tmp_path / "run"
    code = f"""
import os, sys, time
sys.path.insert(0, {SRC!r})
from pathlib import Path
from rlvr.rundir import RunLock
lock = RunLock(Path({str(out)!r}))
pid = os.fork()
if pid == 0:
    null = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):  # let go of the pipes the test reads, as a daemonised child would
        os.dup2(null, fd)
    time.sleep(60)
    os._exit(0)
print(pid, flush=True)
os._exit(0)  # the trainer dies; its child lives on
"""
    child = int(subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True).stdout)
    try:
        os.kill(child, 0)  # still alive
        from rlvr.rundir import RunLock

        RunLock(out, say=lambda text: None).close()  # taken at once, not refused
    finally:
        os.kill(child, 9)
        time.sleep(0.1)
