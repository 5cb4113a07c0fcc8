"""Several training processes (distributed.py): two gloo processes (under torchrun, or started as
torchrun starts them: conftest.launch_ranks) train to the same weights as one process on the same data (also sampling ahead, max_staleness=1), a rank
without signal does not hang, and the helpers and per-group sampling streams that make this exact."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch
from conftest import launch_ranks
import warm

from rlvr import distributed
from rlvr.config import ConfigError, build_config
from rlvr.distributed import World
from rlvr.models import eos_token_ids
from rlvr.settings import check_runnable
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, HFSampler
from rlvr.rollout.sampling import GroupGenerators

REWARD = """
import os

def distinct(completions, **kwargs):
    return [len(set(c)) / 4 for c in completions]

def silent_on_rank_1(completions, **kwargs):  # rank 1's groups never carry signal
    if os.environ.get("RANK") == "1":
        return [0.0] * len(completions)
    return [len(set(c)) / 4 for c in completions]
"""


def _settings(model_dir, plugin, reward: str, output_dir, loss_type: str, processes: int = 1) -> list[str]:
    # 4 prompts x 4 completions a step: two micro-batches of 8 in the single process; on two processes
    # (per_device_train_batch_size is per process, as in TRL) 2 groups per rank, one micro-batch of 8 on each.
    return [
        f"model={model_dir}", "task_args.num_train=50", "task_args.num_test=4", f"reward_funcs=[{plugin}:{reward}]",
        "num_generations=4", "per_device_train_batch_size=8", f"gradient_accumulation_steps={2 // processes}", "max_completion_length=4",
        "learning_rate=1e-2", "lr_scheduler_type=constant", "max_steps=3", "logging_steps=1", "save_steps=1000",
        "eval_on_start=false", "eval_on_end=false", "report_steps=0", f"loss_type={loss_type}", f"output_dir={output_dir}",
        "use_cpu=true",  # gloo between CPU processes, on a machine with GPUs too
    ]


def _run(args: list[str], processes: int, timeout: int = 150, torchrun: bool = False) -> subprocess.CompletedProcess:
    """`rlvr train args` in `processes` processes, asserting success (several: `_launch`)."""
    if processes > 1:
        out = _launch(args, processes, timeout, torchrun=torchrun)
    else:
        with tempfile.TemporaryDirectory() as logs:
            out = warm.run(["-m", "rlvr.cli", "train"] + args, {**os.environ, "OMP_NUM_THREADS": "1"}, timeout, logs)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    return out


@pytest.fixture(scope="module")
def one_process(tiny_model_dir, tmp_path_factory):
    """The single-process run that several layouts are compared with, `_settings` (reward "distinct") plus
    `extra`, each one made once for the module and its directory returned."""
    runs = {}

    def run(loss_type: str = "grpo", *extra: str):
        if (loss_type, *extra) not in runs:
            where = tmp_path_factory.mktemp("one")
            (where / "reward.py").write_text(REWARD)
            _run(_settings(tiny_model_dir, where / "reward.py", "distinct", where / "run", loss_type) + list(extra), processes=1)
            runs[(loss_type, *extra)] = where / "run"
        return runs[(loss_type, *extra)]

    return run


def _weights(path):
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


def _metrics(path) -> list[dict]:
    return [json.loads(line) for line in (path / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.trains
@pytest.mark.processes
def test_two_processes_train_to_the_weights_of_one(tiny_model_dir, tmp_path, one_process):
    """Under torchrun itself, as users launch it (the other tests start the ranks as torchrun does).  dapo's
    normaliser over every rank's tokens is the fsdp runs' (tests/test_fsdp_runs.py, rlvr's default loss)."""
    loss_type = "grpo"
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    ref = one_process(loss_type)
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "two", loss_type, processes=2), processes=2, torchrun=True)
    start, one, two = _weights(tiny_model_dir), _weights(ref), _weights(tmp_path / "two")
    moved = max((one[k] - start[k]).abs().max().item() for k in one)
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert moved > 1e-3, moved  # three real updates happened
    assert gap < 1e-5, gap  # measured: about 1e-7
    # Every rank sampled its share of the groups with the streams one process uses: the same completions and rewards.
    m1, m2 = _metrics(ref), _metrics(tmp_path / "two")
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]
    assert [m["frac_reward_zero_std"] for m in m1] == [m["frac_reward_zero_std"] for m in m2]
    assert [m["grad_norm"] for m in m1] == pytest.approx([m["grad_norm"] for m in m2], rel=1e-4)
    assert sum(1 for m in m1 if m["frac_reward_zero_std"] < 1) == 3  # every step had a group with signal
    # Only rank 0 wrote files: one line per step, one checkpoint.
    assert len(m2) == 3
    assert sorted(p.name for p in (tmp_path / "two").glob("checkpoint-*")) == ["checkpoint-3"]


ENVIRONMENT = """
from rlvr.environments import Step

class Echo:  # three turns: each answered with the last character the model wrote
    def reset(self, example):
        self.turns = 0

    def step(self, text):
        self.turns += 1
        return Step(text[-1:] or "?", done=self.turns >= 3)
"""


@pytest.mark.trains
@pytest.mark.processes
def test_two_processes_with_multi_turn_rollouts_train_to_the_weights_of_one(tiny_model_dir, tmp_path, monkeypatch):
    """Each rollout's later turns are seeded from its group: the processes sample what one process does."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    (tmp_path / "echo_env.py").write_text(ENVIRONMENT)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(tmp_path), os.environ.get("PYTHONPATH")])))
    turns = ["environment=echo_env:Echo", "max_turns=3", "max_completion_length=24", "stop_strings=[a,e,i,o,u,' ']"]
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "one", "grpo") + turns, processes=1)
    _run(_settings(tiny_model_dir, plugin, "distinct", tmp_path / "two", "grpo", processes=2) + turns, processes=2)
    one, two = _weights(tmp_path / "one"), _weights(tmp_path / "two")
    assert max((one[k] - two[k]).abs().max().item() for k in one) < 1e-5
    m1, m2 = _metrics(tmp_path / "one"), _metrics(tmp_path / "two")
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]
    assert [m["turns/mean"] for m in m1] == [m["turns/mean"] for m in m2] and max(m["turns/mean"] for m in m1) > 1


@pytest.mark.trains
@pytest.mark.processes
def test_a_rank_without_signal_takes_part_without_hanging(tiny_model_dir, tmp_path):
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    _run(_settings(tiny_model_dir, plugin, "silent_on_rank_1", tmp_path / "two", "grpo", processes=2), processes=2, timeout=120)
    lines = _metrics(tmp_path / "two")
    assert len(lines) == 3
    assert all(m["frac_reward_zero_std"] >= 0.5 for m in lines)  # rank 1's two groups of four had none
    assert any(m["frac_reward_zero_std"] < 1 for m in lines)  # rank 0 trained, rank 1 summed zeros with it
    start, end = _weights(tiny_model_dir), _weights(tmp_path / "two")
    assert max((end[k] - start[k]).abs().max().item() for k in end) > 1e-3


@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_rank_without_signal_runs_empty_micro_batches(tiny_model_dir, tmp_path):
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    # Micro-batches of 4: rank 0 has two, rank 1 none, so rank 1 runs two empty ones beside them.
    args = _settings(tiny_model_dir, plugin, "silent_on_rank_1", tmp_path / "fsdp", "grpo", processes=2)
    _run(args + ["fsdp=true", "per_device_train_batch_size=4", "gradient_accumulation_steps=2"], processes=2, timeout=120)
    lines = _metrics(tmp_path / "fsdp")
    assert len(lines) == 3 and any(m["frac_reward_zero_std"] < 1 for m in lines)
    start, end = _weights(tiny_model_dir), _weights(tmp_path / "fsdp")
    assert max((end[k] - start[k]).abs().max().item() for k in end) > 1e-3


def test_fsdp_needs_several_processes():
    with pytest.raises(ConfigError, match="fsdp=true shards the model across several processes"):
        check_runnable(build_config({"fsdp": True}), distributed.SINGLE)


def test_world_from_the_launcher_environment():
    assert distributed.world_from_env({}, use_cpu=True) == distributed.SINGLE
    assert distributed.world_from_env({"WORLD_SIZE": "1", "RANK": "0"}, use_cpu=True) == distributed.SINGLE
    world = distributed.world_from_env({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}, use_cpu=True)
    assert (world.rank, world.world_size, world.local_rank, world.is_main) == (3, 4, 1, False)
    with pytest.raises(ConfigError, match="RANK is not"):
        distributed.world_from_env({"WORLD_SIZE": "2"})
    # between GPUs gloo carries the CPU tensors (fsdp_offload_params keeps shards and gradients there)
    assert distributed.backend_for("cpu") == "gloo" and distributed.backend_for("cuda:1") == "cuda:nccl,cpu:gloo"


def test_each_process_takes_its_own_gpu(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 2)
    env = {"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1", "LOCAL_WORLD_SIZE": "2"}
    assert distributed.world_from_env(env, use_cpu=False).device == "cuda:1"
    assert distributed.world_from_env(env, use_cpu=True).device == "cpu"
    assert distributed.world_from_env({}, use_cpu=False).device == "cuda:0"
    with pytest.raises(ConfigError, match=r"3 processes on this machine but 2 GPU\(s\).*--nproc-per-node=2.*use_cpu=true"):
        distributed.world_from_env({**env, "LOCAL_WORLD_SIZE": "3"}, use_cpu=False)


def test_groups_are_split_whole_and_contiguous():
    assert [list(distributed.shard(6, World(r, 3))) for r in range(3)] == [[0, 1], [2, 3], [4, 5]]
    assert list(distributed.shard(6, distributed.SINGLE)) == [0, 1, 2, 3, 4, 5]


def test_each_process_gets_whole_groups():
    cfg = build_config({"num_generations": 4, "per_device_train_batch_size": 4, "generation_batch_size": 12})  # 3 prompts
    check_runnable(cfg.for_processes(3), World(0, 3))
    assert cfg.for_processes(3).prompts_per_step == 3  # generation_batch_size is the whole run's
    with pytest.raises(ConfigError, match=r"each of the 2 processes gets 6 completions of a generation .*not a whole number "
                                          r"of groups of num_generations=4"):
        check_runnable(build_config({"num_generations": 4, "per_device_train_batch_size": 6, "num_processes": 2}), World(0, 2))
    with pytest.raises(ConfigError, match="rollout_workers is not supported with several training processes: .* `rlvr vllm-serve`"):
        check_runnable(build_config({"rollout_workers": 2, "num_generations": 4, "per_device_train_batch_size": 16}), World(0, 2))


def test_vllm_with_several_processes_passes_the_launch_rules():
    import importlib.util

    from rlvr.rollout.vllm import VLLMError

    for mode in ("server", "colocate"):
        cfg = build_config({"use_vllm": True, "vllm_mode": mode, "num_generations": 4, "per_device_train_batch_size": 16})
        if importlib.util.find_spec("vllm") is None:  # the main venv: only the missing package is left to say
            with pytest.raises(VLLMError, match="vLLM is not installed"):
                check_runnable(cfg, World(0, 2))
        else:
            check_runnable(cfg, World(0, 2))


def test_metric_sums_merge_by_sum_max_and_min():
    parts = [{"loss": 1.0, "a/max": 2.0, "a/min": 0.5}, {"loss": 0.5, "a/max": 3.0, "kl": 1.0, "a/min": 0.25}, {}]
    assert distributed.merge_sums(parts) == {"loss": 1.5, "a/max": 3.0, "kl": 1.0, "a/min": 0.25}


@pytest.mark.parametrize("sampler_cls", [HFSampler, FastSampler])
def test_a_groups_completions_do_not_depend_on_the_groups_beside_it(tiny, sampler_cls):
    """What makes the split exact: prompt i sampled alone with seed s_i gives the completions
    it gets when sampled with the others."""
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, eos_token_ids(model, tokenizer))
    prompts = [tokenizer.encode(t) for t in ["ab", "cde", "f", "ghij"]]
    params = SamplingParams(n=3, max_tokens=6, temperature=1.0, top_p=0.95)
    seeds = [11, 12, 13, 14]
    together = sampler.generate(prompts, params, GroupGenerators(seeds))
    for i in range(4):
        alone = sampler.generate(prompts[i : i + 1], params, GroupGenerators(seeds[i : i + 1]))
        assert [r.completion_ids for r in alone[0]] == [r.completion_ids for r in together[i]]
        for a, b in zip(alone[0], together[i]):
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-5)
    other = sampler.generate(prompts, params, GroupGenerators([21, 22, 23, 24]))
    assert [[r.completion_ids for r in g] for g in other] != [[r.completion_ids for r in g] for g in together]


def _launch(args: list[str], processes: int, timeout: int, script=None, torchrun: bool = False) -> subprocess.CompletedProcess:
    """`rlvr train args` (or `script args`) in `processes` processes, not asserting success: as torchrun
    launches them (conftest.launch_ranks), or with `torchrun` under torchrun itself; a launch that
    hangs is killed whole, torchrun and its processes (subprocess.run's timeout would leave them
    running), and fails the test."""
    program = [str(script)] if script else ["-m", "rlvr.cli", "train"]
    if not torchrun:
        return launch_ranks(program + args, processes, timeout, env={"OMP_NUM_THREADS": "1"})
    command = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={processes}"] + program + args
    with subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env={**os.environ, "OMP_NUM_THREADS": "1"}) as proc:
        try:
            out, err = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            out, err = proc.communicate()
            pytest.fail(f"hung: killed after {timeout} s\n{out[-2000:]}{err[-3000:]}")
    return subprocess.CompletedProcess(command, proc.returncode, out, err)


def _stop_after_checkpoint_1(run_dir) -> None:
    """Leave a finished run (save_steps=1) as if it had stopped after writing checkpoint-1."""
    (run_dir / "model.safetensors").unlink()
    for stale in ("checkpoint-2", "checkpoint-3", "metrics.jsonl"):
        path = run_dir / stale
        shutil.rmtree(path) if path.is_dir() else path.unlink()


@pytest.mark.slow  # three launches: about a minute on two idle cores
@pytest.mark.trains
@pytest.mark.processes
def test_two_processes_sampling_ahead_train_to_the_weights_of_one_and_resume_exactly(tiny_model_dir, tmp_path, one_process):
    """max_staleness=1: each process samples its groups of the next generation in a thread and gathers
    them in the sampling process group while the update's collectives run in the default one."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    ahead = ["max_staleness=1", "save_steps=1"]
    ref = one_process("grpo", *ahead)
    args = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "two", "grpo", processes=2) + ahead
    out = _launch(args, processes=2, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    start, one, two = _weights(tiny_model_dir), _weights(ref), _weights(tmp_path / "two")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert gap < 1e-5, gap  # measured: 2.2e-7
    m1, m2 = _metrics(ref), _metrics(tmp_path / "two")
    assert [m["sampling/staleness"] for m in m2] == [0, 1, 1] == [m["sampling/staleness"] for m in m1]
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]  # the same completions, from the same weights
    for key in ("grad_norm", "sampling/importance_sampling_ratio/mean"):
        assert [m[key] for m in m1] == pytest.approx([m[key] for m in m2], rel=1e-5), key
    # checkpoint-1 holds each rank's share of step 2's generation, sampled ahead; the resumed step 2
    # samples step 3's from the checkpoint's weights: the run that did not stop.
    _stop_after_checkpoint_1(tmp_path / "two")
    out = _launch(args + ["resume=true"], processes=2, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = _weights(tmp_path / "two")
    assert max((resumed[k] - two[k]).abs().max().item() for k in two) == 0.0
    assert [m["sampling/staleness"] for m in _metrics(tmp_path / "two")] == [1, 1]


@pytest.mark.slow  # three launches: about a minute on two idle cores
@pytest.mark.trains
@pytest.mark.processes
def test_fsdp_sampling_ahead_trains_to_the_weights_of_one_process_and_resumes_exactly(tiny_model_dir, tmp_path, one_process):
    """fsdp=true with max_staleness=1: the sampler's copy of the weights is refreshed from the full copy
    (gathered from the shards) once the step's update and the generation sampled ahead are done."""
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    ahead = ["max_staleness=1", "save_steps=1"]
    ref = one_process("grpo", *ahead)
    args = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "fsdp", "grpo", processes=2) + ahead + ["fsdp=true"]
    out = _launch(args, processes=2, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    start, one, two = _weights(tiny_model_dir), _weights(ref), _weights(tmp_path / "fsdp")
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert gap < 1e-5, gap  # measured: 3.5e-7
    m1, m2 = _metrics(ref), _metrics(tmp_path / "fsdp")
    assert [m["sampling/staleness"] for m in m2] == [0, 1, 1]
    assert [m["reward"] for m in m1] == [m["reward"] for m in m2]
    for key in ("grad_norm", "sampling/importance_sampling_ratio/mean"):
        assert [m[key] for m in m1] == pytest.approx([m[key] for m in m2], rel=1e-5), key
    _stop_after_checkpoint_1(tmp_path / "fsdp")
    out = _launch(args + ["resume=true"], processes=2, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    resumed = _weights(tmp_path / "fsdp")
    assert max((resumed[k] - two[k]).abs().max().item() for k in two) == 0.0


FAILS_ON_RANK_1 = '''
import os, sys, time

import rlvr.update

update = rlvr.update.PolicyUpdate.__call__


def fails_on_rank_1(self, batch, step, *rest):
    """Rank 1's update of step 2 fails before its first collective, once it has served the reward calls
    of the generation sampled ahead: its thread then waits in the sampling group's gather for rank 0's,
    whose reward calls wait for rank 0's training loop, which waits for rank 1 in the update."""
    if step == 2 and os.environ["RANK"] == "1":
        for _ in range(50):
            self.between_micro_batches()
            time.sleep(0.1)
        raise RuntimeError("rank 1's update failed (on purpose)")
    return update(self, batch, step, *rest)


rlvr.update.PolicyUpdate.__call__ = fails_on_rank_1
from rlvr.cli import main

sys.exit(main(["train", *sys.argv[1:]]))
'''


@pytest.mark.trains
@pytest.mark.processes
def test_an_update_that_fails_on_one_process_while_sampling_ahead_ends_the_run(tiny_model_dir, tmp_path):
    """The failing process does not wait for its thread (which waits for the others, which wait for it):
    it exits, and torchrun stops the others.  Waiting for the thread hung until the timeout."""
    plugin, script = tmp_path / "reward.py", tmp_path / "fails_on_rank_1.py"
    plugin.write_text(REWARD)
    script.write_text(FAILS_ON_RANK_1)
    args = _settings(tiny_model_dir, plugin, "distinct", tmp_path / "two", "grpo", processes=2) + ["max_staleness=1"]
    out = _launch(args, processes=2, timeout=240, script=script, torchrun=True)
    assert out.returncode != 0 and "rank 1's update failed (on purpose)" in out.stderr, out.stderr[-3000:]


def test_per_device_train_batch_size_is_each_processs_as_in_trl(monkeypatch):
    """TRL's batch: per_device_train_batch_size x processes x steps_per_generation.  The issue's case:
    2 processes of per_device_train_batch_size=4 with num_generations=4 train 2 groups a step."""
    cfg = build_config({"num_generations": 4, "per_device_train_batch_size": 4})
    assert (cfg.num_processes, cfg.prompts_per_step) == (None, 1)
    two = cfg.for_processes(2)
    assert (two.num_processes, two.completions_per_generation, two.prompts_per_step, two.steps_per_optimizer_step) == (2, 8, 2, 1)
    check_runnable(two, World(0, 2))
    spg = build_config({"num_generations": 4, "per_device_train_batch_size": 4, "steps_per_generation": 4,
                        "gradient_accumulation_steps": 2}).for_processes(2)
    assert (spg.completions_per_generation, spg.steps_per_optimizer_step) == (32, 2)  # as TRL: 4 x 2 x 4; 2 optimizer steps
    monkeypatch.setenv("WORLD_SIZE", "2")  # under torchrun the settings are read for its processes, as TRL reads them
    assert build_config({"num_generations": 4, "per_device_train_batch_size": 2}).prompts_per_step == 1  # valid for 2 only
    with pytest.raises(ConfigError, match=r"num_processes=3, but 2 processes were launched: per_device_train_batch_size is per "
                                          r"process.*torchrun --nproc_per_node 3"):
        build_config({"num_processes": 3}).for_processes(2)


def test_resuming_on_another_number_of_processes_is_refused(tmp_path):
    """The batch is per process, so a run resumed on another count would train another course."""
    from rlvr.config import save_config
    from rlvr.rundir import SettingsChanged, compare_settings

    cfg = build_config({"num_generations": 4, "per_device_train_batch_size": 4})
    save_config(cfg, tmp_path / "config.yaml")  # trained in one process
    with pytest.raises(SettingsChanged, match=r"num_processes: None -> 2"):
        compare_settings(cfg.for_processes(2).to_dict(), tmp_path, 3, override=False, say=lambda text: None)
    assert compare_settings(cfg.for_processes(1).to_dict(), tmp_path, 3, override=False) is False


def test_fsdp_offload_is_refused_without_fsdp_and_on_the_cpu():
    with pytest.raises(ConfigError) as caught:
        build_config({"fsdp_offload_params": True})
    assert str(caught.value) == ("invalid configuration:\n  - fsdp_offload_params=true offloads the shards of fsdp to the CPU: "
                                 "set fsdp=true too (under torchrun)")
    two_on_cpu = distributed.World(rank=0, world_size=2, device="cpu")
    with pytest.raises(ConfigError) as caught:
        check_runnable(build_config({"fsdp": True, "fsdp_offload_params": True, "num_processes": 2}), two_on_cpu)
    assert str(caught.value) == (
        "fsdp_offload_params=true keeps FSDP's shards in CPU memory and copies each layer's to the GPU for its use, but this "
        "run is on cpu, where they are in CPU memory already (and torch's CPUOffloadPolicy pins that memory, which needs a "
        "GPU): set fsdp_offload_params=false")


def test_offloaded_shards_train_to_the_weights_of_shards_kept_in_place(tiny, tmp_path, monkeypatch):
    """fsdp.shard(offload=True) gives every fully_shard call FSDP2's CPUOffloadPolicy; its path (the shards'
    host copies, the gradients' copy back, the optimizer on CPU DTensors, the clipped norm) trains to the same
    weights.  One gloo process on the CPU, where the policy moves nothing and pins nothing: what it saves
    on a GPU is benchmarks/gpu_checks.sh's to show."""
    import copy

    import torch.distributed.fsdp as torch_fsdp

    from rlvr import fsdp

    policies, real = [], torch_fsdp.fully_shard
    monkeypatch.setattr(torch_fsdp, "fully_shard", lambda module, **kw: policies.append(kw["offload_policy"]) or real(module, **kw))
    model, _ = tiny
    store = torch.distributed.FileStore(str(tmp_path / "store"), 1)
    torch.distributed.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        kept, offloaded = fsdp.shard(copy.deepcopy(model), "cpu", 1), fsdp.shard(copy.deepcopy(model), "cpu", 1, offload=True)
        assert [type(p).__name__ for p in policies] == ["OffloadPolicy"] * 3 + ["CPUOffloadPolicy"] * 3  # 2 layers and the root
        assert not policies[-1].pin_memory  # pinning needs an accelerator
        ids = torch.tensor([[1, 24, 22, 8, 33, 41, 35]])
        for sharded in (kept, offloaded):
            optimizer = torch.optim.AdamW(sharded.parameters(), lr=1e-2, fused=True)
            for _ in range(2):
                sharded(input_ids=ids).logits.logsumexp(-1).mean().backward()
                norm = torch.nn.utils.clip_grad_norm_(sharded.parameters(), 0.5)
                optimizer.step()
                optimizer.zero_grad()
        assert norm.full_tensor() > 0
        a, b = fsdp.full_state(kept), fsdp.full_state(offloaded)
        assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
        assert not all(torch.equal(a[k], model.state_dict()[k]) for k in a)  # both trained
    finally:
        torch.distributed.destroy_process_group()
