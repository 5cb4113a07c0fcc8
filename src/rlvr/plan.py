"""`rlvr plan`: how much memory a run will need, before it starts.

Sizes come from the model's config: hidden d, MLP width I, layers L, query heads H and
key/value heads K of head_dim D, vocabulary V.  Parameters

    P = L (d H D + 2 d K D + H D d + 3 d I + 2 d) + V d + d  (+ V d for an untied output layer)

w = bytes of a weight (4 for dtype float32, 2 for bfloat16); s = bytes in sampling
(2 with bf16=true, else w); a = bytes of an activation (2 under bf16 autocast, else 4).
Trainable parameters T = P, or with LoRA r (in + out) summed over every adapted linear
(q, k, v, o, gate, up, down by default), kept in fp32 by peft.  The rows:

    policy             P w  (+ 4 T for a LoRA adapter)
    reference          P w when beta > 0 and the whole model trains; 0 with LoRA (the
                       adapter disabled) or beta = 0
    gradients          T x bytes of a trainable weight
    optimizer          AdamW: 2 T x bytes of a trainable weight (exp_avg, exp_avg_sq)
    rollout weights    the sampler's packed copy of every linear layer and the output
                       layer, (P - V d - (2L + 1) d) s  [+ V d if tied]
    KV cache           2 L rows K D (Lp + Lc) s, rows = completions decoded together:
                       G x min(prompts per step, 64 // G)
    rollout logits     2 rows V 4  (logits and probabilities of one decode step)
    activations        per micro-batch of B completions, N = B Lc + ceil(B / G) Lp tokens
                       (each prompt once per group); per layer and token the tensors the
                       backward keeps: norm inputs and outputs 4d, q k v 2(HD + 2KD) with
                       RoPE, attention output HD, MLP gate up silu product 4I:
                       e = 4d + 3HD + 3KD + 4I elements, so L N e a, plus attention
                       probabilities L H (B Lc (Lp + Lc) + ceil(B/G) Lp^2) x 4
    ...checkpointed    L N d 4 (layer inputs) + one layer's activations, recomputed in the
                       backward pass: what gradient_checkpointing=true leaves (both paths)
    logits chunk       2 x 512 x V x 4 (the chunked log-softmax's two buffers)
    bf16 casts         with bf16=true and fp32 weights: the bf16 copy of each weight
                       autocast keeps during a forward, P x 2
    sampler copy       with max_staleness=1 and the in-process sampler: the weights it
                       samples from while the policy trains, P w
    teacher            rlvr distill (`rlvr plan method=distill teacher=...`): the teacher's own
                       parameters (from its config) x w, frozen

    total = policy + reference + teacher + gradients + optimizer + rollout weights + sampler copy
            + max(KV cache + rollout logits, activations (checkpointed or not) + logits chunk + bf16 casts)

    (with max_staleness=1 and the in-process sampler, rollout and update overlap in time:
    the sum of the two instead of the max)

With use_vllm or rollout_workers the one-process table (`on_trainer`) counts no rollout
weights, KV cache, rollout logits or sampler copy: the sampling happens elsewhere.

Not counted: the Python / torch / transformers process itself (about 0.5-0.7 GB of RSS
on CPU), allocator slack and fragmentation, the reward workers.  benchmarks/memory.py
compares this total with measured peaks.

Layouts.  With gpus=N or gpu_memory_gb=M (settings of the plan only, not of a run: N training
processes of one GPU each, torchrun's world size; M one GPU's memory in GiB, as nvidia-smi's
MiB / 1024: H200 140, H100 80, A100 40 or 80, L40S 45) the plan is per GPU of each node, for
what rlvr does with fsdp, vLLM and rollout workers.  On one training GPU:

    policy, gradients, optimizer   the rows above / N with fsdp=true (FSDP2 shards them)
    gathered to sample with fsdp and the in-process sampler: the policy row whole plus the rollout
                       weights, gathered from the shards only while it samples (fsdp.GatheredCopy),
                       so in the rollout phase, not resident; with max_staleness=1 the sampler copy
                       (resident) is the only whole copy; with use_vllm the weights leave a tensor
                       at a time (the largest, the embedding, V d w, is not counted)
    reference          as above, divided by N with fsdp: sharded like the policy (with LoRA the
                       policy with its adapter disabled: 0)
    rollout weights, KV cache, rollout logits, sampler copy
                       as above with ceil(prompts per step / N) prompts per process; 0 with
                       use_vllm or rollout_workers (the sampling happens elsewhere)
    FSDP gathered      with fsdp, in the update: the root module's R = P - L p parameters
                       (embeddings, final norm, output layer), which FSDP2 keeps gathered from
                       forward to backward, and two decoder layers of p parameters (the one
                       running, the next prefetched): (R + 2p) w; with full fine-tuning also
                       their whole gradients before the reduce-scatter, (R + p) w
    vLLM, colocated    use_vllm, vllm_mode=colocate: vLLM's share of the GPU, u M with
                       u = vllm_gpu_memory_utilization (its weights + vllm_kv_cache_gb if set)
    total              as above; vLLM is resident, gathered to sample is in the rollout phase and
                       FSDP gathered in the update

One GPU of a vLLM engine over t = vllm_tensor_parallel_size GPUs (the rollout node's with
vllm_mode=server; the colocated share above):

    vLLM weights       P s / t
    KV cache           u M - P s / t, or vllm_kv_cache_gb; below zero the weights do not fit
    KV tokens          KV cache / (2 L ceil(K / t) D s): each GPU holds its share of the key /
                       value heads of every token; full-length completions KV tokens / (Lp + Lc)

vLLM takes its activations, CUDA graphs, the CUDA context and, with LoRA, its adapter slot out
of the KV cache, so the KV tokens are an upper bound.  Several servers (a list of hosts) are
each such a node.  A Ray rollout worker (rollout_workers=W) with use_vllm is such an engine on
t GPUs of its own; without, it runs on the CPU and holds in RAM the policy row (P w, + 4 T with
LoRA) and the in-process sampler's rows for ceil(prompts per step / W) prompts.
"""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path

from rlvr.errors import ConfigError

SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
LORA_ALL = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # lora_target_modules=[all-linear]
LORA_DEFAULT = ("q_proj", "v_proj")  # lora_target_modules unset: peft's choice for Llama, as TRL


def lora_targets(cfg) -> tuple:
    """The Llama linear layers the run's LoRA adapts."""
    targets = (cfg.lora_config or {}).get("target_modules") if cfg.lora_config else cfg.lora_target_modules
    if targets in ("all-linear", ["all-linear"], ("all-linear",)):
        return LORA_ALL
    return tuple([targets] if isinstance(targets, str) else targets) if targets else LORA_DEFAULT
CHUNK = 512  # logprobs.DEFAULT_CHUNK
SAMPLER_ROWS = 64  # the in-process sampler's max_batch_size
GIB = 2**30
LAYOUT_KEYS = ("gpus", "gpu_memory_gb")  # plan-only settings: where the run's processes sit


@dataclass(frozen=True)
class ModelSize:
    hidden_size: int
    intermediate_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    vocab_size: int
    tie_word_embeddings: bool
    teacher_params: int = 0  # rlvr distill: the parameters of the teacher the run holds beside the model

    @classmethod
    def from_config(cls, c: dict) -> "ModelSize":
        heads = c["num_attention_heads"]
        return cls(c["hidden_size"], c["intermediate_size"], c["num_hidden_layers"], heads,
                   c.get("num_key_value_heads") or heads, c.get("head_dim") or c["hidden_size"] // heads,
                   c["vocab_size"], bool(c.get("tie_word_embeddings", False)))

    def linear_shapes(self) -> dict[str, tuple[int, int]]:
        """(in, out) of each linear layer of one block."""
        d, hd, kd, i = self.hidden_size, self.num_attention_heads * self.head_dim, self.num_key_value_heads * self.head_dim, self.intermediate_size
        return {"q_proj": (d, hd), "k_proj": (d, kd), "v_proj": (d, kd), "o_proj": (hd, d),
                "gate_proj": (d, i), "up_proj": (d, i), "down_proj": (i, d)}

    @property
    def layer_params(self) -> int:
        """One decoder layer: its linear layers and two norms."""
        return sum(a * b for a, b in self.linear_shapes().values()) + 2 * self.hidden_size

    @property
    def params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        return self.num_hidden_layers * self.layer_params + v * d + d + (0 if self.tie_word_embeddings else v * d)

    def lora_params(self, r: int, targets) -> int:
        shapes = self.linear_shapes()
        unknown = [t for t in targets if t not in shapes]
        if unknown:
            raise ValueError(f"plan knows the Llama linear layers {sorted(shapes)}; cannot size {unknown}")
        return self.num_hidden_layers * sum(r * sum(shapes[t]) for t in targets)


def read_model_config(name: str) -> dict:
    """config.json of "default", a local directory (a run dir too) or a cached hub id."""
    from rlvr.models import resolve_model_path

    path = Path(resolve_model_path(name))
    if (path / "adapter_config.json").is_file():  # a LoRA run: size its base model
        path = Path(json.loads((path / "adapter_config.json").read_text())["base_model_name_or_path"])
    if (path / "config.json").is_file():
        return json.loads((path / "config.json").read_text())
    from transformers import AutoConfig

    try:
        return AutoConfig.from_pretrained(name, local_files_only=True).to_dict()
    except OSError:
        raise FileNotFoundError(
            f"no config.json for model {name!r}: not a local directory and not in the Hugging Face cache; "
            "download it once, or give the sizes (hidden_size=... intermediate_size=... num_hidden_layers=... "
            "num_attention_heads=... vocab_size=...)") from None


def estimate(size: ModelSize, cfg, sampling_prompts: int | None = None) -> dict[str, float]:
    """Bytes per row of the table (see the module docstring), and the total.  `sampling_prompts`:
    the prompts the in-process sampler decodes (default all of a step's)."""
    G, B = cfg.num_generations, cfg.per_device_train_batch_size
    lp, lc = cfg.max_prompt_length or 512, cfg.max_completion_length
    L, d, H, K, D, I, V = (size.num_hidden_layers, size.hidden_size, size.num_attention_heads, size.num_key_value_heads,
                           size.head_dim, size.intermediate_size, size.vocab_size)
    P = size.params
    w, s = weight_bytes(cfg), sampling_bytes(cfg)
    a = 2 if cfg.bf16 else 4
    if cfg.use_peft:
        T, tw = size.lora_params(cfg.lora_r, lora_targets(cfg)), 4
    else:
        T, tw = P, w
    rows = G * min(sampling_prompts or cfg.prompts_per_step, max(1, SAMPLER_ROWS // G))
    overlap = cfg.max_staleness > 0 and not samples_elsewhere(cfg)  # sampling in this process, during the update
    prompts = math.ceil(B / G)
    tokens = B * lc + prompts * lp
    per_token = 4 * d + 3 * H * D + 3 * K * D + 4 * I
    attention = L * H * (B * lc * (lp + lc) + prompts * lp * lp) * 4
    activations = L * tokens * per_token * a + attention
    one_layer = activations / L
    out = {
        "policy": P * w + (T * 4 if cfg.use_peft else 0),
        "reference": P * w if cfg.beta > 0 and not cfg.use_peft else 0,
        "gradients": T * tw,
        "optimizer": 2 * T * tw,
        "rollout weights": (P - V * d - (2 * L + 1) * d + (V * d if size.tie_word_embeddings else 0)) * s,
        "KV cache": 2 * L * rows * K * D * (lp + lc) * s,
        "rollout logits": 2 * rows * V * 4,
        "activations": activations,
        "activations, checkpointed": L * tokens * d * 4 + one_layer,
        "logits chunk": 2 * min(CHUNK, B * lc) * V * 4,
        "bf16 casts": P * 2 if cfg.bf16 and w == 4 else 0,
        "sampler copy": P * w if overlap else 0,
        "teacher": size.teacher_params * w,  # frozen, in the run's dtype, on the training device
    }
    out["total"] = _total(out, cfg.gradient_checkpointing, overlap)
    out["trainable parameters"], out["parameters"] = T, P
    return out


def weight_bytes(cfg) -> int:
    return 2 if cfg.dtype == "bfloat16" else 4


def sampling_bytes(cfg) -> int:
    """Bytes of a weight or a cached key / value when sampling (in-process and vLLM alike)."""
    return 2 if cfg.bf16 else weight_bytes(cfg)


RESIDENT = ("policy", "reference", "teacher", "gradients", "optimizer", "rollout weights", "sampler copy",
            "vLLM, colocated")

IN_PROCESS_SAMPLER = ("rollout weights", "KV cache", "rollout logits", "sampler copy")


def samples_elsewhere(cfg) -> bool:
    """No sampler in the training process: vLLM (a server, or its own share colocated) or rollout workers."""
    return bool(cfg.use_vllm or cfg.rollout_workers > 0)


def on_trainer(size: ModelSize, cfg) -> dict[str, float]:
    """The one-process table: `estimate`, without the in-process sampler's rows when the sampling
    happens elsewhere (use_vllm: a server, or vLLM's own share colocated; rollout_workers)."""
    out = estimate(size, cfg)
    if samples_elsewhere(cfg):
        out.update({k: 0 for k in IN_PROCESS_SAMPLER})
        out["total"] = _total(out, cfg.gradient_checkpointing, overlap=False)
    return out


def _total(rows: dict, checkpointed: bool, overlap: bool) -> float:
    """What stays all along, plus the larger of the rollout and the update phase (both when they overlap)."""
    act = rows["activations, checkpointed"] if checkpointed else rows["activations"]
    resident = sum(rows.get(k, 0) for k in RESIDENT)
    rollout = rows["KV cache"] + rows["rollout logits"] + rows.get("gathered to sample", 0)
    update = act + rows["logits chunk"] + rows["bf16 casts"] + rows.get("FSDP gathered", 0)
    return resident + (rollout + update if overlap else max(rollout, update))


def _header(size: ModelSize, cfg) -> list[str]:
    how = f"LoRA r={cfg.lora_r}" if cfg.use_peft else "full fine-tuning"
    trainable = size.lora_params(cfg.lora_r, lora_targets(cfg)) if cfg.use_peft else size.params
    return [f"model: {size.params / 1e6:.1f}M parameters ({size.num_hidden_layers} layers, hidden {size.hidden_size}, "
            f"vocab {size.vocab_size}); {how}, {trainable / 1e6:.2f}M trainable",
            f"G={cfg.num_generations}, {cfg.prompts_per_step} prompts/step, micro-batch {cfg.per_device_train_batch_size}, "
            f"prompt <= {cfg.max_prompt_length or '512 (assumed: max_prompt_length is unset)'}, completion <= {cfg.max_completion_length}, beta={cfg.beta}, "
            f"dtype={cfg.dtype}, bf16={cfg.bf16}, AdamW"]


def format_plan(size: ModelSize, cfg, est: dict[str, float]) -> str:
    gib = GIB
    lines = [*_header(size, cfg), ""]
    for key in ("policy", "reference", "teacher", "gradients", "optimizer", "rollout weights", "KV cache", "rollout logits",
                "activations", "activations, checkpointed", "logits chunk", "bf16 casts", "sampler copy", "total"):
        if key == "teacher" and not est[key]:
            continue
        counted = "activations, checkpointed" if cfg.gradient_checkpointing else "activations"
        note = "  (in the total)" if key == counted else ""
        lines.append(f"  {key:<26} {est[key] / gib:9.3f} GiB{note}")
    lines.append("\n(estimates; add about 0.5-0.7 GiB for the Python process itself)")
    return "\n".join(lines)


@dataclass(frozen=True)
class Layout:
    """Where a run's processes sit, for the plan only: `gpus` training processes of one GPU each
    (torchrun's world size), each GPU with `gpu_memory_gb` GiB (None: not given, no fit check)."""
    gpus: int = 1
    gpu_memory_gb: float | None = None

    def __post_init__(self):
        if isinstance(self.gpus, bool) or not isinstance(self.gpus, int) or self.gpus < 1:
            raise ConfigError(f"gpus must be a whole number >= 1 (training processes of one GPU each, "
                              f"torchrun's world size); got {self.gpus!r}")
        m = self.gpu_memory_gb
        if m is not None and (isinstance(m, bool) or not isinstance(m, (int, float)) or not 0 < m < math.inf):
            raise ConfigError(f"gpu_memory_gb must be one GPU's memory in GiB, a number > 0 (e.g. 80 for an H100, "
                              f"140 for an H200); got {m!r}")

    @property
    def gpu_bytes(self) -> float | None:
        return None if self.gpu_memory_gb is None else self.gpu_memory_gb * GIB


def trainer_gpu(size: ModelSize, cfg, layout: Layout) -> dict[str, float]:
    """Bytes per row on one training GPU of the layout (module docstring, Layouts), and the total."""
    cfg = cfg.for_processes(layout.gpus)
    base = estimate(size, cfg, sampling_prompts=math.ceil(cfg.prompts_per_step / layout.gpus))
    shards = layout.gpus if cfg.fsdp else 1
    elsewhere = samples_elsewhere(cfg)
    out = {k: base[k] / shards for k in ("policy", "gradients", "optimizer")}
    out["reference"] = base["reference"] / shards  # with fsdp sharded like the policy (fsdp.shard)
    out["teacher"] = base["teacher"]  # whole on each training GPU (rlvr distill refuses fsdp)
    for k in IN_PROCESS_SAMPLER:
        out[k] = 0 if elsewhere else base[k]
    for k in ("activations", "activations, checkpointed", "logits chunk", "bf16 casts"):
        out[k] = base[k]
    out["FSDP gathered"] = fsdp_gathered(size, cfg) if cfg.fsdp else 0
    out["gathered to sample"] = 0
    if cfg.fsdp and not elsewhere and not cfg.max_staleness:  # whole only while sampling (fsdp.GatheredCopy)
        out["gathered to sample"] = base["policy"] + out["rollout weights"]  # with LoRA a peft model, its adapter in fp32
        out["rollout weights"] = 0
    colocated = cfg.use_vllm and cfg.vllm_mode == "colocate" and not cfg.rollout_workers  # else in the workers
    out["vLLM, colocated"] = vllm_gpu(size, cfg, layout)["total"] if colocated else 0
    out["total"] = _total(out, cfg.gradient_checkpointing, overlap=out["sampler copy"] > 0)
    return out


def fsdp_gathered(size: ModelSize, cfg) -> int:
    """What FSDP2 holds whole during the update: the root module and two decoder layers, and with
    full fine-tuning their gradients before the reduce-scatter."""
    p, w = size.layer_params, weight_bytes(cfg)
    root = size.params - size.num_hidden_layers * p
    return (root + 2 * p) * w + (0 if cfg.use_peft else (root + p) * w)


def vllm_gpu(size: ModelSize, cfg, layout: Layout) -> dict[str, float]:
    """One GPU of a vLLM engine over vllm_tensor_parallel_size GPUs: its weights, its KV cache and
    the tokens that holds (module docstring, Layouts)."""
    t, s = cfg.vllm_tensor_parallel_size, sampling_bytes(cfg)
    weights = size.params * s / t
    if cfg.vllm_kv_cache_gb:
        total = weights + cfg.vllm_kv_cache_gb * GIB
    elif layout.gpu_bytes is None:
        raise ConfigError("use_vllm=true: vLLM takes vllm_gpu_memory_utilization of a GPU's memory; give the plan "
                          "gpu_memory_gb=... (e.g. 80 for an H100, 140 for an H200), or set vllm_kv_cache_gb")
    else:
        total = cfg.vllm_gpu_memory_utilization * layout.gpu_bytes
    per_token = 2 * size.num_hidden_layers * math.ceil(size.num_key_value_heads / t) * size.head_dim * s
    tokens = max(0, math.floor((total - weights) / per_token))
    length = (cfg.max_prompt_length or 512) + cfg.max_completion_length
    return {"vLLM weights": weights, "KV cache": total - weights, "total": total, "KV bytes per token": per_token,
            "KV tokens": tokens, "full-length completions": tokens // length}


def rollout_worker(size: ModelSize, cfg) -> dict[str, float]:
    """One Ray rollout worker without vLLM, in RAM: its copy of the policy and the in-process sampler."""
    base = estimate(size, cfg, sampling_prompts=math.ceil(cfg.prompts_per_step / cfg.rollout_workers))
    out = {"policy copy": base["policy"], **{k: base[k] for k in ("rollout weights", "KV cache", "rollout logits")}}
    out["total"] = sum(out.values())
    return out


def layout_estimate(size: ModelSize, cfg, layout: Layout) -> dict[str, dict]:
    """Per GPU of each node: "trainer"; "vllm" with use_vllm (a GPU of the server, of a rollout
    worker, or the colocated share); "worker" with rollout_workers and no vLLM (per worker, in RAM)."""
    cfg = cfg.for_processes(layout.gpus)
    out = {"trainer": trainer_gpu(size, cfg, layout)}
    if cfg.use_vllm:
        out["vllm"] = vllm_gpu(size, cfg, layout)
    elif cfg.rollout_workers:
        out["worker"] = rollout_worker(size, cfg)
    return out


def refusals(cfg, layout: Layout) -> list[str]:
    """The launch rules of settings.check_runnable that this layout breaks: `rlvr train` would refuse it."""
    n, out, cfg = layout.gpus, [], cfg.for_processes(layout.gpus)
    if cfg.fsdp and n == 1:
        out.append("fsdp=true shards across several processes (gpus > 1)")
    if n > 1 and cfg.rollout_workers:
        out.append("rollout_workers with several training processes")
    if cfg.prompts_per_step % n:
        out.append(f"each GPU's {cfg.completions_per_generation / n:g} completions of a generation are not whole groups "
                   f"of num_generations={cfg.num_generations}")
    return out


TRAINER_ROWS = ("policy", "gathered to sample", "reference", "teacher", "gradients", "optimizer", "rollout weights", "KV cache",
                "rollout logits", "sampler copy", "vLLM, colocated", "activations", "activations, checkpointed",
                "logits chunk", "bf16 casts", "FSDP gathered")


def _row(key: str, value: float, note: str | None = None) -> str:
    return f"  {key:<26} {value / GIB:9.3f} GiB" + (f"  ({note})" if note else "")


def _fit(total: float, layout: Layout) -> str | None:
    if layout.gpu_bytes is None:
        return None
    left = (layout.gpu_bytes - total) / GIB
    verdict = f"fits, {left:.1f} GiB free" if left >= 0 else f"does NOT fit, {-left:.1f} GiB over"
    return f"of {layout.gpu_memory_gb:g} GiB: {verdict}"


def _trainer_notes(cfg, layout: Layout) -> dict[str, str]:
    notes = {"activations, checkpointed" if cfg.gradient_checkpointing else "activations": "in the total"}
    if cfg.fsdp:
        notes.update({k: f"1/{layout.gpus}: an FSDP2 shard" for k in ("policy", "gradients", "optimizer")})
        notes["gathered to sample"] = "whole weights + rollout weights, only while sampling (fsdp.GatheredCopy)"
        notes["FSDP gathered"] = "in the update: the root module and two layers, whole"
    if cfg.beta <= 0:
        notes["reference"] = "beta=0: none"
    elif cfg.use_peft:
        notes["reference"] = "LoRA: the policy with its adapter disabled"
    elif cfg.fsdp:
        notes["reference"] = f"1/{layout.gpus}: sharded like the policy (fsdp.shard)"
    notes["vLLM, colocated"] = "vLLM's share, below"
    notes["teacher"] = "rlvr distill: the teacher's weights, frozen, whole on each GPU"
    return notes


def _vllm_lines(size: ModelSize, cfg, layout: Layout, v: dict) -> list[str]:
    t = cfg.vllm_tensor_parallel_size
    budget = (f"its weights + vllm_kv_cache_gb={cfg.vllm_kv_cache_gb:g}" if cfg.vllm_kv_cache_gb else
              f"vllm_gpu_memory_utilization={cfg.vllm_gpu_memory_utilization:g} x {layout.gpu_memory_gb:g} GiB")
    lines = [_row("vLLM weights", v["vLLM weights"], f"1/{t} of the model" if t > 1 else None),
             _row("KV cache", v["KV cache"]), _row("total", v["total"], budget)]
    if size.num_attention_heads % t:
        lines.append(f"  vLLM refuses vllm_tensor_parallel_size={t}: the {size.num_attention_heads} attention heads "
                     "do not divide among its GPUs")
    if v["KV cache"] <= 0:
        return lines + ["  the weights do NOT fit: raise vllm_gpu_memory_utilization, shard over more GPUs "
                        "(vllm_tensor_parallel_size) or take a GPU with more memory"]
    heads, length = math.ceil(size.num_key_value_heads / t), (cfg.max_prompt_length or 512) + cfg.max_completion_length
    lines += [f"  KV cache: {v['KV tokens']:,} tokens of {v['KV bytes per token'] / 1024:g} KiB "
              f"(2 x {size.num_hidden_layers} layers x {heads} key/value heads x {size.head_dim} x {sampling_bytes(cfg)} bytes)",
              f"  = {v['full-length completions']:,} full-length completions ({length} tokens) at once; "
              f"a step samples {cfg.num_generations * cfg.prompts_per_step}"]
    if v["full-length completions"] == 0:
        lines.append("  less than one full-length completion: vLLM refuses to start with this context length")
    return lines


def format_layout(size: ModelSize, cfg, layout: Layout, est: dict[str, dict]) -> str:
    n, trainer, notes = layout.gpus, est["trainer"], _trainer_notes(cfg, layout)
    lines = [*_header(size, cfg), "", f"trainer node, per training GPU ({n} GPU{'s' * (n > 1)}{', fsdp' * cfg.fsdp}):"]
    lines += [_row(k, trainer[k], notes.get(k)) for k in TRAINER_ROWS
              if trainer[k] or k in ("policy", "reference", "gradients", "optimizer")]
    lines.append(_row("total", trainer["total"], _fit(trainer["total"], layout)))
    t, w = cfg.vllm_tensor_parallel_size, cfg.rollout_workers
    gpus, workers = f"{t} GPU{'s' * (t > 1)}, vllm_tensor_parallel_size={t}", f"{w} worker{'s' * (w > 1)}"
    if w:
        lines.append("  (no sampler on this GPU: the Ray rollout workers sample)")
    if cfg.use_vllm and w:
        lines += ["", f"rollout workers (Ray, vLLM in each), per GPU ({workers} of {gpus}):",
                  *_vllm_lines(size, cfg, layout, est["vllm"])]
    elif cfg.use_vllm and cfg.vllm_mode == "colocate":
        lines += ["", "vLLM colocated on each training GPU, its share:", *_vllm_lines(size, cfg, layout, est["vllm"])]
    elif cfg.use_vllm:
        lines += ["  (no sampler on this GPU: vLLM samples on the rollout node)", "",
                  f"rollout node: vLLM server (vllm_mode=server), per GPU ({gpus}):",
                  *_vllm_lines(size, cfg, layout, est["vllm"])]
    elif w:
        lines += ["", f"rollout workers (Ray, on the CPU: RAM), per worker ({workers}):",
                  *[_row(k, v) for k, v in est["worker"].items()]]
    if problems := refusals(cfg, layout):
        lines.append("\nnote: rlvr train refuses this today (planned all the same): " + "; ".join(problems))
    lines.append("\n(estimates; add about 0.5-0.7 GiB for the Python process itself)")
    return "\n".join(lines)


def plan(args: list[str]) -> tuple[ModelSize, object, Layout | None]:
    """`rlvr plan [CONFIG_FILE] [key=value ...]`: run settings as for train, plus model sizes
    (hidden_size=..., num_hidden_layers=..., ...) that replace or stand in for the model's config,
    plus the layout (gpus=N, gpu_memory_gb=M; None when neither is given: one process)."""
    from rlvr.config import parse_overrides
    from rlvr.settings import resolve_config

    own = SIZE_KEYS + LAYOUT_KEYS
    given = parse_overrides([x for x in args if "=" in x and x.split("=", 1)[0] in own])
    placed = {k: v for k, v in given.items() if k in LAYOUT_KEYS}
    layout = Layout(**placed) if placed else None
    # per_device_train_batch_size is per training process, as in TRL: the settings are checked for the layout's
    processes = [f"num_processes={layout.gpus}"] if layout is not None and layout.gpus > 1 else []
    cfg = resolve_config([x for x in args if not ("=" in x and x.split("=", 1)[0] in own)] + processes)
    sizes = {k: v for k, v in given.items() if k in SIZE_KEYS}
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    config = sizes if all(k in sizes for k in needed) else {**read_model_config(cfg.model), **sizes}
    size = ModelSize.from_config(config)
    if cfg.method == "distill" and cfg.teacher_model_name_or_path:  # its own size, from its own config
        size = dataclasses.replace(size, teacher_params=ModelSize.from_config(read_model_config(cfg.teacher_model_name_or_path)).params)
    return size, cfg, layout


def render(size: ModelSize, cfg, layout: Layout | None) -> str:
    """The one-process table, or with a layout the per-GPU table of each node."""
    if layout is None:
        return format_plan(size, cfg, on_trainer(size, cfg))
    return format_layout(size, cfg, layout, layout_estimate(size, cfg, layout))
