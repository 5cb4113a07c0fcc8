#!/usr/bin/env bash
# GPU checks that cannot run on the CPU machine.  Needs CUDA GPUs (2 for NCCL), vLLM installed (pip install vllm)
# and rlvr on PATH.  Run from the repository root:  bash benchmarks/gpu_checks.sh
#
# vllm_weight_transfer=collective over NCCL (rollout/collective.py):
#   1. one process: `rlvr vllm-serve` on GPU 1, `rlvr train` on GPU 0, 3 steps;
#   2. two training processes (torchrun, ranks on GPUs 0 and 1) + the same server; only rank 0 joins its group.
# Each prints the weight_sync_seconds / weight_sync_bytes that metrics.jsonl logged, and fails
# if the run fell back to HTTP (the trainer's "vllm_weight_transfer=collective failed" line).
set -euo pipefail

PORT=${PORT:-8123}
WORK=$(mktemp -d)
SERVER_PID=
cleanup() {
    if [ -n "$SERVER_PID" ]; then kill "$SERVER_PID" 2>/dev/null || true; wait "$SERVER_PID" 2>/dev/null || true; fi
    rm -rf "$WORK"
}
trap cleanup EXIT

GPUS=$(python -c "import torch; print(torch.cuda.device_count())")
if [ "$GPUS" -lt 1 ]; then echo "gpu_checks: needs a CUDA GPU, found none" >&2; exit 1; fi

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

report() {  # $1: the run's output_dir, $2: the trainer's log
    if grep -q "vllm_weight_transfer=collective failed" "$2"; then
        echo "gpu_checks: FAILED: the run fell back to HTTP:" >&2; grep "collective failed" "$2" >&2; return 1
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

if [ "$GPUS" -eq 1 ]; then
    # One GPU (the machine this project is lent): NCCL cannot join two processes on one GPU, so the
    # weights go over HTTP (bf16, streamed); the trainer and the server share the GPU.
    start_server 0 0.3
    echo "== 1 GPU: a training process and rlvr vllm-serve on GPU 0, weights over HTTP"
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 logging_steps=1 save_strategy=no output_dir="$WORK/http" \
        use_vllm=true vllm_mode=server vllm_server_host=127.0.0.1 vllm_server_port=$PORT bf16=true 2>&1 | tee "$WORK/http.log"
    report "$WORK/http" "$WORK/http.log"
    echo "== 1 GPU: vLLM colocated in the training process"
    CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 logging_steps=1 save_strategy=no output_dir="$WORK/colocate" \
        use_vllm=true vllm_mode=colocate vllm_gpu_memory_utilization=0.3 bf16=true 2>&1 | tee "$WORK/colocate.log"
    echo "gpu_checks: done (one GPU: NCCL weight transfer and several GPU processes need 2 GPUs)"
    exit 0
fi

start_server 1

echo "== 1. one training process on GPU 0, NCCL to the server on GPU 1"
CUDA_VISIBLE_DEVICES=0 rlvr train demo max_steps=3 logging_steps=1 save_strategy=no output_dir="$WORK/one" \
    use_vllm=true vllm_mode=server vllm_server_host=127.0.0.1 vllm_server_port=$PORT vllm_weight_transfer=collective \
    2>&1 | tee "$WORK/one.log"
report "$WORK/one" "$WORK/one.log"

echo "== 2. two training processes (torchrun): rank 0 on GPU 0, rank 1 on GPU 1 beside the server"
# The weight group is rank 0 and the server only (cuda:0 -> GPU 1); the trainers' own group is separate.
CUDA_VISIBLE_DEVICES=0,1 torchrun --standalone --nproc_per_node 2 -m rlvr.cli train demo max_steps=3 logging_steps=1 \
    save_strategy=no output_dir="$WORK/two" use_vllm=true vllm_mode=server vllm_server_host=127.0.0.1 \
    vllm_server_port=$PORT vllm_weight_transfer=collective 2>&1 | tee "$WORK/two.log"
report "$WORK/two" "$WORK/two.log"
echo "gpu_checks: done"
