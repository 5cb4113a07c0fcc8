"""`rlvr plan` for the layouts of the users' guide, beside the guide's memory table.

    python benchmarks/plan_layouts.py           # the table of docs/scaling.md (LoRA and memory planning)
    python benchmarks/plan_layouts.py --full    # and each command's whole `rlvr plan` output

Each row is one `rlvr plan` command, printed under the table to be run by hand.  The models are
Qwen2.5-7B, Qwen2.5-32B and Qwen2.5-72B, given by their sizes (nothing is downloaded); the settings are the
guide's (G=8, micro-batch 4, 2 accumulation steps, completions up to 256 tokens, beta 0.04,
bf16 weights and autocast) with rlvr's default LoRA rank, 16 (the guide gives none).  The
guide's table: 7B LoRA 32-40 GB (A100 40GB / L40S), 32B LoRA 100-120 GB (H200), 32B
disaggregated 64-80 GB (H100 / H200), 70B disaggregated 140-160 GB (2 H200 / B200); its disaggregated trainer node holds the policy and a
reference in bf16 (64 GB each) and a LoRA optimizer (~2 GB), with vLLM on 2 H200 rollout nodes.
"""

from __future__ import annotations

import argparse
import shlex

from rlvr.plan import GIB, layout_estimate, plan, render

SIZES = {
    "Q7": "hidden_size=3584 intermediate_size=18944 num_hidden_layers=28 num_attention_heads=28 "
          "num_key_value_heads=4 head_dim=128 vocab_size=152064 tie_word_embeddings=false",
    "Q32": "hidden_size=5120 intermediate_size=27648 num_hidden_layers=64 num_attention_heads=40 "
           "num_key_value_heads=8 head_dim=128 vocab_size=152064 tie_word_embeddings=false",
    "Q72": "hidden_size=8192 intermediate_size=29568 num_hidden_layers=80 num_attention_heads=64 "
           "num_key_value_heads=8 head_dim=128 vocab_size=152064 tie_word_embeddings=false",
}
GUIDE = ("dtype=bfloat16 bf16=true num_generations=8 per_device_train_batch_size=4 gradient_accumulation_steps=2 "
         "max_completion_length=256 beta=0.04")
SERVER = "use_vllm=true vllm_mode=server vllm_gpu_memory_utilization=0.9"

# (guide's row, its memory, the layout in words, the plan's arguments after $GUIDE, why the two differ: a sentence
# whose {fields} are the plan's rows on the trainer GPU in GiB, and "total GB", "free" (GiB left), "shards")
ROWS = [
    ("7B LoRA", "32-40 GB", "1 A100 40GB, rlvr's sampler", "$Q7 use_peft=true gpu_memory_gb=40",
     "At the top of the range ({total GB:.1f} GB): besides the weights ({policy:.1f} GiB) rlvr's sampler keeps a merged "
     "copy of its own ({rollout weights:.1f} GiB) and the update keeps {activations:.1f} GiB of activations for 4 x 768 "
     "tokens; {free:.1f} GiB spare is no margin for the CUDA context and the allocator."),
    ("7B LoRA", "32-40 GB", "1 A100 40GB, rlvr's sampler, checkpointing",
     "$Q7 use_peft=true gpu_memory_gb=40 gradient_checkpointing=true",
     "Below the range ({total GB:.1f} GB): checkpointing leaves {activations, checkpointed:.1f} GiB of activations; "
     "the sampler's copy of the weights stays."),
    ("7B LoRA", "32-40 GB", "trainer 1 A100 40GB, vLLM server on another",
     f"$Q7 use_peft=true gpu_memory_gb=40 {SERVER}",
     "The guide's number is one GPU; here the sampler's copy and KV cache move to the vLLM GPU, whose KV cache is what "
     "is left of 0.9 x 40 GiB."),
    ("7B full", "-", "fsdp over 4 H100 80GB, rlvr's sampler, checkpointing",
     "$Q7 gpus=4 fsdp=true gpu_memory_gb=80 gradient_checkpointing=true",
     "No guide row; FSDP shards weights, gradients and AdamW state to {shards:.1f} GiB per GPU and the reference to "
     "{reference:.1f}; the whole weights and the sampler's copy ({gathered to sample:.1f}) are gathered only while it "
     "samples, so the peak is the update's or the sampling's, not both."),
    ("32B LoRA", "100-120 GB", "1 H200, rlvr's sampler", "$Q32 use_peft=true gpu_memory_gb=140",
     "Over the range and the GPU: the weights ({policy:.1f} GiB), the sampler's merged copy ({rollout weights:.1f}) "
     "and {activations:.1f} GiB of activations without checkpointing."),
    ("32B LoRA", "100-120 GB", "1 H200, rlvr's sampler, checkpointing",
     "$Q32 use_peft=true gpu_memory_gb=140 gradient_checkpointing=true",
     "Above the range ({total GB:.1f} GB): after the weights, the largest row is a second, merged copy of them for "
     "rlvr's sampler ({rollout weights:.1f} GiB); fits with {free:.1f} GiB free."),
    ("32B disaggregated", "64-80 GB", "LoRA: trainer 1 H200, checkpointing; vLLM server on 2 H200",
     f"$Q32 use_peft=true gpu_memory_gb=140 gradient_checkpointing=true {SERVER} vllm_tensor_parallel_size=2",
     "In the range ({total GB:.1f} GB), though not for the guide's reason: its node holds a 64 GB reference (64 + 64 + 2 "
     "GB, more than its own 64-80), while rlvr's LoRA reference is the policy with the adapter off."),
    ("32B full", "-", "fsdp over 8 H200, checkpointing; vLLM server on 2 H200",
     f"$Q32 gpus=8 fsdp=true gpu_memory_gb=140 gradient_checkpointing=true {SERVER} "
     "vllm_tensor_parallel_size=2",
     "No guide row; fits with {free:.1f} GiB free: rlvr shards what trains ({shards:.1f} GiB per GPU) and the "
     "reference ({reference:.1f}); with the vLLM server the weights leave a tensor at a time and nothing is whole "
     "on a trainer GPU."),
    ("32B full", "-", "the same with beta=0 (no reference)",
     f"$Q32 gpus=8 fsdp=true gpu_memory_gb=140 gradient_checkpointing=true {SERVER} "
     "vllm_tensor_parallel_size=2 beta=0",
     "No guide row; without a reference {free:.1f} GiB free."),
    ("70B disaggregated", "140-160 GB", "LoRA: fsdp over the guide's 2 H200, checkpointing; vLLM server on 4 H200",
     f"$Q72 use_peft=true gpus=2 fsdp=true gpu_memory_gb=140 gradient_checkpointing=true {SERVER} vllm_tensor_parallel_size=4",
     "The LoRA policy is sharded ({policy:.1f} GiB per GPU) and sent to the server a tensor at a time; {free:.1f} GiB "
     "free. The guide's 140-160 GB is about the policy's bf16 weights (145 GB) over its 2 GPUs, the same layout."),
    ("70B full", "-", "fsdp over 8 H200, checkpointing; vLLM server on 4 H200",
     f"$Q72 gpus=8 fsdp=true gpu_memory_gb=140 gradient_checkpointing=true {SERVER} vllm_tensor_parallel_size=4",
     "No guide row; the shards ({shards:.1f} GiB) and the reference ({reference:.1f}) fit, with no whole copy on a "
     "trainer GPU: {free:.1f} GiB free."),
]


def arguments(tail: str) -> list[str]:
    """The command's arguments, the shell variables ($Q7, $Q32, $GUIDE) spelled out."""
    words = []
    for word in shlex.split(f"$GUIDE {tail}"):
        words += shlex.split({**SIZES, "GUIDE": GUIDE}[word[1:]]) if word.startswith("$") else [word]
    return words


def cells(args: list[str], why: str) -> tuple[str, str, str]:
    """The trainer GPU's total, the vLLM server GPU's and the sentence, as the table shows them."""
    size, cfg, layout = plan(args)
    est = layout_estimate(size, cfg, layout)
    rows = {k: v / GIB for k, v in est["trainer"].items()}
    rows.update({"total GB": est["trainer"]["total"] / 1e9, "free": layout.gpu_memory_gb - rows["total"],
                 "shards": rows["policy"] + rows["gradients"] + rows["optimizer"]})
    trainer = f"{rows['total']:.1f} GiB" + (" (does not fit)" if rows["free"] < 0 else "")
    if "vllm" not in est or cfg.vllm_mode != "server":
        return trainer, "-", why.format_map(rows)
    v = est["vllm"]
    server = (f"{v['total'] / GIB:.1f} GiB: weights {v['vLLM weights'] / GIB:.1f} + KV {v['KV cache'] / GIB:.1f} "
              f"= {v['KV tokens'] / 1000:.0f}k tokens, {v['full-length completions']:,} completions")
    return trainer, server, why.format_map(rows)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--full", action="store_true", help="also print each command's whole output")
    full = ap.parse_args().full
    print("| # | guide | guide's memory | rlvr layout | `rlvr plan`, trainer GPU | `rlvr plan`, vLLM server GPU | why they differ |")
    print("|---|---|---|---|---|---|---|")
    for i, (guide, memory, where, tail, why) in enumerate(ROWS, 1):
        print("| " + " | ".join([str(i), guide, memory, where, *cells(arguments(tail), why)]) + " |")
    print("\n```bash")
    for name, value in {**SIZES, "GUIDE": GUIDE}.items():
        print(f'{name}="{value}"')
    for i, (*_, tail, _) in enumerate(ROWS, 1):
        print(f"rlvr plan $GUIDE {tail}   # {i}")
    print("```")
    for i, (*_, tail, _) in enumerate(ROWS, 1) if full else ():
        print(f"\n# {i}: rlvr plan $GUIDE {tail}\n" + render(*plan(arguments(tail))))


if __name__ == "__main__":
    main()
