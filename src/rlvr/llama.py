"""A compact forward pass for Llama-family models, over a Hugging Face model's own weights.

Why: a GRPO step runs the same model two ways, and the generic path pays for
work it does not need.  This module runs the weights of a LlamaForCausalLM (or
Mistral without a sliding window, Qwen2, Qwen3: the same block, Qwen3's with an
RMSNorm over each query and key head before RoPE) directly with torch ops, so that

* rollout decodes with a preallocated KV cache, each prompt prefilled once and
  its cache copied to its G completions, and rows that finish dropped; a multi-turn
  rollout's later turn runs only its new tokens on the cache kept from its turn before
  (`extend`, rollout/turns.py);
* the update packs tokens without padding: the linear layers (nearly all of the
  FLOPs) see only real tokens, each prompt is processed once per group rather
  than once per completion, and its keys and values are shared by the group's
  completions in attention, with gradients flowing back through them;
* the output layer is applied only where a completion token is predicted
  (see logprobs.py), never to prompt positions;
* with gradient checkpointing on (the model's own switch, model.gradient_checkpointing_enable(),
  which sets it on each decoder layer), a layer keeps only its input for the backward pass and
  runs again there (torch.utils.checkpoint, non-reentrant), as in the Hugging Face forward.

It reads the parameters of the Hugging Face modules (no copies), so an
optimizer step on the model is seen by the next call.  A model sharded with FSDP2 (fsdp.py) runs
here too: FSDP gathers a module's parameters in hooks on its call, so the update's computation runs
as the model's own call (`LlamaRunner.call`) and each decoder layer's as that layer's call
(`_call_as`): FSDP gathers the layer's parameters before it, frees them after it, and gathers them
again for its backward pass, at whose end it reduce-scatters their gradients.  The result equals the
Hugging Face forward up to floating-point reordering; tests check log-probs to
1e-4 and gradients to 1e-5 relative.  `supports(model)` says whether a model can
use this path, `fast_path_reason(model)` why not; others use the generic one.

Gemma 3 stays on the generic path: it is not a variant of this block but a second one.
Five layers in six attend through a sliding window (a windowed mask in prefill, in the
static decode cache and in the update's shared prompt keys), with their own RoPE base;
each layer has four norms of (1 + weight) rather than two, a GELU-tanh MLP, and
scores scaled by query_pre_attn_scalar; the embeddings are scaled by sqrt(hidden) in
the weights' dtype; the multimodal model nests the text model one level deeper.
Supporting it means a Gemma runner beside this one, with its own equality tests.
"""

from __future__ import annotations

import logging
import sys
from functools import partial

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from rlvr.lora import adapters_enabled, effective_weight, is_adapted, unplain, unwrap

log = logging.getLogger(__name__)
_REPORTED: set[str] = set()  # why models took the generic path, each said once per process

SUPPORTED = ("llama", "mistral", "qwen2", "qwen3")
WHY_NOT = {  # families users ask about, and what keeps each off this path (see the module docstring)
    kind: "sliding-window attention and Gemma's decoder block are not implemented on rlvr's fast path"
    for kind in ("gemma3", "gemma3_text", "gemma2")
}


def supports(model) -> bool:
    """True for a Llama-family model, also one with LoRA adapters (peft) on its attention and MLP
    layers; an adapter on the embeddings or the output layer needs the generic path."""
    return fast_path_reason(model) is None


def on_fast_path(model) -> bool:
    """supports(model), and the first time a reason keeps a model off this path, one line saying so."""
    reason = fast_path_reason(model)
    if reason is not None and reason not in _REPORTED:
        _REPORTED.add(reason)
        log.warning("%s; rollout and update use the model's own forward (slower)", reason)
    return reason is None


def fast_path_reason(model) -> str | None:
    """None when this runner can run `model`, else one line, starting with the model type, that says why not."""
    lora_option = unplain(model)
    model = unwrap(model)
    config = getattr(model, "config", None)
    kind = getattr(config, "model_type", None)
    if kind is None:
        return f"{type(model).__name__}: not a transformers model"
    if kind not in SUPPORTED:
        return f"{kind}: " + WHY_NOT.get(kind, f"rlvr's fast path covers {', '.join(SUPPORTED)} only")
    quantizer = getattr(model, "hf_quantizer", None)
    if quantizer is not None or getattr(model, "is_loaded_in_4bit", False) or getattr(model, "is_loaded_in_8bit", False):
        method = getattr(getattr(quantizer, "quantization_config", None), "quant_method", "bitsandbytes")
        return (f"{kind}: its weights are quantized ({getattr(method, 'value', method)}), unpacked only inside the "
                "quantized layers' own forward; rlvr's fast path reads plain weights")
    if lora_option:
        return f"{kind}: LoRA with {lora_option} runs in peft's own layers, not on rlvr's fast path"
    windowed = kind != "llama" and getattr(config, "sliding_window", None) and getattr(config, "use_sliding_window", True)
    if windowed or any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return f"{kind}: sliding-window attention is not implemented on rlvr's fast path"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"{kind}: the MLP's activation {config.hidden_act!r} is not implemented on rlvr's fast path (SiLU only)"
    inner = getattr(model, "model", None)
    if not all(hasattr(inner, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{kind}: {type(model).__name__} does not hold model.embed_tokens, layers, norm and rotary_emb"
    if is_adapted(inner.embed_tokens) or is_adapted(getattr(model, "lm_head", None)):
        return f"{kind}: a LoRA adapter on the embeddings or the output layer needs the model's own forward"
    return None


class LlamaRunner:
    def __init__(self, model):
        reason = fast_path_reason(model)
        if reason is not None:
            raise ValueError(f"{type(model).__name__} cannot run on rlvr's fast path: {reason}")
        self.root = model  # with fsdp the sharded module, whose call gathers the parameters outside the layers
        self.sharded = _is_sharded(model)
        model = unwrap(model)  # LoRA: the adapter layers are called in place of the plain linears
        cfg = model.config
        self.model = model
        self.inner = model.model
        self.heads = cfg.num_attention_heads
        self.kv_heads = getattr(cfg, "num_key_value_heads", None) or cfg.num_attention_heads
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        self.eps = cfg.rms_norm_eps
        self.scale = self.head_dim**-0.5
        self.qk_norm = hasattr(self.inner.layers[0].self_attn, "q_norm")  # Qwen3

    # --- pieces -------------------------------------------------------------------------

    def _norm(self, x, module_or_weight):
        weight = getattr(module_or_weight, "weight", module_or_weight)
        dtype = x.dtype
        x = x.float()
        x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return weight * x.to(dtype)

    def _rope(self, x_like, positions):
        """cos, sin [tokens, head_dim] for flat positions, from the model's own rotary module."""
        cos, sin = self.inner.rotary_emb(x_like, positions[None])
        return cos[0], sin[0]

    @staticmethod
    def _rotate(x, cos, sin):
        """x [tokens, heads, head_dim]; the Hugging Face rotate-half convention."""
        half = x.shape[-1] // 2
        rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
        return x * cos[:, None] + rotated * sin[:, None]

    def _qkv(self, h, attn, cos, sin):
        """Projections of flat tokens h [n, hidden] -> q [n, H, D], k, v [n, Hkv, D], RoPE applied."""
        n = h.shape[0]  # modules are called (not their .weight) so that LoRA adapters take part
        q = attn.q_proj(h).view(n, self.heads, self.head_dim)
        k = attn.k_proj(h).view(n, self.kv_heads, self.head_dim)
        v = attn.v_proj(h).view(n, self.kv_heads, self.head_dim)
        if self.qk_norm:  # an RMSNorm over each head's vector, before RoPE
            q, k = self._norm(q, attn.q_norm), self._norm(k, attn.k_norm)
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin), v

    @staticmethod
    def _mlp(h, mlp):
        return mlp.down_proj(F.silu(mlp.gate_proj(h)) * mlp.up_proj(h))

    def _attend(self, q, k, v, mask):
        """q [B, H, L, D], k/v [B, Hkv, S, D], mask [B, 1, L, S] bool (True = may attend).

        In bf16 the attention is written out (query heads grouped onto their
        key/value head, softmax in fp32): on CPU that is about twice as fast as
        SDPA's bf16 kernel, forward and backward; in fp32 SDPA is faster."""
        low = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") and q.device.type == "cpu" else q.dtype
        if low != torch.bfloat16:
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=self.scale, enable_gqa=self.kv_heads != self.heads)
        rows, heads, length, dim = q.shape
        group = heads // self.kv_heads
        q, k, v = q.to(low), k.to(low), v.to(low)
        scores = torch.matmul(q.reshape(rows, self.kv_heads, group * length, dim), k.transpose(-1, -2)).float() * self.scale
        scores = scores.view(rows, self.kv_heads, group, length, -1).masked_fill(~mask[:, :, None], float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(low).view(rows, self.kv_heads, group * length, -1)
        return torch.matmul(probs, v).view(rows, heads, length, dim)

    # --- training: grouped, padding-free ------------------------------------------------

    def completion_hidden(self, prompt_ids: list[list[int]], completion_ids: list[list[int]], group: list[int]):
        """Final hidden states that predict each completion token, flat: [sum of completion lengths, hidden].

        prompt_ids[g] is prompt g; completion i continues prompt group[i].  Row j
        of the result is the state from which completion token j (in order,
        completion after completion) is predicted: the last prompt token for a
        completion's first token, its previous token otherwise.  A sharded model (fsdp) runs this
        inside `call`, which gathers the embeddings and the final norm.
        """
        device = self.inner.embed_tokens.weight.device
        layout = _Layout(prompt_ids, completion_ids, group, device)
        x = self.inner.embed_tokens(layout.tokens)  # [n_prompt + n_completion, hidden], all real tokens
        cos, sin = self._rope(x, layout.positions)
        for layer in self.inner.layers:
            run = partial(self._layer, layer, layout)  # (x, cos, sin) -> x
            if getattr(layer, "gradient_checkpointing", False) and torch.is_grad_enabled():
                run = partial(checkpoint, run, use_reentrant=False)
            # sharded: the layer's own call, whose hooks gather its parameters once, around the checkpoint
            # (as transformers' layers do): the pre-backward hook gathers them again before the recomputation
            x = _call_as(layer, run, x, cos, sin) if self.sharded else run(x, cos, sin)
        x = self._norm(x, self.inner.norm)
        return x[layout.predictors]

    def call(self, fn):
        """fn(), which runs the model through this runner; with fsdp as the sharded model's own call, so
        that FSDP gathers the parameters outside the decoder layers (embeddings, final norm, output
        layer) around it and reduce-scatters their gradients after the backward pass."""
        return _call_as(self.root, fn) if self.sharded else fn()

    def _layer(self, layer, layout: "_Layout", x, cos, sin):
        """One decoder layer over the flat tokens x [n, hidden]."""
        attn = layer.self_attn
        q, k, v = self._qkv(self._norm(x, layer.input_layernorm), attn, cos, sin)
        x = x + attn.o_proj(layout.attention(q, k, v, self._attend))  # attention output [n, H * D]
        return x + self._mlp(self._norm(x, layer.post_attention_layernorm), layer.mlp)

    # --- rollout: prefill and decode with a static cache -----------------------------------

    @torch.no_grad()
    def prefill(self, prompt_ids: list[list[int]], n, max_new: int, dtype: torch.dtype):
        """Run every prompt once and lay its cache out for its n completions (n: one number for every
        prompt, or a list with one per prompt).

        `dtype` is the sampling precision (weights, matmuls and cache; norms and
        the residual stream stay fp32).  Returns (logits of the next token
        [P * n, vocab], DecodeState)."""
        device = self.inner.embed_tokens.weight.device
        rows = len(prompt_ids) * n if isinstance(n, int) else sum(n)
        n = n if isinstance(n, int) else torch.tensor(n, device=device)  # rows per prompt: one number, or one each
        weights = self._inference_weights(dtype, rows)
        lengths = [len(p) for p in prompt_ids]
        width = max(lengths)
        tokens = torch.tensor([t for p in prompt_ids for t in p], device=device)
        positions = torch.cat([torch.arange(length, device=device) for length in lengths])
        x = self.inner.embed_tokens(tokens).float()
        cos, sin = self._rope(x, positions)
        state = DecodeState(self, rows, width + max_new, dtype, device)
        index = _padded_index(lengths, width, device)  # where each flat token sits in [P, width]
        mask = _causal_padded_mask(lengths, width, device)
        for i, (ln1, qkv, qk_norm, o, ln2, gate_up, down) in enumerate(weights.layers):
            q, k, v = self._split_qkv(qkv(self._norm(x, ln1).to(dtype)), qk_norm, cos, sin)
            qp, kp, vp = (_to_padded(t, index, len(lengths), width) for t in (q, k, v))
            out = _from_padded(self._attend(qp, kp, vp, mask), index)
            x = x + o(out)
            x = x + self._fused_mlp(self._norm(x, ln2).to(dtype), gate_up, down)
            state.k[i, :, :, :, :width] = kp.transpose(-1, -2).repeat_interleave(n, dim=0)
            state.v[i, :, :, :width] = vp.repeat_interleave(n, dim=0)
        last = torch.tensor(lengths, device=device).cumsum(0) - 1
        logits = weights.lm_head(self._norm(x[last], self.inner.norm.weight).to(dtype)).float()
        state.set_prompts(lengths, n, width)
        state.weights = weights
        return logits.repeat_interleave(n, dim=0), state

    @torch.no_grad()
    def extend(self, histories: list[list[int]], kept: list, n, max_new: int, dtype: torch.dtype):
        """`prefill` where a history's cache is kept from an earlier call (a multi-turn rollout's turn
        before, a partial rollout's round before: rollout/turns.py): kept[i] is (keys, values) of
        histories[i]'s first tokens, as `DecodeState.held` gives them, or None; only the rest of the history
        runs, its queries attending to the kept keys and to its own.  As in `prefill`, each history is then
        laid out for its n completions (a new prompt's group, run once).  Returns (logits of the next token
        [rows, vocab], DecodeState)."""
        device = self.inner.embed_tokens.weight.device
        rows, weights = len(histories), self._inference_weights(dtype, len(histories))
        starts = [0 if h is None else h[0].shape[-1] for h in kept]  # tokens each row's cache holds
        lengths = [len(h) for h in histories]
        news = [n - s for s, n in zip(starts, lengths)]
        width, longest = max(lengths), max(news)
        state = DecodeState(self, rows, width + max_new, dtype, device)
        state.k[..., :width].zero_()  # columns no token fills are masked out, and must not hold NaNs
        state.v[..., :width, :].zero_()
        for i, (s, h) in enumerate(zip(starts, kept)):
            if h is not None:
                state.k[:, i, :, :, :s], state.v[:, i, :, :s] = h
        tokens = torch.tensor([t for hist, s in zip(histories, starts) for t in hist[s:]], device=device)
        positions = torch.cat([torch.arange(s, n, device=device) for s, n in zip(starts, lengths)])  # = cache columns
        row = torch.repeat_interleave(torch.arange(rows, device=device), torch.tensor(news, device=device))
        x = self.inner.embed_tokens(tokens).float()
        cos, sin = self._rope(x, positions)
        index = _padded_index(news, longest, device)
        # the j-th new token of row i sits at column starts[i] + j and attends to every column up to it
        reach = torch.tensor(starts, device=device)[:, None] + torch.arange(longest, device=device)[None]
        mask = (torch.arange(width, device=device)[None, None] <= reach[:, :, None])[:, None]  # [rows, 1, longest, width]
        for i, (ln1, qkv, qk_norm, o, ln2, gate_up, down) in enumerate(weights.layers):
            q, k, v = self._split_qkv(qkv(self._norm(x, ln1).to(dtype)), qk_norm, cos, sin)
            state.k[i][row, :, :, positions] = k
            state.v[i][row, :, positions] = v
            keys, values = state.k[i, :, :, :, :width].transpose(-1, -2), state.v[i, :, :, :width]
            x = x + o(_from_padded(self._attend(_to_padded(q, index, rows, longest), keys, values, mask), index))
            x = x + self._fused_mlp(self._norm(x, ln2).to(dtype), gate_up, down)
        last = torch.tensor(news, device=device).cumsum(0) - 1
        logits = weights.lm_head(self._norm(x[last], self.inner.norm.weight).to(dtype)).float()
        state.set_prompts(lengths, 1, width)
        state.weights = weights
        if n != 1 and n != [1] * rows:  # each history's row n times over, as `prefill` lays a prompt out
            n = n if isinstance(n, int) else torch.tensor(n, device=device)
            state.repeat(n)
            logits = logits.repeat_interleave(n, dim=0)
        return logits, state

    @torch.no_grad()
    def decode(self, tokens: torch.Tensor, state: "DecodeState") -> torch.Tensor:
        """One token per live row -> logits of the next token [live rows, vocab].

        Cache rows of finished completions that were not dropped yet (see
        DecodeState.hold) are computed with a dummy token and ignored."""
        if len(tokens) < state.rows:
            full = torch.zeros(state.rows, dtype=tokens.dtype, device=tokens.device)
            tokens = full.index_copy(0, state.active, tokens)
        x = self.inner.embed_tokens(tokens).float()  # [rows, hidden]
        cos, sin = self._rope(x, state.positions)
        slot = state.length  # the cache column this token's key goes to
        state.mask[:, slot] = True
        x = self.decode_layers(x, cos, sin, state, state.rows, slot, slot + 1)
        state.advance()
        if len(state.active) < state.rows:
            x = x[state.active]
        return self.decode_logits(x, state)

    def decode_logits(self, x, state: "DecodeState") -> torch.Tensor:
        """Final hidden states [rows, hidden] -> fp32 logits [rows, vocab]."""
        return state.weights.lm_head(self._norm(x, self.inner.norm.weight).to(state.dtype)).float()

    def decode_layers(self, x, cos, sin, state: "DecodeState", rows: int, slot, window: int) -> torch.Tensor:
        """The decoder layers for one token in each of the cache's first `rows` rows: x [rows, hidden]
        -> [rows, hidden].  Keys and values are written at column `slot` (an int, or a one-element
        tensor, which a CUDA graph can replay: rollout/graphs.py), attention reads columns [:window]."""
        weights, dtype = state.weights, state.dtype
        mask = state.mask[:rows, None, None, :window]  # [rows, 1, 1, keys]
        for i, (ln1, qkv, qk_norm, o, ln2, gate_up, down) in enumerate(weights.layers):
            q, k, v = self._split_qkv(qkv(self._norm(x, ln1).to(dtype)), qk_norm, cos, sin)
            if isinstance(slot, int):
                state.k[i, :rows, :, :, slot] = k
                state.v[i, :rows, :, slot] = v
            else:
                state.k[i, :rows].index_copy_(3, slot, k[..., None])
                state.v[i, :rows].index_copy_(2, slot, v[:, :, None])
            out = self._attend_one(q, state.k[i, :rows, :, :, :window], state.v[i, :rows, :, :window], mask)
            x = x + o(out)
            x = x + self._fused_mlp(self._norm(x, ln2).to(dtype), gate_up, down)
        return x

    def _attend_one(self, q, k_t, v, mask):
        """Attention of one new token per row: q [rows, H, D] against keys k_t [rows, Hkv, D, S]
        (stored transposed, so the slice needs no copy) and values v [rows, Hkv, S, D].

        Written out with two matmuls (query heads grouped onto their key/value head):
        for a single query this is several times faster than SDPA on CPU in bf16."""
        rows, group = q.shape[0], self.heads // self.kv_heads
        scores = torch.matmul(q.view(rows, self.kv_heads, group, self.head_dim), k_t) * self.scale
        scores = scores.float().masked_fill(~mask, float("-inf"))
        probs = torch.softmax(scores, dim=-1).to(v.dtype)
        return torch.matmul(probs, v).reshape(rows, self.heads * self.head_dim)

    def release(self) -> None:
        """Forget the sampling weights (InferenceWeights) built from the model's parameters."""
        self._weights = None

    def reload(self, state: "DecodeState") -> None:
        """Sample the rest of a running decode with the model's current weights (loaded in place since
        its prefill: rollout/producer.py's in-flight update); the cache written so far stays."""
        state.weights = self._inference_weights(state.dtype, state.rows)

    def _inference_weights(self, dtype: torch.dtype, rows: int) -> "InferenceWeights":
        cached = getattr(self, "_weights", None)
        if cached is None or cached.dtype != dtype or cached.version != _version(self.model) or cached.adapters != adapters_enabled(self.model):
            self._weights = InferenceWeights(self, dtype, rows)
        return self._weights

    def _split_qkv(self, fused, qk_norm, cos, sin):
        """The fused projection [n, (H + 2 Hkv) D] -> q [n, H, D], k, v [n, Hkv, D]; the q/k norms
        (qk_norm [H + Hkv, D], or None) and RoPE on q and k at once."""
        n = fused.shape[0]
        q_size, kv_size = self.heads * self.head_dim, self.kv_heads * self.head_dim
        qk = fused[:, : q_size + kv_size].view(n, self.heads + self.kv_heads, self.head_dim)
        if qk_norm is not None:
            qk = self._norm(qk, qk_norm)
        qk = self._rotate(qk, cos, sin).to(fused.dtype)
        v = fused[:, q_size + kv_size :].view(n, self.kv_heads, self.head_dim)
        return qk[:, : self.heads], qk[:, self.heads :], v

    @staticmethod
    def _fused_mlp(h, gate_up, down):
        gate, up = gate_up(h).chunk(2, dim=-1)
        return down(F.silu(gate) * up).float()


def _is_sharded(module) -> bool:
    """Whether `module` is sharded by FSDP2 (fully_shard; fsdp.shard), which needs torch.distributed.fsdp imported."""
    fsdp = sys.modules.get("torch.distributed.fsdp")
    return fsdp is not None and isinstance(module, fsdp.FSDPModule)


def _call_as(module, forward, *args):
    """module(*args) with `forward` in place of the module's own forward: the hooks on the module's call
    run around rlvr's computation.  Under FSDP2 the pre-forward hook gathers the module's parameters
    (and on tensors in `args` that need a gradient, a hook that reduce-scatters their gradients once
    the backward pass has gone through the module), the post-forward hook frees them again (not the
    root's) and hooks the outputs, which must be tensors or tuples of them, to gather them for the
    backward pass."""
    own = module.__dict__.get("forward")  # an instance's own forward, if something set one
    module.forward = forward
    try:
        return module(*args)
    finally:
        if own is None:
            del module.forward
        else:
            module.forward = own


class _Linear:
    """y = x W^T + b with W prepacked for oneDNN (CPU) when available: 1.3-2.6x faster than
    F.linear for the small row counts of decoding.  Elsewhere it is plain F.linear."""

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None, hint: int):
        self.bias = bias
        self.packed = None
        if weight.device.type == "cpu" and torch.backends.mkldnn.is_available():
            try:
                self.packed = torch.ops.mkldnn._reorder_linear_weight(weight, hint)
            except (RuntimeError, AttributeError):
                self.packed = None
        self.weight = weight if self.packed is None else None

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        if self.packed is not None:
            return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        return F.linear(x, self.weight, self.bias)


class InferenceWeights:
    """A read-only copy of the weights for sampling: in the sampling dtype, q/k/v and gate/up
    each fused into one matrix, prepacked, and Qwen3's q/k norm weights stacked per head [H + Hkv, D].
    Rebuilt only when the parameters have changed.  With LoRA each weight is the merged
    W + scale * B A (lora.effective_weight)."""

    def __init__(self, runner: LlamaRunner, dtype: torch.dtype, rows: int):
        self.dtype = dtype
        self.version = _version(runner.model)
        self.adapters = adapters_enabled(runner.model)
        self.layers = []
        w = effective_weight
        with torch.no_grad():
            for layer in runner.inner.layers:
                a, m = layer.self_attn, layer.mlp
                biases = [a.q_proj.bias, a.k_proj.bias, a.v_proj.bias]
                qkv_bias = torch.cat(biases).to(dtype) if biases[0] is not None else None
                qk_norm = None
                if runner.qk_norm:
                    qk_norm = torch.cat([a.q_norm.weight.expand(runner.heads, -1), a.k_norm.weight.expand(runner.kv_heads, -1)])
                self.layers.append((
                    layer.input_layernorm.weight,
                    _Linear(torch.cat([w(a.q_proj), w(a.k_proj), w(a.v_proj)]).to(dtype), qkv_bias, rows),
                    qk_norm,
                    _Linear(w(a.o_proj).to(dtype), None if a.o_proj.bias is None else a.o_proj.bias.to(dtype), rows),
                    layer.post_attention_layernorm.weight,
                    _Linear(torch.cat([w(m.gate_proj), w(m.up_proj)]).to(dtype), None, rows),
                    _Linear(w(m.down_proj).to(dtype), None, rows),
                ))
            self.lm_head = _Linear(runner.model.lm_head.weight.to(dtype), None, rows)


def _version(model) -> int:
    """Changes whenever any parameter is modified in place (an optimizer step) or replaced."""
    return hash(tuple((id(p), p._version) for p in model.parameters()))


class DecodeState:
    """Preallocated keys [layers, rows, kv_heads, head_dim, capacity] (transposed) and values
    [layers, rows, kv_heads, capacity, head_dim], and per-row bookkeeping."""

    def __init__(self, runner: LlamaRunner, rows: int, capacity: int, dtype, device):
        layers = len(runner.inner.layers)
        self.k = torch.empty((layers, rows, runner.kv_heads, runner.head_dim, capacity), dtype=dtype, device=device)
        self.v = torch.empty((layers, rows, runner.kv_heads, capacity, runner.head_dim), dtype=dtype, device=device)
        self.mask = torch.zeros((rows, capacity), dtype=torch.bool, device=device)
        self.dtype, self.device = dtype, device
        self.length = 0  # cache columns in use (prompt width + generated tokens)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.active = torch.arange(rows, device=device)  # cache rows of the completions still being sampled

    def set_prompts(self, lengths: list[int], n: int, width: int) -> None:
        per_row = torch.tensor(lengths, device=self.device).repeat_interleave(n)
        self.mask[:, :width] = torch.arange(width, device=self.device)[None] < per_row[:, None]
        self.positions = per_row.clone()  # the next token's position is the prompt length
        self.length = width

    def advance(self) -> None:
        self.length += 1
        self.positions += 1

    @property
    def rows(self) -> int:
        return self.k.shape[1]

    def repeat(self, n) -> None:
        """Each row n times over, in order (n: one number, or a tensor with one count per row)."""
        self.k, self.v = self.k.repeat_interleave(n, dim=1), self.v.repeat_interleave(n, dim=1)
        self.mask, self.positions = self.mask.repeat_interleave(n, dim=0), self.positions.repeat_interleave(n, dim=0)
        self.active = torch.arange(self.rows, device=self.device)

    def hold(self, live: torch.Tensor) -> None:
        """Keep only `live` (indices into the current live rows) as live, without copying the cache."""
        self.active = self.active[live]

    def move_to_front(self, live: torch.Tensor) -> None:
        """Keep only `live` as live, moved in place to the first rows of the cache (the tensors keep
        their addresses, which CUDA graphs need: rollout/graphs.py); the rows after them are stale."""
        rows, n = self.active[live], len(live)
        for cache in (self.k, self.v):
            cache[:, :n] = cache[:, rows]
        self.mask[:n] = self.mask[rows]
        self.positions[:n] = self.positions[rows]
        self.active = torch.arange(n, device=self.device)

    def held(self, live: int) -> tuple[torch.Tensor, torch.Tensor]:
        """A copy of live row `live`'s cache, the columns it uses in order (the tokens run so far):
        keys [layers, kv_heads, head_dim, tokens] and values [layers, kv_heads, tokens, head_dim],
        which `LlamaRunner.extend` goes on from."""
        row = self.active[live]
        columns = self.mask[row].nonzero()[:, 0]
        return self.k[:, row].index_select(-1, columns), self.v[:, row].index_select(-2, columns)

    def keep(self, live: torch.Tensor) -> None:
        """Keep only `live` and drop the other rows from the cache (one copy)."""
        rows = self.active[live]
        self.k = self.k[:, rows].contiguous()
        self.v = self.v[:, rows].contiguous()
        self.mask = self.mask[rows]
        self.positions = self.positions[rows]
        self.active = torch.arange(len(rows), device=self.device)


class _Layout:
    """Where every token of a grouped, padding-free batch lives, and the attention over it.

    Flat token order: all prompt tokens (prompt after prompt), then all completion
    tokens.  For attention, prompts are laid out padded [P, Lp] with causal masks;
    completions padded [N, Lc] attend to their prompt's keys (all of them) and to
    their own earlier tokens.
    """

    def __init__(self, prompt_ids, completion_ids, group, device):
        p_len = [len(p) for p in prompt_ids]
        c_len = [len(c) for c in completion_ids]
        self.n_prompt_tokens = sum(p_len)
        self.tokens = torch.tensor([t for p in prompt_ids for t in p] + [t for c in completion_ids for t in c], device=device)
        group_t = torch.tensor(group, device=device)
        c_start = torch.tensor(p_len, device=device)[group_t]  # a completion's first position
        self.positions = torch.cat(
            [torch.arange(n, device=device) for n in p_len]
            + [torch.arange(n, device=device) + int(s) for n, s in zip(c_len, c_start.tolist())]
        )
        self.p_width, self.c_width = max(p_len), max(c_len)
        self.p_index = _padded_index(p_len, self.p_width, device)
        self.c_index = _padded_index(c_len, self.c_width, device)
        self.group = group_t
        self.n_prompts, self.n_completions = len(p_len), len(c_len)
        self.p_mask = _causal_padded_mask(p_len, self.p_width, device)
        # completion row i: prompt keys of its group where real, then its own causal keys
        prompt_keys = (torch.arange(self.p_width, device=device)[None] < torch.tensor(p_len, device=device)[:, None])[group_t]
        own = _causal_padded_mask(c_len, self.c_width, device)[:, 0]  # [N, Lc, Lc]
        self.c_mask = torch.cat([prompt_keys[:, None, :].expand(-1, self.c_width, -1), own], dim=-1)[:, None]
        # predictors: the last prompt token for token 0, then the completion's own tokens 0..len-2
        p_last = torch.tensor(p_len, device=device).cumsum(0) - 1
        c_offsets = [self.n_prompt_tokens + o for o in _offsets(c_len)]
        rows = []
        for i, (n, off) in enumerate(zip(c_len, c_offsets)):
            rows.append(p_last[group[i]].reshape(1))
            rows.append(torch.arange(off, off + n - 1, device=device))
        self.predictors = torch.cat(rows)

    def attention(self, q, k, v, attend):
        """q [n, H, D], k/v [n, Hkv, D] over all flat tokens -> [n, H * D]."""
        split = self.n_prompt_tokens
        qp, kp, vp = (_to_padded(t[:split], self.p_index, self.n_prompts, self.p_width) for t in (q, k, v))
        qc, kc, vc = (_to_padded(t[split:], self.c_index, self.n_completions, self.c_width) for t in (q, k, v))
        out_p = attend(qp, kp, vp, self.p_mask)
        keys = torch.cat([kp[self.group], kc], dim=2)
        values = torch.cat([vp[self.group], vc], dim=2)
        out_c = attend(qc, keys, values, self.c_mask)
        return torch.cat([_from_padded(out_p, self.p_index), _from_padded(out_c, self.c_index)])


def _offsets(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


def _padded_index(lengths: list[int], width: int, device) -> torch.Tensor:
    """Flat position -> row * width + column, for sequences laid out left-aligned in [rows, width]."""
    return torch.cat([torch.arange(n, device=device) + r * width for r, n in enumerate(lengths)])


def _to_padded(t: torch.Tensor, index: torch.Tensor, rows: int, width: int) -> torch.Tensor:
    """Flat [n, heads, D] -> [rows, heads, width, D] (zeros where padded)."""
    out = t.new_zeros((rows * width,) + t.shape[1:])
    out = out.index_copy(0, index, t)
    return out.view(rows, width, *t.shape[1:]).transpose(1, 2)


def _from_padded(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """[rows, heads, width, D] -> flat [n, heads * D] at the real positions."""
    rows, heads, width, dim = t.shape
    return t.transpose(1, 2).reshape(rows * width, heads * dim).index_select(0, index)


def _causal_padded_mask(lengths: list[int], width: int, device) -> torch.Tensor:
    """[rows, 1, width, width]: causal, and no key beyond a row's length.  Padded query rows
    attend to key 0 only, so that no softmax row is empty."""
    ar = torch.arange(width, device=device)
    causal = ar[None, :] <= ar[:, None]
    valid = ar[None] < torch.tensor(lengths, device=device)[:, None]  # [rows, width]
    mask = causal[None] & valid[:, None, :]
    mask[:, :, 0] = True
    return mask[:, None]
