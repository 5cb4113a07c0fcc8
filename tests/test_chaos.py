"""Chaos: kill -9, Ctrl-C, SIGTERM at random moments, corrupted checkpoints and a disk that fills,
on the tiny model, each followed by `resume=true` until the run ends.  Every trial must end with
the weights of a run that never stopped, bit for bit, and with logs that hold each step once.

`make test` runs one trial of each kind (RLVR_CHAOS_TRIALS=1); `make chaos` runs 20.  Each trial is a
`rlvr train` process (the signals reach a real process, as from a scheduler).
"""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

import warm

pytestmark = [pytest.mark.chaos, pytest.mark.trains, pytest.mark.processes]
TRIALS = int(os.environ.get("RLVR_CHAOS_TRIALS", "1"))
SRC = str(Path(__file__).resolve().parents[1] / "src")
REWARD = "import zlib\n\ndef text(completions, **kw):\n    return [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions]\n"
LOGS = ("metrics.jsonl", "completions.jsonl", "alerts.jsonl")


def _settings(model_dir, reward_file, out) -> list[str]:
    return [f"model={model_dir}", "task_args.num_train=50", "task_args.num_test=8", f"reward_funcs=[{reward_file}:text]",
            "num_generations=4", "per_device_train_batch_size=8", "max_completion_length=6", "learning_rate=1e-3",
            "max_steps=8", "save_steps=1", "save_total_limit=3", "logging_steps=1", "eval_on_start=false",
            "eval_on_end=false", "report_steps=0", "alert_window=2", f"output_dir={out}"]


def _start(args: list[str]) -> warm.Process:
    """`rlvr train args` in a process of its own (forked warm: tests/warm.py); its stderr in `.stderr`."""
    env = {**os.environ, "PYTHONPATH": SRC, "OMP_NUM_THREADS": "1"}
    fd, err = tempfile.mkstemp(suffix=".err")
    os.close(fd)
    proc = warm.Process(["-m", "rlvr.cli", "train", *args], os.devnull, err, env)
    proc.stderr = open(err)  # read once the process has ended
    return proc


def _rows(out: Path, name: str) -> list[dict]:
    path = out / name
    if not path.is_file():
        return []
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    rows = [r for r in rows if r.get("rule") != "throughput_low"]  # timed: depends on the machine's load, not the run
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")}
            for r in rows]


@pytest.fixture(scope="module")
def reward_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("reward") / "text_reward.py"
    path.write_text(REWARD)
    return path


@pytest.fixture(scope="module")
def straight(tiny_model_dir, reward_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("straight") / "run"
    proc = _start(_settings(tiny_model_dir, reward_file, out))
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    return out


def _same_as(out: Path, straight: Path) -> None:
    a, b = load_file(str(out / "model.safetensors")), load_file(str(straight / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a), "final weights differ"
    for name in LOGS:
        assert _rows(out, name) == _rows(straight, name), f"{name} differs"


def _until_done(args: list[str], out: Path, attempts: int = 12) -> int:
    """resume=true until the run ends; the number of resumes it took.  Where every blow landed before
    the run took its directory (a slow start), there is nothing to resume: the run starts afresh, as a
    user would start it (resume=true refuses a directory that does not exist)."""
    err = ""
    for attempt in range(attempts):
        proc = _start(args + (["resume=true"] if out.exists() else []))
        code = proc.wait(timeout=300)
        if code == 0:
            return attempt + 1
        err = proc.stderr.read()
        assert code in (2, 130, 143), err
    raise AssertionError(f"the run did not finish; the last attempt exited {code} with:\n{err[-3000:]}")


@pytest.mark.parametrize("trial", range(TRIALS))
@pytest.mark.parametrize("kind", ["kill-9", "graceful"])
def test_a_signal_at_a_random_moment(kind, trial, tiny_model_dir, reward_file, straight, tmp_path):
    """kill -9, or a stop that lets the step finish: SIGTERM on even trials, SIGINT (Ctrl-C) on odd ones
    (make test runs trial 0; SIGINT at each phase of a step is tests/test_interrupts.py's)."""
    sig = signal.SIGKILL if kind == "kill-9" else signal.SIGINT if trial % 2 else signal.SIGTERM
    rng = random.Random(f"{sig}-{trial}")
    out = tmp_path / "run"
    args = _settings(tiny_model_dir, reward_file, out)
    for _ in range(2):  # two blows in one trial: the second lands on a resumed run
        proc = _start(args + (["resume=true"] if out.exists() else []))
        time.sleep(rng.uniform(3.0, 7.0))  # imports take ~4 s, the 8 steps ~1-2 s: every phase gets hit
        proc.send_signal(sig)
        code = proc.wait(timeout=120)
        assert code in (0, 130, 143, -sig, 2), proc.stderr.read()
        if code == 2:  # a signal before the lock was taken (the interpreter was still starting) is fine
            assert "Traceback" not in proc.stderr.read()
    _until_done(args, out)
    _same_as(out, straight)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_corrupted_checkpoint(trial, tiny_model_dir, reward_file, straight, tmp_path):
    rng = random.Random(f"corrupt-{trial}")
    out = tmp_path / "run"
    args = _settings(tiny_model_dir, reward_file, out)
    proc = _start(args)
    assert proc.wait(timeout=300) == 0, proc.stderr.read()
    (out / "model.safetensors").unlink()  # as if the final save never happened
    newest = sorted(out.glob("checkpoint-*"), key=lambda p: int(p.name.split("-")[1]))[-1]
    victim = rng.choice([p for p in newest.rglob("*") if p.is_file()])
    how = rng.choice(["flip", "truncate", "delete"])
    if how == "flip":
        data = bytearray(victim.read_bytes())
        data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        victim.write_bytes(bytes(data))
    elif how == "truncate":
        victim.write_bytes(victim.read_bytes()[: len(victim.read_bytes()) // 2])
    else:
        victim.unlink()
    _until_done(args, out)
    _same_as(out, straight)


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None, reason="needs root to mount a small tmpfs")
@pytest.mark.parametrize("trial", range(max(1, TRIALS // 2)))
def test_a_disk_that_fills(trial, tiny_model_dir, reward_file, straight, tmp_path):
    """The run writes onto a tmpfs too small for all of it: it stops with one line about the full
    disk; once the tmpfs is made larger, resume=true finishes it."""
    size_kb = 520 + 60 * trial
    mnt = tmp_path / "small"
    mnt.mkdir()
    out = mnt / "run"
    args = " ".join(f"'{a}'" for a in _settings(tiny_model_dir, reward_file, out) + ["save_total_limit=null"])
    python = f"PYTHONPATH={SRC} OMP_NUM_THREADS=1 {sys.executable} -m rlvr.cli train {args}"
    script = (f"mount -t tmpfs -o size={size_kb}k tmpfs {mnt} && ({python} > /dev/null 2> {tmp_path}/full.err; "
              f"echo $? > {tmp_path}/full.code); mount -o remount,size=16m {mnt} && {python} resume=true > /dev/null "
              f"2> {tmp_path}/resume.err; echo $? > {tmp_path}/resume.code; cp -a {out} {tmp_path}/kept")
    subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script], check=True, timeout=600)
    err = (tmp_path / "full.err").read_text().strip().splitlines()
    assert (tmp_path / "full.code").read_text().strip() == "2" and len(err) == 1 and "disk full" in err[0], err
    assert (tmp_path / "resume.code").read_text().strip() == "0", (tmp_path / "resume.err").read_text()
    _same_as(tmp_path / "kept", straight)


@pytest.mark.parametrize("trial", range(TRIALS))
def test_a_free_running_run_killed_at_random_moments(trial, tiny_model_dir, reward_file, straight, tmp_path):
    """async_mode=free (a producer thread keeping two generations in flight): kill -9 at a random moment,
    then resume until done.  Which weights sample which tokens depends on timing, so the weights are not compared; what
    must hold is that each step is logged once and trained the prompts the on-policy run trained at that
    step: nothing lost or sampled twice, however the producer and the checkpoints were cut."""
    rng = random.Random(f"free-{trial}")
    out = tmp_path / "run"
    args = _settings(tiny_model_dir, reward_file, out) + ["max_staleness=2", "async_mode=free"]
    proc = _start(args)
    time.sleep(rng.uniform(3.0, 7.0))  # imports take ~3-4 s, the 8 steps ~1-2 s
    proc.send_signal(signal.SIGKILL)
    code = proc.wait(timeout=120)
    assert code in (0, -signal.SIGKILL), proc.stderr.read()
    _until_done(args, out)
    assert [r["step"] for r in _rows(out, "metrics.jsonl")] == list(range(1, 9))

    def prompts(run: Path) -> list[list[str]]:
        steps: dict = {}
        for row in _rows(run, "completions.jsonl"):
            steps.setdefault(row["step"], set()).add(row["prompt"])
        return [sorted(p) for _, p in sorted(steps.items())]

    assert prompts(out) == prompts(straight)
