"""Where a bf16 rollout's time goes on this CPU: the fast sampler at batch 32, profiled, against the roofline.

    python benchmarks/profile_decode.py                          # bf16, batch 32, 64 new tokens
    python benchmarks/profile_decode.py --precision fp32 --batch 64 --json out.json

Three measurements, in one process, on the default model (the rollout of benchmarks/speed.py: 8
completions per prompt, temperature 0.8, top-p 0.9, end-of-sequence ignored so every row decodes
every token):

1. Decode tokens/s of the whole rollout (prefill included) and its fraction of the roofline: the
   square-matmul FLOP/s (n = 2048) measured here over 2 x parameters per token, as speed.py has it.
2. The rollout under torch.profiler: the time of the ops, by kind (the linear layers, attention,
   the sampling of the next token, elementwise and norm ops, copies and indexing, the rest), and
   the wall time no op accounts for (Python, the sampler's loop, the stop checks).
3. The matmuls of one decode step at their real shape (rows = the batch): each linear layer of the
   model as the sampler runs it (prepacked oneDNN weights, llama._Linear), timed alone.  Their FLOP/s
   over their time is the fastest one decode step could be if nothing else took time: the
   roofline for this batch, which skinny matmuls reach less of than square ones.
4. What each non-matmul piece of the decode step costs, by taking it out: the decode step (no
   sampling) is timed as it is and with one piece at a time replaced by a stand-in that keeps every
   matmul (attention by its query, RoPE and the norms by their input, silu(gate) * up by up, the
   LM head by the hidden state); the variants take turns for `--rounds` rounds and each keeps its
   fastest.  The sampling of the next token (temperature, top-p) is timed alone on real logits.
   The profiler of 2 charges some of the step's time to the wrong ops (one profile with shapes
   recorded gave log_softmax alone 14 ms a step, where the whole draw of a token, timed directly,
   took 6), so this is the measurement to trust for where the time goes.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

GROUP, MAX_NEW, TEMPERATURE, TOP_P, SEED = 8, 64, 0.8, 0.9, 42

# Op name -> kind; the first pattern that is a substring of the name decides.
KINDS = (
    ("linear", ("_linear_pointwise", "aten::linear", "aten::addmm", "aten::mm")),
    ("attention", ("aten::bmm", "aten::matmul", "aten::softmax", "aten::_softmax", "masked_fill", "scaled_dot_product")),
    ("sampling", ("sort", "multinomial", "cumsum", "aten::exponential", "aten::uniform", "aten::rand", "argmax",
                  "log_softmax", "aten::gather", "aten::topk", "aten::max")),
    ("norm and elementwise", ("aten::mul", "aten::add", "aten::sub", "aten::div", "aten::neg", "aten::pow", "aten::mean",
                              "aten::rsqrt", "aten::silu", "aten::cos", "aten::sin", "aten::cat", "aten::where",
                              "aten::lt", "aten::gt", "aten::ge", "aten::le", "aten::eq", "aten::bitwise")),
    ("copies and indexing", ("aten::copy_", "aten::to", "aten::_to_copy", "aten::index", "aten::embedding",
                             "aten::clone", "aten::contiguous", "aten::fill_", "aten::zero", "aten::empty", "aten::full",
                             "aten::repeat", "aten::select", "aten::slice")),
)


def kind_of(name: str) -> str:
    for kind, patterns in KINDS:
        if any(p in name for p in patterns):
            return kind
    return "other ops"


def linear_shapes(model) -> list[tuple[str, int, int, int]]:
    """(name, in, out, count per decode step) of the matmuls the fast sampler runs per token."""
    cfg = model.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    h, layers = cfg.hidden_size, cfg.num_hidden_layers
    return [("qkv", h, (heads + 2 * kv) * head_dim, layers), ("o", heads * head_dim, h, layers),
            ("gate_up", h, 2 * cfg.intermediate_size, layers), ("down", cfg.intermediate_size, h, layers),
            ("lm_head", h, cfg.vocab_size, 1)]


def seconds_per_call(call, repeat: int, warmup: int = 1) -> float:
    """Mean seconds of `call()` over `repeat` calls, after `warmup` untimed ones."""
    for _ in range(warmup):
        call()
    start = time.perf_counter()
    for _ in range(repeat):
        call()
    return (time.perf_counter() - start) / repeat


def time_linears(model, rows: int, dtype, repeat: int = 50) -> list[dict]:
    import torch

    from rlvr.llama import _Linear

    out = []
    for name, d_in, d_out, count in linear_shapes(model):
        layer = _Linear(torch.randn(d_out, d_in).to(dtype), None, rows)
        x = torch.randn(rows, d_in).to(dtype)
        seconds = seconds_per_call(lambda: layer(x), repeat, warmup=5)
        out.append({"name": name, "shape": [rows, d_in, d_out], "per_step": count, "seconds": seconds,
                    "flops_per_s": 2 * rows * d_in * d_out / seconds})
    return out


# Stand-ins for the pieces of LlamaRunner's decode step (part 4): (method, replacement).
STAND_INS = {
    "attention": ("_attend_one", lambda self, q, k_t, v, mask: q.reshape(q.shape[0], -1)),
    "rope": ("_rotate", staticmethod(lambda x, cos, sin: x)),
    "norms": ("_norm", lambda self, x, weight: x),
    "silu(gate) * up": ("_fused_mlp", staticmethod(lambda h, gate_up, down: down(gate_up(h).chunk(2, dim=-1)[1]).float())),
    "lm_head": ("decode_logits", lambda self, x, state: x),
}


def decode_step_seconds(runner, ids, n: int, steps: int, dtype) -> float:
    """Seconds per decode step (no sampling: every row is fed the first prompt's last token), after a prefill."""
    import torch

    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        _, state = runner.prefill(ids, n, steps, dtype)
        token = torch.full((len(ids) * n,), ids[0][-1], dtype=torch.long)
        start = time.perf_counter()
        for _ in range(steps):
            runner.decode(token, state)
        return (time.perf_counter() - start) / steps


def ablate(runner, ids, n: int, dtype, steps: int = MAX_NEW, rounds: int = 3) -> dict:
    """{"full": seconds per decode step, piece: seconds per step with that piece's stand-in}: the
    fastest of `rounds`, the variants taking turns.  The runner's class is restored afterwards."""
    cls = type(runner)
    saved = {method: cls.__dict__[method] for method, _ in STAND_INS.values()}
    best = dict.fromkeys(["full", *STAND_INS], float("inf"))
    for _ in range(rounds):
        for name in best:
            if name != "full":
                method, stand_in = STAND_INS[name]
                setattr(cls, method, stand_in)
            try:
                best[name] = min(best[name], decode_step_seconds(runner, ids, n, steps, dtype))
            finally:
                for method, original in saved.items():
                    setattr(cls, method, original)
    return best


def sampling_seconds(logits, repeat: int = 20) -> float:
    """Seconds to draw one token per row from `logits` [rows, vocab] as the benchmark's rollout does."""
    from rlvr.rollout.sampling import sample_next

    return seconds_per_call(lambda: sample_next(logits, TEMPERATURE, 0, TOP_P), repeat)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--precision", default="bf16", choices=["bf16", "fp32"])
    parser.add_argument("--batch", type=int, default=32, help="completions decoded together (8 per prompt)")
    parser.add_argument("--json", help="also write the numbers to this path")
    parser.add_argument("--rounds", type=int, default=3, help="rounds of the pieces' stand-ins (part 4)")
    args = parser.parse_args()
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

    import torch
    from torch.profiler import ProfilerActivity, profile

    from rlvr.chat import encode_prompts
    from rlvr.models import load_model
    from rlvr.rollout import SamplingParams
    from rlvr.rollout.engine import make_sampler
    from speed import matmul_flops, prompts

    dtype = torch.bfloat16 if args.precision == "bf16" else torch.float32
    model, tokenizer, _ = load_model("default")
    model.eval()
    ids = encode_prompts(tokenizer, prompts(args.batch // GROUP), None, None)
    params = SamplingParams(n=GROUP, max_tokens=MAX_NEW, temperature=TEMPERATURE, top_p=TOP_P)
    sampler = make_sampler(model, tokenizer, eos_token_ids=[], bf16=args.precision == "bf16")
    sampler.generate(ids, SamplingParams(n=GROUP, max_tokens=4, temperature=TEMPERATURE, top_p=TOP_P))  # weights cast, warm

    peak = matmul_flops(dtype)  # speed.py's: a square matmul, n = 2048 on the CPU
    flops_per_token = 2 * sum(p.numel() for p in model.parameters())
    roofline = peak / flops_per_token

    runs = []
    for _ in range(3):
        start = time.perf_counter()
        sampler.generate(ids, params, torch.Generator().manual_seed(SEED))
        runs.append(time.perf_counter() - start)
    wall = sorted(runs)[1]  # the median of three
    tokens = args.batch * MAX_NEW
    report = {"precision": args.precision, "batch": args.batch, "new_tokens": MAX_NEW, "matmul_peak_flops": peak,
              "flops_per_token": flops_per_token, "tokens_per_s": tokens / wall,
              "roofline_fraction": tokens / wall / roofline, "seconds": wall}

    with profile(activities=[ProfilerActivity.CPU]) as prof:
        start = time.perf_counter()
        sampler.generate(ids, params, torch.Generator().manual_seed(SEED))
        profiled_wall = time.perf_counter() - start
    by_kind, calls = defaultdict(float), defaultdict(int)
    for event in prof.key_averages():
        by_kind[kind_of(event.key)] += event.self_cpu_time_total / 1e6
        calls[kind_of(event.key)] += event.count
    in_ops = sum(by_kind.values())
    report["profile"] = {"wall_seconds": profiled_wall, "op_seconds": dict(by_kind), "op_calls": dict(calls),
                         "outside_ops_seconds": max(0.0, profiled_wall - in_ops),
                         "ops_per_token_step": sum(calls.values()) / MAX_NEW}

    linears = time_linears(model, args.batch, dtype)
    step_matmul_seconds = sum(m["seconds"] * m["per_step"] for m in linears)
    step_flops = sum(2 * m["shape"][0] * m["shape"][1] * m["shape"][2] * m["per_step"] for m in linears)
    report["linears"] = linears
    report["step_matmul_seconds"] = step_matmul_seconds
    report["shape_roofline_fraction"] = step_flops / step_matmul_seconds / peak  # skinny matmuls against square ones
    report["decode_seconds_per_step"] = wall / MAX_NEW

    report["ablation"] = ablate(sampler.runner, ids, GROUP, dtype, rounds=args.rounds)
    with torch.inference_mode(), torch.autocast("cpu", dtype=torch.bfloat16, enabled=dtype == torch.bfloat16):
        logits, _ = sampler.runner.prefill(ids, GROUP, 1, dtype)
    report["sampling_seconds_per_step"] = sampling_seconds(logits)
    print(format_report(report))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


def format_report(r: dict) -> str:
    p = r["profile"]
    lines = [f"{r['precision']} rollout, batch {r['batch']}, {r['new_tokens']} new tokens: {r['tokens_per_s']:.0f} tokens/s, "
             f"{r['roofline_fraction']:.0%} of the roofline ({r['matmul_peak_flops'] / 1e9:.0f} GFLOP/s square-matmul peak, "
             f"{r['flops_per_token'] / 1e6:.0f} MFLOP per token)",
             f"profiled rollout: {p['wall_seconds']:.2f} s wall, {p['ops_per_token_step']:.0f} ops per decode step"]
    for kind, seconds in sorted(p["op_seconds"].items(), key=lambda kv: -kv[1]):
        lines.append(f"  {kind:24}{seconds:>8.2f} s {seconds / p['wall_seconds']:>5.0%}  ({p['op_calls'][kind]} calls)")
    lines.append(f"  {'outside any op':24}{p['outside_ops_seconds']:>8.2f} s {p['outside_ops_seconds'] / p['wall_seconds']:>5.0%}")
    lines.append(f"linear layers at {r['batch']} rows, timed alone (one decode step: {r['step_matmul_seconds'] * 1e3:.1f} ms "
                 f"of {r['decode_seconds_per_step'] * 1e3:.1f} ms measured):")
    for m in r["linears"]:
        lines.append(f"  {m['name']:8} {m['shape']} x{m['per_step']:<3}{m['flops_per_s'] / 1e9:>7.0f} GFLOP/s "
                     f"{m['flops_per_s'] / r['matmul_peak_flops']:>5.0%} of peak")
    lines.append(f"shape_roofline_fraction: {r['shape_roofline_fraction']:.2f} (the most a decode step of these matmuls "
                 f"can reach of the square-matmul roofline)")
    a = r["ablation"]
    lines.append(f"decode step without sampling: {a['full'] * 1e3:.1f} ms (the fastest of the rounds); "
                 f"the sampling of a token, alone: {r['sampling_seconds_per_step'] * 1e3:.1f} ms; "
                 f"each piece taken out saves:")
    for name in STAND_INS:
        lines.append(f"  {name:18}{(a['full'] - a[name]) * 1e3:>7.1f} ms")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
