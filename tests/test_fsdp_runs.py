"""FSDP runs of two gloo processes (fsdp.py) beyond the weights of one process (test_distributed.py):
LoRA, a sharded KL reference, the best checkpoint loaded from its shards, a checkpoint of an rlvr before
sharded checkpoints resumed, what a rank holds while it samples and while it updates, weights streamed
from the shards, and a kill -9 of one rank resumed."""

import json
import shutil
from pathlib import Path

import pytest
import torch

from rlvr.checkpoint import is_sharded, verify
from rlvr.models import load_model
from test_distributed import REWARD, _launch, _metrics, _run, _settings, _weights


def _adapter(path):
    from safetensors.torch import load_file

    return load_file(str(path / "adapter_model.safetensors"))


@pytest.mark.slow  # three launches: about a minute on two shared cores
@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_with_lora_trains_the_adapter_of_one_process_and_resumes_exactly(tiny_model_dir, tmp_path):
    """fsdp=true with use_peft=true: the decoder layers of the peft model sharded with their adapters,
    only the adapter trained, the full copy (a peft model) sampling with it, the reference its adapter
    off (beta > 0), the adapter and the gathered optimizer state in the checkpoint, the merged final save."""
    pytest.importorskip("peft")
    from rlvr.lora import load_merged

    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    lora = ["use_peft=true", "lora_r=4", "lora_alpha=8", "beta=0.1"]
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "one", "grpo") + lora, processes=1)
    args = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "fsdp", "grpo", processes=2) + lora + ["fsdp=true", "save_steps=2", "lora_save=merged"]
    _run(args, processes=2)
    one, two = _adapter(tmp_path / "one"), _adapter(tmp_path / "fsdp" / "checkpoint-3")
    assert sorted(one) == sorted(two) and all("lora_" in k for k in one)
    assert max(one[k].abs().max().item() for k in one if "lora_B" in k) > 1e-3  # B starts at zero: the adapter moved
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert gap < 1e-5, gap  # measured: 0.0 (one process and the sharded model both on the fast path)
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "fsdp")
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]  # the full copy sampled with the adapter
    assert [m["grad_norm"] for m in m1] == pytest.approx([m["grad_norm"] for m in m2], rel=1e-5)
    # The reference is the model with its adapter off: no KL before the first update, then the same KL.
    assert m2[0]["kl"] == 0.0 and m2[-1]["kl"] > 0.0
    assert [m["kl"] for m in m1] == pytest.approx([m["kl"] for m in m2], rel=1e-4, abs=1e-9)
    merged = load_merged(str(tmp_path / "fsdp" / "checkpoint-3"), torch.float32).state_dict()
    final = _weights(tmp_path / "fsdp")  # lora_save=merged: the adapter merged onto the base, a plain model
    assert max((final[k] - merged[k]).abs().max().item() for k in final) == 0.0
    # Resumed from checkpoint-2 (the adapter and the optimizer state gathered from both ranks): the same adapter.
    (tmp_path / "fsdp" / "model.safetensors").unlink()
    for stale in ("checkpoint-3", "metrics.jsonl"):
        path = tmp_path / "fsdp" / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    _run(args + ["resume=true"], processes=2)
    resumed = _adapter(tmp_path / "fsdp" / "checkpoint-3")
    assert max((resumed[k] - two[k]).abs().max().item() for k in two) == 0.0
    assert max((_weights(tmp_path / "fsdp")[k] - final[k]).abs().max().item() for k in final) == 0.0


# A sharded run with a KL reference synced toward the policy every 2 steps (each rank mixing into its
# own shard), saved every 2 steps, 4 steps; the reward runs in the training process (a test below kills
# a rank from inside it).
KL = ["beta=0.1", "sync_ref_model=true", "ref_model_sync_steps=2", "ref_model_mixup_alpha=0.5", "save_steps=2", "max_steps=4",
      "reward_isolation=inline", "fsdp=true"]


@pytest.fixture(scope="module")
def fsdp_kl(tiny_model_dir, tmp_path_factory):
    """The KL layout on 2 processes, launched through RECORDS_WHAT_IS_HELD, made once for three tests:
    (its directory, "run", where the KL test resumes; "ended", a copy of it as it ended; its arguments)."""
    where = tmp_path_factory.mktemp("fsdp-kl")
    (where / "reward.py").write_text(REWARD)
    (where / "records.py").write_text(RECORDS_WHAT_IS_HELD)
    args = _settings(tiny_model_dir, where / "reward.py", "distinct", where / "run", "grpo", processes=2) + KL
    out = _launch(args, processes=2, timeout=300, script=where / "records.py")
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    shutil.copytree(where / "run", where / "ended")
    return where, args


@pytest.mark.slow  # two launches and the shared one
@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_with_a_kl_reference_shards_it_trains_to_the_weights_of_one_process_and_resumes_exactly(tiny_model_dir, tmp_path, fsdp_kl):
    """fsdp=true with beta > 0 and full fine-tuning trains to the weights of one process, and saves the
    final model as one process does.  The reference is sharded like the policy (each rank
    1/2 of it, its forwards in lockstep also when one rank has fewer rows), moved toward the policy
    every 2 steps (sync_ref_model, each rank mixing into its own shard), gathered whole into the
    checkpoint as each rank's shard of it and read back on resume: the weights and the KL of one
    process.  The checkpoint holds no whole model: each rank wrote its shards (torch.distributed.checkpoint),
    and it loads in one process to the weights of one process's checkpoint."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "one", "grpo") + [k for k in KL if k != "fsdp=true"], processes=1)
    where, args = fsdp_kl
    start, one, two = _weights(tiny_model_dir), _weights(tmp_path / "one"), _weights(where / "ended")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    # measured: 0.0 (1.2e-7 without the reference); 8.8e-6 when the sharded model trained through the
    # model's own forward (the float rounding of the fast path differs slightly, and AdamW's steps magnify that)
    assert gap < 1e-6, gap
    m1, m2 = _metrics(tmp_path / "one"), _metrics(where / "ended")
    assert [m["grad_norm"] for m in m1] == pytest.approx([m["grad_norm"] for m in m2], rel=1e-5)
    assert m2[0]["kl"] == 0.0 and m2[-1]["kl"] > 0.0  # the reference is the starting model, then the policy moves away
    assert [m["kl"] for m in m1] == pytest.approx([m["kl"] for m in m2], rel=1e-4, abs=1e-9)
    # The final model was streamed from the shards (fsdp.save_streamed): the files transformers writes.
    for name in ("config.json", "generation_config.json"):
        assert (where / "ended" / name).read_text() == (tmp_path / "one" / name).read_text(), name
    assert sorted(one) == sorted(two)  # the tied output layer saved once, as transformers does
    sharded = where / "ended" / "checkpoint-2"
    files = json.loads((sharded / "manifest.json").read_text())["files"]
    assert {"dcp/__0_0.distcp", "dcp/__1_0.distcp", "dcp/.metadata", "config.json", "trainer_state.pt"} <= set(files)
    assert not list(sharded.glob("*.safetensors")) and verify(sharded) is None
    import torch.distributed.checkpoint as dcp

    saved = dcp.FileSystemReader(str(sharded / "dcp")).read_metadata().state_dict_metadata
    assert {k.split(".")[0] for k in saved} == {"model", "optimizer", "ref_model"}  # the moved reference's shards too
    alone = load_model(str(sharded))[0].state_dict()
    expected = _weights(tmp_path / "one" / "checkpoint-2")
    assert max((alone[k] - expected[k]).abs().max().item() for k in expected) < 1e-5
    # Resumed from checkpoint-2, whose shards hold the moved reference: the same end.
    for stale in ("checkpoint-4", "metrics.jsonl", "model.safetensors"):
        path = where / "run" / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    _run(args + ["resume=true"], processes=2)
    resumed = _weights(where / "run")
    assert max((resumed[k] - two[k]).abs().max().item() for k in two) == 0.0


# checkpoint-2 of the KL layout's run on 2 processes, written by rlvr at 84a20b8 (before sharded checkpoints):
# the whole weights in model.safetensors, and in trainer_state.pt the optimizer state gathered whole (keyed
# by parameter name) and the reference moved at step 2.  How it was made: its directory's README.md.
WHOLE_FSDP_CHECKPOINT = Path(__file__).parent / "data" / "fsdp_whole_checkpoint" / "checkpoint-2"


def _same_steps(a, b, steps: list[int]) -> None:
    """Run `a`, resumed, logs `steps` with the rewards, losses, grad norms and KL that run `b` logs for
    them, and ends with b's weights (within 1e-5)."""
    wa, wb = _weights(a), _weights(b)
    gap = max((wa[k] - wb[k]).abs().max().item() for k in wa)
    assert gap < 1e-5, gap  # measured: 0.0
    ma, mb = _metrics(a), [m for m in _metrics(b) if m["step"] >= steps[0]]
    assert [m["step"] for m in ma] == [m["step"] for m in mb] == steps
    assert [m["reward"] for m in ma] == [m["reward"] for m in mb]
    for name in ("loss", "grad_norm", "kl"):
        assert [m[name] for m in ma] == pytest.approx([m[name] for m in mb], rel=1e-5, abs=1e-9), name


@pytest.mark.trains
@pytest.mark.processes
def test_an_fsdp_checkpoint_of_an_rlvr_before_sharded_checkpoints_resumes_under_fsdp_as_in_one_process(tiny_model_dir, tmp_path):
    """A user upgrading rlvr mid-run: the whole checkpoint resumes under fsdp (the weights scattered into
    the shards, the optimizer state and the moved reference loaded into theirs) to the weights, rewards,
    losses and KL of the same checkpoint resumed in one process without fsdp.  The run then writes
    sharded checkpoints, and its checkpoint-4 resumed in one process (the optimizer state and the moved
    reference read whole from its shards) ends as the run itself."""
    checkpoint = tmp_path / "old" / "checkpoint-2"
    shutil.copytree(WHOLE_FSDP_CHECKPOINT, checkpoint)
    assert verify(checkpoint) is None and not is_sharded(checkpoint)  # resume takes it, by the old layout's branch
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    six = ["max_steps=6", f"resume_from_checkpoint={checkpoint}"]
    one_process = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "one", "grpo") + [k for k in KL if k != "fsdp=true"]
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "fsdp", "grpo", processes=2) + KL + six, processes=2)
    _run(one_process + six, processes=1)
    old = _weights(checkpoint)
    assert max((t - old[k]).abs().max().item() for k, t in _weights(tmp_path / "one").items()) > 1e-3  # steps 3 to 6 trained
    _same_steps(tmp_path / "one", tmp_path / "fsdp", [3, 4, 5, 6])
    sharded = tmp_path / "fsdp" / "checkpoint-4"
    assert is_sharded(sharded) and verify(sharded) is None
    _run([a.replace(str(tmp_path / "one"), str(tmp_path / "one-from-4")) for a in one_process] + ["max_steps=6",
         f"resume_from_checkpoint={sharded}"], processes=1)
    _same_steps(tmp_path / "one-from-4", tmp_path / "fsdp", [5, 6])


FIRST_EVALUATION_BEST = """
from pathlib import Path

def distinct(completions, **kwargs):
    if len(completions) != 4:  # training: 2 groups of 4 on each rank
        return [len(set(c)) / 4 for c in completions]
    seen = Path(__file__).with_name("evaluations")  # the held-out evaluation, on rank 0: 4 problems, greedy
    n = int(seen.read_text()) + 1 if seen.exists() else 1
    seen.write_text(str(n))
    return [1.0 if n == 1 else 0.0] * 4
"""


@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_loads_the_best_checkpoint_at_the_end_from_its_shards(tiny_model_dir, tmp_path):
    """load_best_model_at_end under fsdp: the first evaluation (step 2) is the best, so each rank reads
    its shards of checkpoint-2 back at the end, and the final model (streamed from the shards) is that
    checkpoint's weights, not those of step 4."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(FIRST_EVALUATION_BEST)
    best = ["eval_strategy=steps", "eval_steps=2", "save_steps=2", "max_steps=4", "metric_for_best_model=eval_reward",
            "load_best_model_at_end=true", "reward_isolation=inline", "fsdp=true"]
    out = _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "fsdp", "grpo", processes=2) + best, processes=2)
    assert "the final model is checkpoint-2" in out.stdout, out.stdout[-2000:]
    assert (tmp_path / "evaluations").read_text() == "2"
    final = _weights(tmp_path / "fsdp")
    second, fourth = (load_model(str(tmp_path / "fsdp" / f"checkpoint-{n}"))[0].state_dict() for n in (2, 4))
    assert all(torch.equal(final[k], second[k]) for k in final)
    assert max((final[k] - fourth[k]).abs().max().item() for k in final) > 1e-4


# Records, on each rank, how many elements the unsharded copy holds while the sampler generates and
# while the update runs (fsdp.GatheredCopy), into held-<rank>.json in the run's directory.
RECORDS_WHAT_IS_HELD = """
import json, os, sys
from pathlib import Path

import rlvr.fsdp, rlvr.rollout.engine, rlvr.update

copies, seen = [], {"sampling": set(), "update": set()}
init, generate, accumulate = rlvr.fsdp.GatheredCopy.__init__, rlvr.rollout.engine.HFSampler.generate, rlvr.update.PolicyUpdate.accumulate_gradients

def held():
    return sum(p.numel() for c in copies for p in c.full.parameters())

def registered(self, *args, **kwargs):
    init(self, *args, **kwargs)
    copies.append(self)

def sampling(self, *args, **kwargs):
    seen["sampling"].add(held())
    return generate(self, *args, **kwargs)

def updating(self, *args, **kwargs):
    seen["update"].add(held())
    return accumulate(self, *args, **kwargs)

rlvr.fsdp.GatheredCopy.__init__, rlvr.rollout.engine.HFSampler.generate = registered, sampling
rlvr.update.PolicyUpdate.accumulate_gradients = updating
from rlvr.cli import main
code = main(["train", *sys.argv[1:]])
out = Path([a for a in sys.argv if a.startswith("output_dir=")][0].split("=", 1)[1])
(out / f"held-{os.environ['RANK']}.json").write_text(json.dumps({k: sorted(v) for k, v in seen.items()}))
sys.exit(code)
"""


@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_holds_the_whole_weights_only_while_it_samples(tiny_model_dir, fsdp_kl):
    """No permanent unsharded copy: each rank's copy of the whole model has its weights while the
    in-process sampler generates (gathered from the shards) and none while the update runs (the KL
    layout: the sharded reference's log-probs and its syncs gather nothing whole either)."""
    where, _ = fsdp_kl
    whole = sum(t.numel() for k, t in _weights(tiny_model_dir).items() if k != "lm_head.weight")  # tied: one tensor
    for rank in (0, 1):
        seen = json.loads((where / "ended" / f"held-{rank}.json").read_text())
        assert seen == {"sampling": [whole], "update": [0]}, seen


# Rank 0 streams a sharded model's weight update twice (a retry), as it does to vLLM servers, and once
# more gathers two tensors out of order; rank 1 only follows.  Every rank also loads the update pair by
# pair, as colocated vLLM does.  What rank 0 decoded is saved to compare with the unsharded weights.
STREAMS_SHARDS = """
import json, sys
from pathlib import Path
import safetensors.torch
import torch
from transformers import AutoModelForCausalLM
from rlvr import distributed, fsdp
from rlvr.rollout.weights import Relay, decode, encode, weight_update

world = distributed.init(use_cpu=True)
plain = AutoModelForCausalLM.from_pretrained(sys.argv[1])
like = fsdp.without_weights(plain)  # the unsharded copy without weights, as a run keeps
model = fsdp.shard(plain, world.device, world.world_size)
update = weight_update(model, False, 1)
assert update.sharded and all(hasattr(t, "full_tensor") for t in update.tensors.values())
local = {name: t.to_local().numel() for name, t in update.tensors.items()}
assert sum(local.values()) < 0.6 * sum(t.numel() for t in update.tensors.values())  # each rank holds about half
colocated = dict(update.pairs())  # every rank, the same order
relay = Relay(update, world)
if world.is_main:
    relay.lead()
    streams = []
    for attempt in range(2):
        total, pieces = encode(update, torch.float32)
        data = b"".join(pieces)
        assert len(data) == total
        offset = 0
        def read(n):
            global offset
            offset += n
            return data[offset - n : offset]
        meta, tensors = decode(read)
        streams.append(dict(tensors))
    names = list(update.tensors)
    late = {name: update.value(name) for name in (names[-1], names[0])}
    relay.done()
    assert all(torch.equal(streams[0][k], streams[1][k]) for k in streams[0])
    assert all(torch.equal(late[k], streams[0][k]) and torch.equal(colocated[k], streams[0][k]) for k in late)
    torch.save({"streamed": streams[0], "colocated": colocated, "aliases": meta["aliases"]}, sys.argv[2])
else:
    relay.follow()
# The same from a sharded LoRA model, for servers that take no adapter: each weight sent with its adapter
# merged in, made from the gathered shards as it is sent (rank 0 keeps the most it differs from peft's merge).
import copy
from peft import LoraConfig, get_peft_model
torch.manual_seed(0)  # A's random start, the same on every rank (as lora.wrap seeds it)
adapted = get_peft_model(AutoModelForCausalLM.from_pretrained(sys.argv[1]), LoraConfig(r=4, lora_alpha=8, target_modules="all-linear"))
gen = torch.Generator().manual_seed(1)
with torch.no_grad():
    for name, p in adapted.named_parameters():
        if "lora_B" in name:
            p.copy_(torch.randn(p.shape, generator=gen) * 0.3)
merged = copy.deepcopy(adapted).merge_and_unload().state_dict()
adapted = fsdp.shard(adapted, world.device, world.world_size)
update = weight_update(adapted, False, 2)
assert update.sharded and len(update.merged) == 14
relay = Relay(update, world)
if world.is_main:
    relay.lead()
    gap = max((t - merged[name]).abs().max().item() for name, t in update.pairs())
    moved = max((merged[name] - AutoModelForCausalLM.from_pretrained(sys.argv[1]).state_dict()[name]).abs().max().item()
                for name in update.merged)
    relay.done()
    Path(sys.argv[2] + ".lora.json").write_text(json.dumps({"gap": gap, "moved": moved}))
else:
    relay.follow()
# The final model: saved by fsdp.save_streamed into safetensors shards of at most argv[4] bytes (plus one
# tensor); rank 0 records the most bytes of weights it held at once.
out, most = Path(sys.argv[3]), [0]
save_file = sys.modules["safetensors.torch"].save_file
def counting(tensors, path, metadata=None):
    most[0] = max(most[0], sum(t.numel() * t.element_size() for t in tensors.values()))
    save_file(tensors, path, metadata=metadata)
sys.modules["safetensors.torch"].save_file = counting
if world.is_main:
    out.mkdir()
fsdp.save_streamed(model, like, out if world.is_main else None, shard_bytes=int(sys.argv[4]))
if world.is_main:
    (out / "most.json").write_text(json.dumps(most[0]))
distributed.wait_for_all(world)
distributed.shutdown(world)
"""


@pytest.mark.processes
def test_a_sharded_models_weights_stream_one_gathered_tensor_at_a_time(tiny_model_dir, tmp_path):
    """vLLM servers and colocated engines are sent the weights of a sharded model (fsdp) as each
    tensor is gathered: rank 0 sends, the other ranks join each gather it asks for, also when it
    sends the update twice (a failed server, a relay) or a tensor out of order; what arrives is the
    unsharded model's weights exactly, and from a LoRA model peft's merged weights, each merged from
    its gathered shards as it is sent.  The final model of an fsdp run is streamed the same way
    (fsdp.save_streamed) into Hugging Face's sharded layout (the shards and their index), rank 0
    holding no more than one shard's weights at a time; it loads to the unsharded weights."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    script = tmp_path / "streams_shards.py"
    script.write_text(STREAMS_SHARDS)
    expected_state = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    limit = 3 * max(t.numel() * t.element_size() for t in expected_state.values())
    saved = tmp_path / "saved"
    out = _launch([str(tiny_model_dir), str(tmp_path / "got.pt"), str(saved), str(limit)], processes=2, timeout=120, script=script,
                  torchrun=True)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    got = torch.load(tmp_path / "got.pt")
    expected = dict(AutoModelForCausalLM.from_pretrained(tiny_model_dir).named_parameters())
    assert sorted(got["streamed"]) == sorted(expected)
    for name, value in expected.items():
        assert torch.equal(got["streamed"][name], value.detach()), name
        assert torch.equal(got["colocated"][name], value.detach()), name
    assert got["aliases"] == {"lm_head.weight": "model.embed_tokens.weight"}  # tied: sent once, named twice
    shards = sorted(saved.glob("model-*.safetensors"))
    index = json.loads((saved / "model.safetensors.index.json").read_text())
    assert len(shards) > 2 and sorted(set(index["weight_map"].values())) == [p.name for p in shards]
    assert json.loads((saved / "most.json").read_text()) <= limit and all(len(load_file(p)) >= 1 for p in shards)
    loaded = AutoModelForCausalLM.from_pretrained(saved).state_dict()
    assert sorted(loaded) == sorted(expected_state) and all(torch.equal(loaded[k], expected_state[k]) for k in expected_state)
    assert "lm_head.weight" not in index["weight_map"]  # tied: saved once
    lora = json.loads((tmp_path / "got.pt.lora.json").read_text())
    assert lora["moved"] > 1e-2 and lora["gap"] < 1e-6, lora  # a LoRA model's shards: its merged weights


KILLS_RANK_0 = """
import os, signal
from pathlib import Path

def distinct(completions, trainer_state=None, **kwargs):
    marker = Path(os.environ["RLVR_TEST_KILL_MARKER"])
    if os.environ.get("RANK") == "0" and trainer_state.global_step == 3 and not marker.exists():
        marker.write_text("killed")
        os.kill(os.getpid(), signal.SIGKILL)  # kill -9 of rank 0 while it samples step 4; torchrun ends rank 1
    return [len(set(c)) / 4 for c in completions]
"""


@pytest.mark.slow  # two launches, and the shared one
@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_killed_with_sigkill_resumes_on_the_same_ranks_to_the_weights_of_a_run_that_never_stopped(tiny_model_dir, tmp_path,
                                                                                                       monkeypatch, fsdp_kl):
    """kill -9 of one rank of a sharded run (the KL layout: a sharded reference, synced every 2 steps)
    while it samples step 4, then resume=true on 2 processes again from checkpoint-2: the final weights
    and the metrics of the run that never stopped (fsdp_kl)."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(KILLS_RANK_0)
    monkeypatch.setenv("RLVR_TEST_KILL_MARKER", str(tmp_path / "killed"))
    args = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "fsdp", "grpo", processes=2) + KL
    killed = _launch(args, processes=2, timeout=300, torchrun=True)  # torchrun ends rank 1 once rank 0 is killed
    assert killed.returncode != 0 and (tmp_path / "killed").is_file(), killed.stderr[-3000:]
    assert not (tmp_path / "fsdp" / "model.safetensors").exists() and (tmp_path / "fsdp" / "checkpoint-2").is_dir()
    assert not (tmp_path / "fsdp" / "checkpoint-4").exists()
    assert "resumed from" in _run(args + ["resume=true"], processes=2).stdout
    straight, resumed = _weights(fsdp_kl[0] / "ended"), _weights(tmp_path / "fsdp")
    assert all(torch.equal(straight[k], resumed[k]) for k in straight)
    timed = ("step_time", "tokens_per_second")
    same = lambda rows: [{k: v for k, v in r.items() if not k.startswith("timing/") and k not in timed} for r in rows]  # noqa: E731
    assert same(_metrics(tmp_path / "fsdp")) == same(_metrics(fsdp_kl[0] / "ended"))
