"""Checkpoints and exact resume, on the tiny model."""

import json
import re

import pytest
import torch
from conftest import launch_ranks, stop_in_update
from safetensors.torch import load_file

from rlvr.run import train
from rlvr.trainer import Trainer

pytestmark = pytest.mark.trains


def _cfg(tiny_run_config, out, **kw):
    """The tiny run, with the state an exact resume must restore: two micro-batches a step, a
    reference model (beta), two updates per batch, a second reward."""
    return tiny_run_config(out, **{"reward_funcs": ["boxed_format", "accuracy"], "per_device_train_batch_size": 4,
                                   "gradient_accumulation_steps": 2, "beta": 0.1, "num_iterations": 2, **kw})


def _weights(path):
    return load_file(str(path / "model.safetensors"))


def _metrics(path):
    rows = [json.loads(l) for l in (path / "metrics.jsonl").read_text().splitlines()]
    return [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in ("step_time", "tokens_per_second")} for r in rows]


@pytest.fixture
def informative_rewards(monkeypatch):
    """Random rewards, so every group carries signal and every step really updates."""
    import rlvr.rewards as rewards

    gen = torch.Generator().manual_seed(0)

    def noisy(completions, **kwargs):
        return torch.rand(len(completions), generator=gen).tolist()

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", noisy)
    return gen


def test_interrupted_run_resumes_exactly(tiny_model_dir, tiny_run_config, tmp_path, monkeypatch, informative_rewards):
    # with the adaptive entropy bonus, whose coefficient is state a resume must restore (checked: without it in
    # the checkpoint, this test fails)
    settings = {"use_adaptive_entropy": True, "entropy_coef": 0.1, "entropy_target": 10.0}
    straight = tmp_path / "straight"
    train(_cfg(tiny_run_config, straight, **settings))

    informative_rewards.manual_seed(0)
    resumed = tmp_path / "resumed"
    original_step = Trainer.train_step

    def stop_before_step_4(self, **kwargs):
        if self.step == 3:  # mid-generation: step 3 used the 2nd batch once, step 4 reuses it
            raise KeyboardInterrupt
        return original_step(self, **kwargs)

    monkeypatch.setattr(Trainer, "train_step", stop_before_step_4)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, resumed, **settings))
    assert (resumed / "checkpoint-3").is_dir()  # saved on the way out
    monkeypatch.setattr(Trainer, "train_step", original_step)
    train(_cfg(tiny_run_config, resumed, resume=True, **settings))

    a, b = _weights(straight), _weights(resumed)
    assert a.keys() == b.keys()
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(straight) == _metrics(resumed)
    start = _weights(tiny_model_dir)
    assert any(not torch.equal(a[k], start[k]) for k in a)  # the run did train


def test_save_total_limit_keeps_the_newest(tiny_run_config, tmp_path):
    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, save_steps=1, save_total_limit=2))
    assert sorted(p.name for p in out.glob("checkpoint-*")) == ["checkpoint-3", "checkpoint-4"]
    assert not list(out.glob(".checkpoint-*"))  # no half-written leftovers


def test_an_existing_run_is_never_overwritten(tiny_run_config, tmp_path):
    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, max_steps=1))
    with pytest.raises(FileExistsError, match="already holds a training run; continue it with resume=true"):
        train(_cfg(tiny_run_config, out, max_steps=1))


def test_final_model_loads_with_transformers(tiny_run_config, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = tmp_path / "run"
    train(_cfg(tiny_run_config, out, max_steps=1))
    model = AutoModelForCausalLM.from_pretrained(out)
    tokenizer = AutoTokenizer.from_pretrained(out)
    assert model.config.vocab_size == len(tokenizer)
    assert (out / "config.yaml").is_file() and (out / "completions.jsonl").is_file()


def test_off_policy_run_stopped_mid_update_resumes_exactly(tiny_run_config, tmp_path, monkeypatch):
    """max_staleness=1: the stop comes while the next batch is being sampled ahead; that batch is
    dropped and the data and sampler rewound, so the resumed run samples it again, identically.
    (The reward is a function of the text alone: the dropped batch was scored, and a reward with
    its own random stream would have moved on.)"""
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])
    straight = tmp_path / "straight"
    train(_cfg(tiny_run_config, straight, max_staleness=1, max_steps=6))

    resumed = tmp_path / "resumed"

    def sampling_ahead(trainer):
        assert trainer.batches.ahead is not None  # the 3rd batch is being sampled

    restore = stop_in_update(monkeypatch, 3, sampling_ahead)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, resumed, max_staleness=1, max_steps=6))
    assert (resumed / "checkpoint-3").is_dir()
    restore()
    train(_cfg(tiny_run_config, resumed, max_staleness=1, max_steps=6, resume=True))

    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(straight) == _metrics(resumed)
    assert [m.get("sampling/staleness") for m in _metrics(straight)] == [0, 0, 1, 1, 1, 1]


def test_weights_synced_every_two_steps_resume_exactly(tiny_run_config, tmp_path, monkeypatch):
    """weight_sync_steps=2: a checkpoint saved off the sync schedule (save_steps=3) sends the samplers
    its weights first, as a resume from it does, so the run stopped in step 4 and resumed from
    checkpoint-3 ends with the same weights and metrics as the run never stopped."""
    import zlib

    import rlvr.rewards as rewards

    monkeypatch.setitem(rewards.REWARDS, "boxed_format",
                        lambda completions, **kw: [zlib.crc32(c.encode()) % 1000 / 1000 for c in completions])
    settings = {"max_staleness": 2, "weight_sync_steps": 2, "max_steps": 6, "save_steps": 3, "num_iterations": 1}
    straight = tmp_path / "straight"
    train(_cfg(tiny_run_config, straight, **settings))

    resumed = tmp_path / "resumed"
    restore = stop_in_update(monkeypatch, 3)
    with pytest.raises(KeyboardInterrupt):
        train(_cfg(tiny_run_config, resumed, **settings))
    assert (resumed / "checkpoint-3").is_dir()
    restore()
    train(_cfg(tiny_run_config, resumed, **settings, resume=True))

    a, b = _weights(straight), _weights(resumed)
    assert all(torch.equal(a[k], b[k]) for k in a)
    assert _metrics(straight) == _metrics(resumed)
    # synced after steps 2, 3 (the checkpoint), 4 and 6; sampled on-policy, then one generation ahead
    assert [m["sampling/weight_version"] for m in _metrics(straight)] == [0, 0, 0, 2, 3, 4]
    assert [m["sampling/staleness"] for m in _metrics(straight)] == [0, 1, 2, 1, 1, 1]


def _sharded_save(tmp_path, step, model, optimizer, tokenizer):
    from rlvr import distributed
    from rlvr.checkpoint import save_sharded_checkpoint

    shards = {"model": model.state_dict(), "optimizer": optimizer.state_dict()}
    return save_sharded_checkpoint(tmp_path, step, model.config.save_pretrained, tokenizer, {"step": step}, shards, None,
                                   distributed.SINGLE)


@pytest.mark.filterwarnings("ignore::UserWarning")  # torch.distributed.checkpoint's save warns that it runs in one process
def test_a_sharded_checkpoint_round_trips_and_a_full_disk_leaves_the_previous_one(tiny, tmp_path, monkeypatch):
    """save_sharded_checkpoint (the layout of fsdp runs) in one process: dcp/ and the manifest, read back
    by load_shards and as a model by load_weights; a disk that fills while the shards are written is the
    one DiskFull error, with the partial directory removed and the previous checkpoint kept."""
    import torch.distributed.checkpoint as dcp

    from rlvr.checkpoint import CheckpointError, DiskFull, is_sharded, load_shards, load_weights, verify

    model, tokenizer = tiny
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
    optimizer.step()
    first = _sharded_save(tmp_path, 1, model, optimizer, tokenizer)
    assert is_sharded(first) and verify(first) is None and not list(first.glob("*.safetensors"))
    assert "dcp/__0_0.distcp" in json.loads((first / "manifest.json").read_text())["files"]
    back = {"model": {k: torch.zeros_like(v) for k, v in model.state_dict().items()}}
    load_shards(first, back)
    assert all(torch.equal(back["model"][k], v) for k, v in model.state_dict().items())
    other = type(model)(model.config)
    load_weights(first, other)
    assert all(torch.equal(other.state_dict()[k], v) for k, v in model.state_dict().items())
    with (first / "dcp" / "__0_0.distcp").open("r+b") as f:  # a flipped byte in a rank's file is caught
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 1]))
    assert "dcp/__0_0.distcp does not match its SHA-256" in verify(first)
    (first / "dcp" / "__0_0.distcp").unlink()  # a rank's file gone: one line saying so, not dcp's BaseException
    with pytest.raises(CheckpointError, match=r"checkpoint-1: its shards \(dcp/\) could not be read: .*__0_0.distcp"):
        load_shards(first, back)
    with pytest.raises(CheckpointError, match=r"checkpoint-1: its shards \(dcp/\) could not be read: .*__0_0.distcp"):
        load_weights(first, other)  # read in one process (rlvr eval of a checkpoint)

    def full(*args, **kwargs):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(DiskFull, match=r"disk full: could not write .*checkpoint-2 .*checkpoint-1 stays"):
        _sharded_save(tmp_path, 2, model, optimizer, tokenizer)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["checkpoint-1"]


# Two gloo ranks save a sharded checkpoint, then a second one during which rank 1's disk fills (its
# torch.distributed.checkpoint file cannot be written); each rank writes what it saw.
FULL_ON_ONE_RANK = """
import contextlib, json, sys
from pathlib import Path
import torch
import torch.distributed as dist
from torch.distributed.checkpoint.filesystem import FileSystem
from rlvr import distributed
from rlvr.checkpoint import DiskFull, save_sharded_checkpoint

dist.init_process_group("gloo")
rank = dist.get_rank()
world = distributed.World(rank=rank, world_size=2)
out = Path(sys.argv[1])

class Tokenizer:
    def save_pretrained(self, directory):
        (Path(directory) / "tokenizer.json").write_text("{}")

def write_model(directory):
    (Path(directory) / "config.json").write_text("{}")

def save(step):
    shards = {"model": {f"rank{rank}.weight": torch.full((64,), float(rank + step))}}
    return save_sharded_checkpoint(out, step, write_model, Tokenizer(), {"step": step}, shards, None, world)

first = save(1)
if rank == 1:
    @contextlib.contextmanager
    def full(self, path, mode):
        raise OSError(28, "No space left on device")
        yield
    FileSystem.create_stream = full
try:
    save(2)
    seen = {"raised": None}
except Exception as e:
    seen = {"raised": type(e).__name__, "message": str(e)}
seen["first"] = str(first) if first else None
(out / f"seen-{rank}.json").write_text(json.dumps(seen))
dist.barrier()
dist.destroy_process_group()  # else gloo's threads may abort the process as it exits
"""


@pytest.mark.processes
def test_a_disk_that_fills_on_one_rank_fails_the_sharded_save_on_every_rank(tmp_path):
    """fsdp's checkpoint with two ranks: rank 1 cannot write its shard file; both ranks raise the same
    DiskFull (not a hang, not one rank going on), the partial directory is removed, checkpoint-1 stays."""
    script = tmp_path / "full_on_one_rank.py"
    script.write_text(FULL_ON_ONE_RANK)
    out = tmp_path / "run"
    out.mkdir()
    done = launch_ranks([str(script), str(out)], 2, 180, env={"OMP_NUM_THREADS": "1"})
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    seen = [json.loads((out / f"seen-{rank}.json").read_text()) for rank in (0, 1)]
    assert [s["raised"] for s in seen] == ["DiskFull", "DiskFull"], seen
    assert seen[0]["message"] == seen[1]["message"]
    assert re.search(r"disk full: could not write .*checkpoint-2 .*checkpoint-1 stays", seen[0]["message"]), seen[0]
    assert sorted(p.name for p in out.iterdir() if p.is_dir()) == ["checkpoint-1"]
    assert sorted(p.name for p in (out / "checkpoint-1" / "dcp").iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
