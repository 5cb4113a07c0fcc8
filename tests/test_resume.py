"""Checkpoints that prove themselves, and resume from whatever a crash left: corrupted or partial
checkpoints, rows logged past the last checkpoint, torn lines, no checkpoint at all, a full disk."""

from __future__ import annotations

import errno
import json
import zlib

import pytest
import torch
from safetensors.torch import load_file

from rlvr import cli
from rlvr.checkpoint import MANIFEST, verify
from rlvr.config import build_config
from rlvr.run import train


def _text_reward(completions, **kwargs):
    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]


@pytest.fixture(autouse=True)
def text_rewards(monkeypatch):
    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", _text_reward)


def _rows(out, name="metrics.jsonl"):
    rows = [json.loads(line) for line in (out / name).read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")}
            for r in rows]


@pytest.fixture(scope="module")
def straight(tiny_run_config, tmp_path_factory):
    import rlvr.rewards as rewards

    out = tmp_path_factory.mktemp("straight")
    saved, rewards.REWARDS["boxed_format"] = rewards.REWARDS["boxed_format"], _text_reward
    try:
        train(tiny_run_config(out))
    finally:
        rewards.REWARDS["boxed_format"] = saved
    return out


def _printed(capsys) -> str:
    """What the run printed, with the console's line wrapping undone."""
    return " ".join(capsys.readouterr().out.split())


def _same_run(out, straight):
    a, b = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _rows(out) == _rows(straight)
    assert _rows(out, "completions.jsonl") == _rows(straight, "completions.jsonl")


def _flip_byte(path, at=-100):
    data = bytearray(path.read_bytes())
    data[at] ^= 0x01
    path.write_bytes(bytes(data))


CORRUPTIONS = {
    "flipped byte in the weights": (lambda c: _flip_byte(c / "model.safetensors"), "model.safetensors does not match its SHA-256"),
    "flipped byte in the trainer state": (lambda c: _flip_byte(c / "trainer_state.pt", at=200), "trainer_state.pt does not match"),
    "truncated trainer state": (lambda c: (c / "trainer_state.pt").write_bytes((c / "trainer_state.pt").read_bytes()[:100]),
                                "trainer_state.pt has 100 bytes"),
    "missing weights": (lambda c: (c / "model.safetensors").unlink(), "model.safetensors is missing"),
    "unreadable manifest": (lambda c: (c / MANIFEST).write_text("{not json"), "manifest.json is unreadable"),
}


@pytest.mark.trains
@pytest.mark.parametrize("kind", list(CORRUPTIONS))
def test_a_broken_checkpoint_is_skipped_for_the_one_before(kind, tiny_run_config, tmp_path, straight, capsys):
    out = tmp_path / "run"
    train(tiny_run_config(out))
    break_it, reason = CORRUPTIONS[kind]
    break_it(out / "checkpoint-4")
    assert reason in verify(out / "checkpoint-4")
    (out / "checkpoint-99").mkdir()  # an empty directory (it once blocked resume)
    train(tiny_run_config(out, resume=True))
    printed = capsys.readouterr().out
    assert f"skipping checkpoint-4: {reason}" in printed and "removed checkpoint-99" in printed
    assert not (out / "checkpoint-99").exists()
    _same_run(out, straight)  # steps 3 and 4 replayed from checkpoint-2: the same run


@pytest.mark.trains
def test_rows_logged_after_the_last_checkpoint_are_written_once(tiny_run_config, tmp_path, straight, capsys):
    """What kill -9 leaves: rows of steps 3-4 logged, checkpoint-4 never written, a torn last line."""
    out = tmp_path / "run"
    train(tiny_run_config(out))
    import shutil

    shutil.rmtree(out / "checkpoint-4")
    (out / ".checkpoint-4.tmp").mkdir()  # a save cut short
    with (out / "metrics.jsonl").open("a") as f:
        f.write('{"step": 5, "rew')
    train(tiny_run_config(out, resume=True))
    assert "metrics.jsonl: kept the rows up to step 2, dropped 2 of later steps, 1 torn line" in capsys.readouterr().out
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]
    assert not list(out.glob(".checkpoint-*"))
    _same_run(out, straight)


@pytest.mark.trains
def test_resume_from_checkpoint_takes_a_path(tiny_model_dir, tiny_run_config, tmp_path, straight):
    out = tmp_path / "run"
    train(tiny_run_config(out))
    cfg = build_config({**tiny_run_config(out).to_dict(), "resume_from_checkpoint": str(out / "checkpoint-2")})
    assert cfg.resume and cfg.resume_checkpoint == str(out / "checkpoint-2")
    train(cfg)
    _same_run(out, straight)
    _flip_byte(out / "checkpoint-2" / "model.safetensors")
    assert cli.main(["train", f"model={tiny_model_dir}", f"resume_from_checkpoint={out / 'checkpoint-2'}"]) == 2


@pytest.mark.trains
def test_a_run_killed_before_its_first_checkpoint_starts_over(tiny_run_config, tmp_path, straight, capsys):
    """kill -9 before the first save leaves rows and a config but no checkpoint: a fresh start is
    refused (the directory holds a run), and resume=true starts it over, with nothing to delete."""
    import shutil

    out = tmp_path / "run"
    train(tiny_run_config(out, max_steps=2, save_steps=1000))
    for path in [*out.glob("checkpoint-*"), out / "model.safetensors", out / "config.json"]:
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    with pytest.raises(FileExistsError, match="continue it with resume=true"):
        train(tiny_run_config(out))
    train(tiny_run_config(out, resume=True))
    printed = capsys.readouterr().out
    assert "has no checkpoint yet: the run starts over there" in printed
    assert "metrics.jsonl: kept the rows up to step 0, dropped 2 of later steps" in printed
    _same_run(out, straight)


@pytest.mark.trains
def test_a_ctrl_c_before_anything_is_written_keeps_the_directory_for_resume(tiny_run_config, tmp_path, straight,
                                                                          monkeypatch, capsys):
    """Ctrl-C while the model loads: the directory stays (an error there would remove it), so the
    usual `resume=true` starts the run over instead of saying the directory does not exist."""
    import rlvr.run as run

    out, load_model = tmp_path / "run", run.load_model

    def interrupted(*args, **kwargs):
        raise KeyboardInterrupt

    monkeypatch.setattr(run, "load_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(out))
    assert out.is_dir()
    monkeypatch.setattr(run, "load_model", load_model)
    train(tiny_run_config(out, resume=True))
    assert "has no checkpoint yet: the run starts over there" in capsys.readouterr().out
    _same_run(out, straight)


def _train_args(model, out, *settings) -> list[str]:
    """`rlvr train` of the tiny run (6 steps, a checkpoint every 2), with `settings` on top."""
    return ["train", f"model={model}", "task_args.num_train=50", "task_args.num_test=8", "reward_funcs=[boxed_format]",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=6", "max_steps=6", "save_steps=2",
            "eval_on_start=false", "eval_on_end=false", f"output_dir={out}", *settings]


def _disk_full_on_save(monkeypatch, at: int):
    import rlvr.checkpoint as checkpoint

    original, calls = checkpoint.torch.save, {"n": 0}

    def save(obj, path, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            with open(path, "wb") as f:
                f.write(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device")
        return original(obj, path, *args, **kwargs)

    monkeypatch.setattr(checkpoint.torch, "save", save)


@pytest.mark.trains
def test_a_full_disk_is_one_line_and_the_previous_checkpoint_stays(tiny_model_dir, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _disk_full_on_save(monkeypatch, at=2)  # checkpoint-4
    assert cli.main(_train_args(tiny_model_dir, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlvr train: error: disk full: could not write {out / 'checkpoint-4'}")
    assert "checkpoint-2 stays" in err[0] and "resume=true" in err[0]
    assert verify(out / "checkpoint-2") is None and not (out / "checkpoint-4").exists() and not list(out.glob(".checkpoint-*"))


@pytest.mark.trains
def test_on_save_error_continue_trains_on_without_that_checkpoint(tiny_run_config, tmp_path, monkeypatch, capsys):
    out = tmp_path / "run"
    _disk_full_on_save(monkeypatch, at=1)  # checkpoint-2
    train(tiny_run_config(out, on_save_error="continue"))
    assert "training goes on without it (on_save_error=continue)" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"] and (out / "config.json").is_file()


@pytest.mark.trains
def test_the_final_model_is_moved_in_with_its_config_last(tiny_run_config, tmp_path, monkeypatch):
    import rlvr.rundir as run

    moved = []
    real_replace = run.os.replace
    monkeypatch.setattr(run.os, "replace", lambda a, b: (moved.append((str(a), str(b))), real_replace(a, b)))
    out = tmp_path / "run"
    train(tiny_run_config(out, max_steps=1))
    final = [b for a, b in moved if ".final.tmp" in a]
    assert final[-1].endswith("config.json") and any(m.endswith("model.safetensors") for m in final)
    assert not (out / ".final.tmp").exists()


@pytest.mark.trains
@pytest.mark.processes
def test_one_run_per_directory(tiny_model_dir, tiny_run_config, tmp_path, capsys):
    """A second writer is refused with the first one's PID; a lock left by a dead process is taken over."""
    import os
    import subprocess
    import sys

    from rlvr.rundir import LOCK, RunLock, RunLocked

    out = tmp_path / "run"
    holder = RunLock(out)  # a run in progress
    with pytest.raises(RunLocked, match=f"in use by another rlvr run \\(pid {os.getpid()} on "):
        train(tiny_run_config(out))
    with pytest.raises(RunLocked, match="in use by another rlvr run"):
        train(tiny_run_config(out, resume=True))
    assert cli.main(["train", f"model={tiny_model_dir}", f"output_dir={out}", "resume=true"]) == 2
    assert "is in use by another rlvr run (pid" in capsys.readouterr().err
    holder.close()
    # a process that took the lock and was killed: the kernel released its lock, its note stays
    code = f"import os, sys; sys.path.insert(0, {str(os.getcwd() + '/src')!r}); from rlvr.rundir import RunLock; RunLock(__import__('pathlib').Path({str(out)!r})); os._exit(0)"
    subprocess.run([sys.executable, "-c", code], check=True)
    assert (out / LOCK).read_text().startswith("pid ")
    train(tiny_run_config(out, max_steps=1))
    assert "the lock of an earlier run (pid" in capsys.readouterr().out
    assert (out / LOCK).read_text() == ""  # released at the end


@pytest.mark.trains
def test_resume_refuses_settings_that_change_the_run_unless_told(tiny_model_dir, tiny_run_config, tmp_path, capsys):
    out = tmp_path / "run"
    train(tiny_run_config(out, max_steps=2))
    for change in ({"seed": 7}, {"num_generations": 8}, {"learning_rate": 5e-3}, {"task_args": {"digits": 1}},
                   {"reward_funcs": ["accuracy"]}, {"model": str(out)}):
        with pytest.raises(Exception, match="resume with settings that change the run's course from step 2: "
                                             f"{list(change)[0]}: .*add resume_override=true"):
            train(tiny_run_config(out, resume=True, max_steps=4, **change))
    assert not list(out.glob("config.before-*"))  # nothing was changed by the refusals
    # free settings pass and are reported; the run goes on
    train(tiny_run_config(out, resume=True, max_steps=3, logging_steps=2, eval_on_end=True))
    assert "resumed with max_steps: 2 -> 3; logging_steps: 1 -> 2; eval_on_end: False -> True" in _printed(capsys)
    assert (out / "config.before-step-2.yaml").is_file()
    # with the override the new learning rate is the one used
    train(tiny_run_config(out, resume=True, max_steps=4, logging_steps=2, eval_on_end=True,
               learning_rate=5e-3, resume_override=True))
    assert "resume_override=true: continuing from step 3 with learning_rate: 0.001 -> 0.005" in _printed(capsys)
    assert _rows(out)[-1]["learning_rate"] == pytest.approx(5e-3 * 0.25)  # linear decay: step 4 of 4 is at 1 - 3/4
    assert cli.main(["train", f"model={tiny_model_dir}", f"output_dir={out}", "resume=true", "seed=3"]) == 2
    assert "seed: 42 -> 3" in capsys.readouterr().err


def test_an_error_while_preparing_the_directory_lets_go_of_its_lock(tiny_run_config, tmp_path, monkeypatch):
    """Any error after the lock is taken (here the logs cannot be read) releases it, so the same
    process can try again: a library user's second train() is not refused as 'in use'."""
    from rlvr import rundir

    cfg = tiny_run_config(tmp_path / "run")
    prepare = (cfg.run_settings, rundir.default_output_dir(cfg.run_settings, cfg.data_settings, cfg.command), cfg.without_secrets().to_dict())

    def unreadable(*args):
        raise PermissionError(errno.EACCES, "Permission denied", "metrics.jsonl")

    monkeypatch.setattr(rundir, "_keep_logs_until", unreadable)
    with pytest.raises(PermissionError):
        rundir.prepare_output_dir(*prepare, say=lambda text: None)
    monkeypatch.undo()
    _, checkpoint, lock = rundir.prepare_output_dir(*prepare, say=lambda text: None)
    assert checkpoint is None
    lock.close()


# --- save_strategy ------------------------------------------------------------------------------


def _checkpoint_steps(out) -> list[int]:
    return sorted(int(p.name.split("-")[1]) for p in out.glob("checkpoint-*"))


@pytest.mark.trains
def test_save_strategy_epoch_saves_after_each_pass_over_the_prompts(tiny_run_config, tmp_path):
    """5 train prompts, 2 a step: passes complete at steps 3 (6 taken) and 5 (10), then the last step."""
    out = tmp_path / "run"
    train(tiny_run_config(out, save_strategy="epoch", save_steps=1, max_steps=6,
                          task_args={"digits": 2, "num_train": 5, "num_test": 8}))
    assert _checkpoint_steps(out) == [3, 5, 6]


@pytest.mark.trains
def test_save_strategy_no_keeps_no_checkpoint_but_the_final_model(tiny_run_config, tmp_path, capsys):
    from rlvr.checkpoint import CheckpointError

    out = tmp_path / "run"
    train(tiny_run_config(out, save_strategy="no"))
    assert _checkpoint_steps(out) == [] and (out / "model.safetensors").is_file() and (out / "summary.json").is_file()
    with pytest.raises(CheckpointError, match=r"holds a finished run without a checkpoint \(save_strategy=no keeps none\).*"
                                              rf"model={out} output_dir=<another dir>"):
        train(tiny_run_config(out, save_strategy="no", resume=True, max_steps=6))
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]  # its logs are kept


@pytest.mark.trains
def test_save_strategy_no_still_saves_a_stopped_run_which_resumes_exactly(tiny_run_config, tmp_path, monkeypatch, straight):
    import os
    import signal

    from rlvr.monitor import MetricsLog

    original, calls = MetricsLog.add, {"n": 0}

    def add(self, *args, **kwargs):  # Ctrl-C while step 3 is recorded: it completes, then the run stops
        calls["n"] += 1
        if calls["n"] == 3:
            os.kill(os.getpid(), signal.SIGINT)
        return original(self, *args, **kwargs)

    monkeypatch.setattr(MetricsLog, "add", add)
    out = tmp_path / "run"
    with pytest.raises(KeyboardInterrupt):
        train(tiny_run_config(out, save_strategy="no"))
    assert _checkpoint_steps(out) == [3]
    monkeypatch.setattr(MetricsLog, "add", original)
    train(tiny_run_config(out, save_strategy="no", resume=True))
    assert _checkpoint_steps(out) == [3]  # the resumed run saved none of its own
    _same_run(out, straight)


def test_save_strategy_best_is_refused_with_the_reason():
    from rlvr.config import ConfigError

    with pytest.raises(ConfigError, match=r"save_strategy=best \(TRL: keep the checkpoint with the best metric_for_best_model\) "
                                          r"is not supported yet; use steps, epoch or no"):
        build_config({"save_strategy": "best"})


def _disk_full_in_safetensors(monkeypatch, at: int):
    """The n-th model.safetensors written fails as safetensors reports ENOSPC: a SafetensorError
    quoting the OS error (not an OSError), which used to pass for an ordinary failure."""
    import transformers.modeling_utils as modeling
    from safetensors import SafetensorError

    real, calls = modeling.safe_save_file, {"n": 0}

    def save(tensors, filename, *args, **kwargs):
        calls["n"] += 1
        if calls["n"] == at:
            with open(filename, "wb") as f:
                f.write(b"partial")
            raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")
        return real(tensors, filename, *args, **kwargs)

    monkeypatch.setattr(modeling, "safe_save_file", save)


@pytest.mark.trains
def test_a_full_disk_in_model_safetensors_is_one_line_and_honours_on_save_error(tiny_model_dir, tiny_run_config, tmp_path,
                                                                                monkeypatch, capsys):
    out = tmp_path / "run"
    _disk_full_in_safetensors(monkeypatch, at=2)  # checkpoint-4
    assert cli.main(_train_args(tiny_model_dir, out)) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(f"rlvr train: error: disk full: could not write {out / 'checkpoint-4'}"), err
    assert verify(out / "checkpoint-2") is None and not (out / "checkpoint-4").exists()

    _disk_full_in_safetensors(monkeypatch, at=1)
    out = tmp_path / "continued"
    train(tiny_run_config(out, on_save_error="continue"))
    assert "training goes on without it (on_save_error=continue)" in capsys.readouterr().out
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-4"] and (out / "config.json").is_file()


@pytest.mark.trains
def test_a_full_disk_in_the_logs_stops_in_one_line_or_keeps_the_rows(tiny_model_dir, tiny_run_config, tmp_path, monkeypatch,
                                                                      capsys):
    """metrics.jsonl cannot be written at steps 2 and 3: on_save_error=stop ends the run in one
    line; continue says so once, keeps the rows, and writes them when there is space again."""
    import rlvr.jsonl as jsonl

    real, full = jsonl._write_all, {"steps": (2, 3)}

    def write(fd, data):
        row = json.loads(data.decode().splitlines()[-1])
        if "reward_std" in row and row.get("step") in full["steps"]:  # a metrics row, not a completion
            raise OSError(errno.ENOSPC, "No space left on device")
        return real(fd, data)

    monkeypatch.setattr(jsonl, "_write_all", write)
    assert cli.main(_train_args(tiny_model_dir, tmp_path / "stopped", "max_steps=4", "logging_steps=1")) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "disk full: could not write metrics.jsonl" in err[0], err
    out = tmp_path / "continued"
    train(tiny_run_config(out, on_save_error="continue"))
    said = capsys.readouterr().out
    assert said.count("disk full: could not write metrics.jsonl") == 1 and "(on_save_error=continue)" in said
    assert [r["step"] for r in _rows(out)] == [1, 2, 3, 4]  # rows 2 and 3 written with row 4, none lost
