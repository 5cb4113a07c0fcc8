#!/usr/bin/env bash
# GPU checks that cannot run on the CPU machine.  Needs CUDA GPUs (2 for NCCL and FSDP), vLLM installed
# (pip install vllm), bitsandbytes for QLoRA (pip install -e '.[qlora]') and rlvr on PATH.
# Run from the repository root:  bash benchmarks/gpu_checks.sh   (`bash -n` checks its syntax anywhere)
#
# On one GPU:
#   http              `rlvr vllm-serve` and `rlvr train` share GPU 0, the weights over HTTP, 3 steps
#   colocate          vLLM colocated in the training process, 3 steps
#   sleep_mode        the same with vllm_enable_sleep_mode=true: vLLM's "Sleep mode freed ... GiB" line each step
#   qlora             load_in_4bit=true use_peft=true, 3 steps with beta > 0: the adapter moves from its start
#   qlora_vllm        the same, sampled by vLLM colocated (the full-precision base model plus the adapter)
#   free              async_mode=free max_staleness=2 with the in-process sampler on its own CUDA stream, weights
#                     loaded between decode steps (cuda_graphs=false) and between generations (CUDA graphs), 6 steps
#                     each: no token over 2 versions old, the sampler's log-probs close to the trainer's
# On two GPUs besides:
#   nccl_one          one training process on GPU 0, vllm_weight_transfer=collective to the server on GPU 1
#   nccl_two          two training processes (torchrun) and the same server; only rank 0 joins its group
#   fsdp              torchrun on 2 GPUs (NCCL), fsdp=true, beta > 0, the demo for 4 steps, its sharded checkpoint-2
#                     (each rank's file), then resumed from step 2
#   fsdp_offload      the same first run with fsdp_offload_params=true: each rank's peak GPU memory below fsdp's
# Each check prints PASS or FAIL with its name; a check that needs more GPUs than there are prints SKIP.
# The script exits non-zero if any check failed.
set -euo pipefail

PORT=${PORT:-8123}
WORK=$(mktemp -d)
SERVER_PID=
PASSED=()
FAILED=()
SKIPPED=()
cleanup() {
    stop_server
    rm -rf "$WORK"
}
trap cleanup EXIT

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then echo "gpu_checks: needs a CUDA GPU, found none" >&2; exit 1; fi
STEPS="logging_steps=1 eval_on_start=false eval_on_end=false report_steps=0"

# `python $PEAK train ARGS`: rlvr's command line, then this process's peak GPU memory (torch's allocator).
PEAK=$WORK/peak.py
cat > "$PEAK" <<'PY'
import os, sys
import torch
from rlvr.cli import main
code = main(sys.argv[1:])
print(f"gpu_checks: rank {os.environ.get('RANK', '0')} peak GPU memory {torch.cuda.max_memory_allocated() / 2**20:.0f} MiB",
      flush=True)
sys.exit(code)
PY

run_check() {  # $1: the check's name, $2: GPUs it needs, then the function that runs it
    local name=$1 needs=$2; shift 2
    if [ "$GPUS" -lt "$needs" ]; then
        echo "gpu_checks: SKIP $name (needs $needs GPUs, found $GPUS)"; SKIPPED+=("$name"); return 0
    fi
    echo "== $name"
    local rc=0
    set +e
    ( set -euo pipefail; trap stop_server EXIT; "$@" )  # a failed check leaves no server behind
    rc=$?
    set -e
    if [ "$rc" -eq 0 ]; then echo "gpu_checks: PASS $name"; PASSED+=("$name")
    else echo "gpu_checks: FAIL $name (exit $rc)"; FAILED+=("$name"); fi
}

start_server() {  # on GPU $1; waits until /health answers
    CUDA_VISIBLE_DEVICES=$1 rlvr vllm-serve demo vllm_server_host=127.0.0.1 vllm_server_port=$PORT \
        vllm_gpu_memory_utilization=${2:-0.5} > "$WORK/server.log" 2>&1 &
    SERVER_PID=$!
    for _ in $(seq 300); do
        if curl -sf "http://127.0.0.1:$PORT/health" > /dev/null; then return 0; fi
        if ! kill -0 "$SERVER_PID" 2>/dev/null; then cat "$WORK/server.log" >&2; return 1; fi
        sleep 1
    done
    echo "gpu_checks: the server did not answer within 300 s" >&2; cat "$WORK/server.log" >&2; return 1
}

stop_server() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    SERVER_PID=
}

report_sync() {  # $1: the run's output_dir, $2: the trainer's log
    if grep -q "vllm_weight_transfer=collective failed" "$2"; then
        echo "gpu_checks: the run fell back to HTTP:" >&2; grep "collective failed" "$2" >&2; return 1
    fi
    python - "$1/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
for row in rows:
    print(f"step {row.get('step')}: vllm/weight_sync_bytes={row.get('vllm/weight_sync_bytes')} "
          f"vllm/weight_sync_seconds={row.get('vllm/weight_sync_seconds')}")
assert len(rows) >= 3 and any(row.get("vllm/weight_sync_bytes") for row in rows), "no weight sync was logged"
PY
}

steps_done() {  # $1: the run's output_dir, $2: the steps it must have logged
    python - "$1/metrics.jsonl" "$2" <<'PY'
import json, sys
steps = [json.loads(line)["step"] for line in open(sys.argv[1])]
assert steps and steps[-1] == int(sys.argv[2]), f"logged steps {steps}, expected up to {sys.argv[2]}"
PY
}

# --- one GPU ---------------------------------------------------------------------------------

free_sane() {  # $1: a free-running run's output_dir: staleness within 2, sampled log-probs close to the trainer's
    python - "$1/metrics.jsonl" <<'PY'
import json, sys
rows = [json.loads(line) for line in open(sys.argv[1])]
assert [r["step"] for r in rows] == list(range(1, 7)), [r["step"] for r in rows]
assert all(0 <= r["sampling/staleness_mean"] <= r["sampling/staleness_max"] <= 2 for r in rows)
gaps = [r["sampling/sampling_logp_difference/mean"] for r in rows if "sampling/sampling_logp_difference/mean" in r]
print("staleness per token:", [round(r["sampling/staleness_mean"], 2) for r in rows], "log-prob gaps:", gaps)
assert gaps and max(gaps) < 0.5, "the sampler's log-probs are far from the trainer's: torn weights?"
PY
}

check_http() {
    start_server 0 0.3
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 save_strategy=no $STEPS output_dir="$WORK/http" use_vllm=true \
        vllm_mode=server vllm_server_host=127.0.0.1 vllm_server_port=$PORT bf16=true 2>&1 | tee "$WORK/http.log"
    stop_server
    report_sync "$WORK/http" "$WORK/http.log"
}

check_colocate() {
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 save_strategy=no $STEPS output_dir="$WORK/colocate" use_vllm=true \
        vllm_mode=colocate vllm_gpu_memory_utilization=0.3 bf16=true 2>&1 | tee "$WORK/colocate.log"
    steps_done "$WORK/colocate" 3
}

check_sleep_mode() {
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 save_strategy=no $STEPS output_dir="$WORK/sleep" use_vllm=true \
        vllm_mode=colocate vllm_gpu_memory_utilization=0.3 bf16=true vllm_enable_sleep_mode=true 2>&1 | tee "$WORK/sleep.log"
    steps_done "$WORK/sleep" 3
    # vLLM's worker logs what each sleep freed (level 1: its weights and its KV cache), one line per step
    freed=$(grep -c "Sleep mode freed" "$WORK/sleep.log" || true)
    grep "Sleep mode freed" "$WORK/sleep.log" || true
    if [ "$freed" -lt 3 ]; then echo "gpu_checks: vLLM slept $freed times in 3 steps, expected 3" >&2; return 1; fi
}

check_free() {
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=6 save_strategy=no $STEPS output_dir="$WORK/free" bf16=true \
        max_staleness=2 async_mode=free cuda_graphs=false 2>&1 | tee "$WORK/free.log"
    free_sane "$WORK/free"
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=6 save_strategy=no $STEPS output_dir="$WORK/free_graphs" bf16=true \
        max_staleness=2 async_mode=free 2>&1 | tee "$WORK/free_graphs.log"
    free_sane "$WORK/free_graphs"
}

adapter_moved() {  # $1: a LoRA run's output_dir: its final adapter's B matrices are no longer peft's zeros
    python - "$1/adapter_model.safetensors" <<'PY'
import sys
from safetensors.torch import load_file
adapter = load_file(sys.argv[1])
moved = {k: v.abs().max().item() for k, v in adapter.items() if "lora_B" in k}
print(f"gpu_checks: {len(moved)} lora_B matrices, largest |B| {max(moved.values()):.3g}, smallest {min(moved.values()):.3g}")
assert moved and min(moved.values()) > 0, "an adapter matrix did not move from peft's zeros"
PY
}

QLORA="load_in_4bit=true use_peft=true lora_target_modules=[all-linear] beta=0.04 learning_rate=1e-4 max_steps=3"

check_qlora() {
    CUDA_VISIBLE_DEVICES=0 python "$PEAK" train demo $QLORA save_strategy=no $STEPS output_dir="$WORK/qlora" \
        bf16=true 2>&1 | tee "$WORK/qlora.log"
    grep -q "its weights are quantized (bitsandbytes)" "$WORK/qlora.log"  # the generic forward, with the reason
    steps_done "$WORK/qlora" 3
    adapter_moved "$WORK/qlora"
}

check_qlora_vllm() {
    CUDA_VISIBLE_DEVICES=0 rlvr train demo $QLORA save_strategy=no $STEPS output_dir="$WORK/qlora_vllm" bf16=true \
        use_vllm=true vllm_mode=colocate vllm_gpu_memory_utilization=0.3 2>&1 | tee "$WORK/qlora_vllm.log"
    steps_done "$WORK/qlora_vllm" 3
    adapter_moved "$WORK/qlora_vllm"
}

# --- two GPUs --------------------------------------------------------------------------------

check_nccl_one() {
    start_server 1
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 save_strategy=no $STEPS output_dir="$WORK/one" use_vllm=true \
        vllm_mode=server vllm_server_host=127.0.0.1 vllm_server_port=$PORT vllm_weight_transfer=collective \
        2>&1 | tee "$WORK/one.log"
    stop_server
    report_sync "$WORK/one" "$WORK/one.log"
}

check_nccl_two() {
    # The weight group is rank 0 and the server only (cuda:0 -> GPU 1); the trainers' own group is separate.
    start_server 1
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 -m rlvr.cli train demo max_steps=3 save_strategy=no \
        $STEPS output_dir="$WORK/two" use_vllm=true vllm_mode=server vllm_server_host=127.0.0.1 vllm_server_port=$PORT \
        vllm_weight_transfer=collective 2>&1 | tee "$WORK/two.log"
    stop_server
    report_sync "$WORK/two" "$WORK/two.log"
}

FSDP="fsdp=true beta=0.04 max_steps=4 save_steps=2 save_total_limit=2"

check_fsdp() {
    local out=$WORK/fsdp
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 "$PEAK" train demo $FSDP $STEPS output_dir="$out" \
        2>&1 | tee "$WORK/fsdp.log"
    steps_done "$out" 4
    grep "peak GPU memory" "$WORK/fsdp.log" > "$WORK/fsdp.peak"
    # checkpoint-2 is sharded (torch.distributed.checkpoint over NCCL): each rank's file, no whole model.
    test -s "$out/checkpoint-2/dcp/__0_0.distcp" && test -s "$out/checkpoint-2/dcp/__1_0.distcp"
    if ls "$out"/checkpoint-2/*.safetensors 2>/dev/null; then echo "gpu_checks: checkpoint-2 holds whole weights" >&2; return 1; fi
    # Resumed from checkpoint-2 (each rank reads its shards of the weights, the optimizer state and the
    # reference): the run goes on to step 4 on the same 2 processes.
    cp "$out/model.safetensors" "$WORK/fsdp_straight.safetensors"
    rm -rf "$out/checkpoint-4" "$out/metrics.jsonl" "$out/model.safetensors"
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 -m rlvr.cli train demo $FSDP $STEPS output_dir="$out" \
        resume=true 2>&1 | tee "$WORK/fsdp_resume.log"
    grep -q "resumed from .*checkpoint-2 at step 2" "$WORK/fsdp_resume.log"
    steps_done "$out" 4
    # NCCL's reductions need not add in the same order twice, so the two ends are compared, not required equal
    python - "$WORK/fsdp_straight.safetensors" "$out/model.safetensors" <<'PY'
import sys
from safetensors.torch import load_file
a, b = load_file(sys.argv[1]), load_file(sys.argv[2])
print(f"gpu_checks: resumed vs uninterrupted run, largest weight difference {max((a[k] - b[k]).abs().max().item() for k in a):.3g}")
PY
}

check_fsdp_offload() {
    if [ ! -s "$WORK/fsdp.peak" ]; then echo "gpu_checks: the fsdp check left no peak memory to compare with" >&2; return 1; fi
    CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 "$PEAK" train demo $FSDP $STEPS \
        output_dir="$WORK/offload" fsdp_offload_params=true 2>&1 | tee "$WORK/offload.log"
    steps_done "$WORK/offload" 4
    grep "peak GPU memory" "$WORK/offload.log" > "$WORK/offload.peak"
    python - "$WORK/fsdp.peak" "$WORK/offload.peak" <<'PY'
import re, sys
def peaks(path):
    return {int(m[1]): int(m[2]) for m in re.finditer(r"rank (\d+) peak GPU memory (\d+) MiB", open(path).read())}
kept, offloaded = peaks(sys.argv[1]), peaks(sys.argv[2])
for rank in sorted(kept):
    print(f"gpu_checks: rank {rank} peak GPU memory: fsdp {kept[rank]} MiB, with fsdp_offload_params {offloaded[rank]} MiB")
assert len(kept) == len(offloaded) == 2 and all(offloaded[r] < kept[r] for r in kept), "offloading did not lower the peak"
PY
}

run_check http 1 check_http
run_check colocate 1 check_colocate
run_check sleep_mode 1 check_sleep_mode
run_check qlora 1 check_qlora
run_check qlora_vllm 1 check_qlora_vllm
run_check free 1 check_free
run_check nccl_one 2 check_nccl_one
run_check nccl_two 2 check_nccl_two
run_check fsdp 2 check_fsdp
run_check fsdp_offload 2 check_fsdp_offload

echo "gpu_checks: passed: ${PASSED[*]:-none}; failed: ${FAILED[*]:-none}; skipped: ${SKIPPED[*]:-none}"
[ "${#FAILED[@]}" -eq 0 ]
