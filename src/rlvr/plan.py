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

    total = policy + reference + gradients + optimizer + rollout weights + sampler copy
            + max(KV cache + rollout logits, activations (checkpointed or not) + logits chunk + bf16 casts)
    (with max_staleness=1 and the in-process sampler, rollout and update overlap in time:
    the sum of the two instead of the max)

Not counted: the Python / torch / transformers process itself (about 0.5-0.7 GB of RSS
on CPU), allocator slack and fragmentation, the reward workers.  benchmarks/memory.py
compares this total with measured peaks.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

SIZE_KEYS = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
             "num_key_value_heads", "head_dim", "vocab_size", "tie_word_embeddings")
LORA_DEFAULT = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
CHUNK = 512  # logprobs.DEFAULT_CHUNK
SAMPLER_ROWS = 64  # the in-process sampler's max_batch_size


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
    def params(self) -> int:
        d, v = self.hidden_size, self.vocab_size
        per_layer = sum(a * b for a, b in self.linear_shapes().values()) + 2 * d
        return self.num_hidden_layers * per_layer + v * d + d + (0 if self.tie_word_embeddings else v * d)

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


def estimate(size: ModelSize, cfg) -> dict[str, float]:
    """Bytes per row of the table (see the module docstring), and the total."""
    G, B = cfg.num_generations, cfg.per_device_train_batch_size
    lp, lc = cfg.max_prompt_length or 512, cfg.max_completion_length
    L, d, H, K, D, I, V = (size.num_hidden_layers, size.hidden_size, size.num_attention_heads, size.num_key_value_heads,
                           size.head_dim, size.intermediate_size, size.vocab_size)
    P = size.params
    w = 2 if cfg.dtype == "bfloat16" else 4
    s = 2 if cfg.bf16 else w
    a = 2 if cfg.bf16 else 4
    if cfg.use_peft:
        T, tw = size.lora_params(cfg.lora_r, cfg.lora_target_modules or LORA_DEFAULT), 4
    else:
        T, tw = P, w
    rows = G * min(cfg.prompts_per_step, max(1, SAMPLER_ROWS // G))
    overlap = cfg.max_staleness > 0 and not cfg.use_vllm and cfg.rollout_workers == 0  # sampling in this process, during the update
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
    }
    act = out["activations, checkpointed"] if cfg.gradient_checkpointing else out["activations"]
    resident = sum(out[k] for k in ("policy", "reference", "gradients", "optimizer", "rollout weights", "sampler copy"))
    rollout, update = out["KV cache"] + out["rollout logits"], act + out["logits chunk"] + out["bf16 casts"]
    out["total"] = resident + (rollout + update if overlap else max(rollout, update))
    out["trainable parameters"], out["parameters"] = T, P
    return out


def format_plan(size: ModelSize, cfg, est: dict[str, float]) -> str:
    gib = 2**30
    how = f"LoRA r={cfg.lora_r}" if cfg.use_peft else "full fine-tuning"
    lines = [f"model: {est['parameters'] / 1e6:.1f}M parameters ({size.num_hidden_layers} layers, hidden {size.hidden_size}, "
             f"vocab {size.vocab_size}); {how}, {est['trainable parameters'] / 1e6:.2f}M trainable",
             f"G={cfg.num_generations}, {cfg.prompts_per_step} prompts/step, micro-batch {cfg.per_device_train_batch_size}, "
             f"prompt <= {cfg.max_prompt_length}, completion <= {cfg.max_completion_length}, beta={cfg.beta}, "
             f"dtype={cfg.dtype}, bf16={cfg.bf16}, AdamW", ""]
    for key in ("policy", "reference", "gradients", "optimizer", "rollout weights", "KV cache", "rollout logits",
                "activations", "activations, checkpointed", "logits chunk", "bf16 casts", "sampler copy", "total"):
        counted = "activations, checkpointed" if cfg.gradient_checkpointing else "activations"
        note = "  (in the total)" if key == counted else ""
        lines.append(f"  {key:<26} {est[key] / gib:9.3f} GiB{note}")
    lines.append("\n(estimates; add about 0.5-0.7 GiB for the Python process itself)")
    return "\n".join(lines)


def plan(args: list[str]) -> tuple[ModelSize, object, dict]:
    """`rlvr plan [CONFIG_FILE] [key=value ...]`: run settings as for train, plus model sizes
    (hidden_size=..., num_hidden_layers=..., ...) that replace or stand in for the model's config."""
    from rlvr.config import parse_overrides
    from rlvr.settings import resolve_config

    sizes = parse_overrides([x for x in args if "=" in x and x.split("=", 1)[0] in SIZE_KEYS])
    cfg = resolve_config([x for x in args if not ("=" in x and x.split("=", 1)[0] in SIZE_KEYS)])
    needed = ("hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads", "vocab_size")
    config = sizes if all(k in sizes for k in needed) else {**read_model_config(cfg.model), **sizes}
    size = ModelSize.from_config(config)
    return size, cfg, estimate(size, cfg)
