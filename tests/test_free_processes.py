"""Free-running with several training processes (async_mode=free, trainer.py `from_rank0`): rank 0's producer
samples every process's share on the servers while the trainers train, each generation is shared when it
is taken (each rank trains the groups distributed.owners gives it), and the trainers load the servers
together after their optimizer steps (fsdp gathering each tensor on every rank).

The server here is rlvr's own HTTP server (rollout/vllm_server.py) in this process, its engine rlvr's
in-process sampler on the tiny model, which keeps the weights it started with: what it samples then
depends on the seeds alone, not on which weights were loaded when, so a free-running run of two
processes must train to the weights of one process on-policy, step for step (the test that catches a
generation shared wrongly: a rank training another's groups, or a group twice).  Whether the trainers
load the servers after each step is checked on the weights it is sent.  Runs in the vLLM environment
(use_vllm=true needs the package installed); vLLM's own server is tests/test_vllm_layouts.py's."""

from __future__ import annotations

import importlib.util
import shutil
import threading
from pathlib import Path

import pytest
import torch

from conftest import launch_ranks, metrics_rows

pytestmark = [pytest.mark.skipif(importlib.util.find_spec("vllm") is None,
                                 reason="use_vllm=true needs vLLM installed: run in the vLLM environment (make test-vllm)"),
              pytest.mark.slow, pytest.mark.trains, pytest.mark.processes]

REWARD = "def distinct(completions, **kwargs):\n    return [float(len(set(c))) for c in completions]\n"


class SamplerEngine:
    """VLLMEngine's interface (what rlvr's server calls) over rlvr's in-process sampler.  Its weights stay the
    ones it started with; each load is recorded: (version, how far the tensors sent are from the start)."""

    def __init__(self, model_dir: Path):
        from rlvr.models import eos_token_ids, load_model
        from rlvr.rollout.engine import make_sampler

        model, tokenizer, _ = load_model(str(model_dir))
        self.start = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.sampler = make_sampler(model, tokenizer, eos_token_ids(model, tokenizer))
        self.model_path, self.dtype, self.adapters, self.version = str(model_dir), "float32", False, 0
        self.loads: list[tuple[int, float]] = []

    def load(self, meta, tensors) -> int:
        moved = 0.0
        count = 0
        for name, tensor in tensors:
            moved = max(moved, (tensor.float() - self.start[name]).abs().max().item())
            count += 1
        self.version = meta["version"]
        self.loads.append((self.version, moved))
        return count

    def generate(self, prompt_ids, params, seeds):
        from rlvr.rollout import SamplingParams
        from rlvr.rollout.vllm_request import max_tokens_of

        groups = []
        for i, (prompt, seed) in enumerate(zip(prompt_ids, seeds)):  # one generator per prompt: a group depends on its seed alone
            sampling = SamplingParams(n=params["n"], max_tokens=max_tokens_of(params, i), temperature=params["temperature"],
                                      top_p=params["top_p"], top_k=params["top_k"], min_p=params["min_p"],
                                      repetition_penalty=params["repetition_penalty"], stop_strings=tuple(params["stop_strings"]))
            group = self.sampler.generate([prompt], sampling, torch.Generator().manual_seed(seed))[0]
            groups.append([{"prompt_ids": r.prompt_ids, "completion_ids": r.completion_ids, "logprobs": r.logprobs,
                            "finish_reason": r.finish_reason, "text": r.text} for r in group])
        return groups

    def close(self) -> None:
        pass


@pytest.fixture
def server(tiny_model_dir):
    from rlvr.rollout.vllm_server import VLLMServer

    engine = SamplerEngine(tiny_model_dir)
    http = VLLMServer(engine, "127.0.0.1", 0, relay_timeout=5.0)
    threading.Thread(target=http.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True).start()
    yield engine, f"http://127.0.0.1:{http.server_address[1]}"
    http.shutdown()
    http.server_close()


def settings(model_dir: Path, plugin: Path, url: str, out: Path, processes: int) -> list[str]:
    """4 steps of 4 prompts x 4 completions, a checkpoint every 2: two micro-batches of 8 in one process, one
    on each of two (per_device_train_batch_size is per process, as in TRL)."""
    return [f"model={model_dir}", f"reward_funcs=[{plugin}:distinct]", "task_args={digits: 2, num_train: 64, num_test: 4}",
            "num_generations=4", "per_device_train_batch_size=8", f"gradient_accumulation_steps={2 // processes}",
            "max_completion_length=8", "learning_rate=1e-2", "lr_scheduler_type=constant", "max_steps=4", "save_steps=2", "logging_steps=1", "eval_on_start=false", "eval_on_end=false",
            "use_vllm=true", "vllm_mode=server", f"vllm_server_base_url={url}", "use_cpu=true", f"output_dir={out}"]


def run(args: list[str], processes: int) -> None:
    out = launch_ranks(["-m", "rlvr.cli", "train", *args], processes, timeout=300, env={"OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-5000:]


def weights(path: Path) -> dict:
    from safetensors.torch import load_file

    return load_file(str(path / "model.safetensors"))


@pytest.mark.parametrize("fsdp", [False, True], ids=["two processes", "two processes, fsdp"])
def test_two_processes_free_running_train_to_the_weights_of_one_on_policy_and_resume_exactly(server, tiny_model_dir, tmp_path, fsdp):
    engine, url = server
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    run(settings(tiny_model_dir, plugin, url, tmp_path / "one", 1), 1)  # on-policy, one process
    loads_before = len(engine.loads)
    free = ["max_staleness=2", "async_mode=free"] + (["fsdp=true"] if fsdp else [])
    args = settings(tiny_model_dir, plugin, url, tmp_path / "two", 2) + free
    run(args, 2)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    start = {k: v for k, v in engine.start.items() if k in one}
    assert max((one[k] - start[k]).abs().max().item() for k in one) > 1e-3  # training moved the weights
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert gap < 1e-5, gap
    m1, m2 = metrics_rows(tmp_path / "one"), metrics_rows(tmp_path / "two")
    assert [m["reward"] for m in m2] == [m["reward"] for m in m1]  # the same groups, in the same order
    assert [m["grad_norm"] for m in m2] == pytest.approx([m["grad_norm"] for m in m1], rel=1e-4)
    assert all(m["sampling/staleness_max"] <= 2 and m["sampling/stale_dropped_groups"] == 0 for m in m2)
    # the server was sent the starting weights, then the weights after each of the 4 optimizer steps
    loads = engine.loads[loads_before:]
    assert [v for v, _ in loads] == [1, 2, 3, 4, 5], loads
    moved = [m for _, m in loads]
    assert moved[0] == 0 and moved == sorted(moved) and moved[1] > 0, loads
    # stopped after checkpoint-2 (rank 0's queued generations and each rank's share in it), resumed: the same run
    finished = weights(tmp_path / "two")
    (tmp_path / "two" / "model.safetensors").unlink()
    shutil.rmtree(tmp_path / "two" / "checkpoint-4")
    run(args + ["resume=true"], 2)
    resumed = weights(tmp_path / "two")
    assert max((resumed[k] - finished[k]).abs().max().item() for k in finished) < 1e-6


def test_two_processes_with_partial_rollouts_train_to_the_weights_of_one(server, tiny_model_dir, tmp_path):
    """partial_rollout_tokens=3 (completions of up to 24 tokens, continued on the server from their tokens so far):
    rank 0's producer carries the unfinished groups from round to round and shares each generation it takes.
    With max_staleness=4 no carried group can grow too old in 4 steps, so which groups make each generation
    depends on their lengths alone, and two processes train to the weights of one."""
    engine, url = server
    plugin = tmp_path / "reward.py"
    plugin.write_text(REWARD)
    partial = ["max_staleness=4", "async_mode=free", "partial_rollout_tokens=3", "max_completion_length=24",
               "stop_strings=[a,e,o,s]"]  # groups whose longest completions differ
    run(settings(tiny_model_dir, plugin, url, tmp_path / "one", 1) + partial, 1)
    run(settings(tiny_model_dir, plugin, url, tmp_path / "two", 2) + partial, 2)
    one, two = weights(tmp_path / "one"), weights(tmp_path / "two")
    gap = max((one[k] - two[k]).abs().max().item() for k in one)
    assert gap < 1e-5, gap
    m1, m2 = metrics_rows(tmp_path / "one"), metrics_rows(tmp_path / "two")
    assert [m["reward"] for m in m2] == [m["reward"] for m in m1]
    assert [m["sampling/rounds"] for m in m2] == [m["sampling/rounds"] for m in m1] and max(m["sampling/rounds"] for m in m2) >= 1
    assert sum(m["sampling/carried_groups"] for m in m2) >= 1  # some groups went on into a later generation
