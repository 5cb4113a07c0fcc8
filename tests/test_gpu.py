"""On a CUDA GPU (skipped elsewhere): the tiny model trains there, and what it computes there
agrees with the CPU.  The CPU suite is the one CI runs; these are run by hand on a machine with
a GPU (docs/scaling.md, "One GPU").  Training through train() (test_learning, test_checkpoint, test_lora)
also lands on the GPU there, since a run takes cuda:0 whenever one is visible."""

import copy
import json

import pytest
import torch

from rlvr.config import build_config
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import make_sampler
from rlvr.rollout.sampling import GroupGenerators
from rlvr.run import train
from rlvr.trainer import Trainer
from rlvr.types import Batch, Example

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

PROMPTS = ["what is 2+2?", "what is 13+29?"]


def _trainer(model, tokenizer, tmp_path, **kw):
    cfg = build_config({"model": "default", "learning_rate": 1e-3, "num_generations": 4, "per_device_train_batch_size": 8,
                        "max_completion_length": 8, "temperature": 1.0, **kw})
    return Trainer(cfg, model, tokenizer, [Example("What is 1+1?", "2")], output_dir=tmp_path, total_steps=10)


def _pair(tiny):
    model, tokenizer = tiny
    return model, copy.deepcopy(model).to("cuda"), tokenizer


def _sample(sampler, tokenizer, seed: int = 0):
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS]
    params = SamplingParams(n=4, max_tokens=8, temperature=1.0)
    groups = sampler.generate(ids, params, GroupGenerators([seed, seed + 1]))
    rollouts = [r for g in groups for r in g]
    advantages = torch.linspace(-1, 1, len(rollouts))
    return Batch.from_rollouts(rollouts, advantages, torch.ones(len(rollouts), dtype=torch.bool), sampler.pad_id, False, 4)


def test_the_sampler_on_the_gpu_reports_what_the_trainer_computes_on_the_cpu(tiny, tmp_path):
    cpu_model, gpu_model, tokenizer = _pair(tiny)
    sampler = make_sampler(gpu_model, tokenizer, [tokenizer.eos_token_id])
    batch = _sample(sampler, tokenizer)
    assert batch.num_tokens > 0
    cpu = _trainer(cpu_model, tokenizer, tmp_path)
    with torch.no_grad():
        logprobs, _ = cpu.logprobs(cpu_model, batch)
    mask = batch.completion_mask
    assert (logprobs[mask] - batch.sampler_logprobs[mask]).abs().max() < 1e-4


def test_one_update_on_the_gpu_gives_the_cpu_gradient(tiny, tmp_path):
    cpu_model, gpu_model, tokenizer = _pair(tiny)
    batch = _sample(make_sampler(cpu_model, tokenizer, [tokenizer.eos_token_id]), tokenizer)
    cpu, gpu = _trainer(cpu_model, tokenizer, tmp_path), _trainer(gpu_model, tokenizer, tmp_path)
    assert gpu.device.type == "cuda"
    sums_cpu, sums_gpu = cpu.updater.accumulate_gradients(batch), gpu.updater.accumulate_gradients(batch)
    assert sums_gpu["loss"] == pytest.approx(sums_cpu["loss"], rel=1e-4, abs=1e-6)
    for (name, p), q in zip(cpu_model.named_parameters(), gpu_model.parameters()):
        assert q.grad.device.type == "cuda"
        assert torch.allclose(q.grad.cpu(), p.grad, rtol=1e-3, atol=1e-6), name


def test_bf16_autocast_on_the_gpu_stays_close_to_fp32(tiny, tmp_path):
    _, gpu_model, tokenizer = _pair(tiny)
    batch = _sample(make_sampler(gpu_model, tokenizer, [tokenizer.eos_token_id]), tokenizer)
    fp32, bf16 = _trainer(gpu_model, tokenizer, tmp_path), _trainer(gpu_model, tokenizer, tmp_path, bf16=True)
    with torch.no_grad():
        a, _ = fp32.logprobs(gpu_model, batch.to("cuda"))
        b, _ = bf16.logprobs(gpu_model, batch.to("cuda"))
    mask = batch.completion_mask.cuda()
    assert torch.allclose(a[mask], b[mask], atol=0.1)


@pytest.mark.trains
@pytest.mark.processes
def test_a_run_trains_on_the_gpu_and_learns(tiny_model_dir, tmp_path):
    plugin = tmp_path / "seven.py"
    plugin.write_text("def starts_with_seven(completions, **kw):\n    return [float(c.startswith('7')) for c in completions]\n")
    out = tmp_path / "run"
    cfg = build_config({
        "model": str(tiny_model_dir), "task_args": {"digits": 2, "num_train": 200, "num_test": 10},
        "reward_funcs": [f"{plugin}:starts_with_seven"], "num_generations": 8, "per_device_train_batch_size": 64,
        "max_completion_length": 4, "learning_rate": 1e-2, "max_steps": 40, "logging_steps": 1, "save_steps": 20,
        "beta": 0.04, "eval_on_start": False, "eval_on_end": True, "output_dir": str(out),
    })
    summary = train(cfg)
    assert json.loads((out / "summary.json").read_text())["device"] == "cuda:0"
    rewards = [json.loads(line)["reward"] for line in (out / "metrics.jsonl").read_text().splitlines()]
    assert sum(rewards[:3]) / 3 < 0.2 and sum(rewards[-3:]) / 3 > 0.8, rewards
    assert summary["steps"] == 40
    resumed = train(build_config({**cfg.to_dict(), "max_steps": 41, "resume": True}))  # a GPU checkpoint reloads
    assert resumed["steps"] == 41



def test_cuda_graphs_decode_what_the_eager_step_decodes(tiny):
    """The sampler a run gets on a GPU replays CUDA graphs (rollout/graphs.py).  Greedy: the same
    tokens as the CPU's fast sampler, log-probs within 1e-3.  Sampled with one seed per group, rows
    finishing at different steps (the cache compacted) and windows growing past one block: the
    same tokens and log-probs as the same static step run eagerly on the GPU."""
    from rlvr.rollout import graphs
    from rlvr.rollout.engine import FastSampler, GraphSampler

    cpu_model, gpu_model, tokenizer = _pair(tiny)
    eos = [tokenizer.eos_token_id, 7, 11, 13, 17, 19, 23]
    ids = [tokenizer(p, add_special_tokens=False)["input_ids"] for p in PROMPTS * 4]
    graphed = make_sampler(gpu_model, tokenizer, eos)
    assert type(graphed) is GraphSampler
    graphed.block = 16
    eager = GraphSampler(gpu_model, tokenizer, eos, graphs=False, block=16)
    greedy = SamplingParams(n=4, max_tokens=40, temperature=0)
    for a, c in zip(graphed.generate(ids, greedy), FastSampler(cpu_model, tokenizer, eos).generate(ids, greedy)):
        for x, z in zip(a, c):
            assert x.completion_ids == z.completion_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, z.logprobs)) < 1e-3
    sampled = SamplingParams(n=4, max_tokens=40, temperature=1.0)
    runs = [s.generate(ids, sampled, GroupGenerators(list(range(len(ids))))) for s in (graphed, eager)]
    lengths = set()
    for a, b in zip(*runs):
        for x, y in zip(a, b):
            assert x.completion_ids == y.completion_ids
            assert max(abs(u - v) for u, v in zip(x.logprobs, y.logprobs)) < 1e-5
            lengths.add(len(x.completion_ids))
    assert len(lengths) > 3
    assert not graphs._FAILED, graphs._FAILED
