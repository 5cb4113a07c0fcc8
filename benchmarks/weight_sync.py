"""Bytes and seconds of one weight sync, trainer -> `rlvr vllm-serve`, for the default model, and
what that projects to for a 7B model.

    .venv-vllm/bin/python benchmarks/weight_sync.py [--repeats 3] [--servers 2]

Starts `rlvr vllm-serve` (float32, the same in bfloat16, and one that takes LoRA adapters), then
times VLLMServers.update_weights: the stream leaving the trainer, the relay down the chain of
servers and vLLM loading the weights, until the last server has answered.  Prints bytes, seconds,
MB/s, and the projection for Qwen2.5-7B (7.62e9 parameters; LoRA r=16 on every linear layer:
40.4e6 parameters) at the throughput measured here.  One run on a shared machine is a rough
figure: say so when quoting it.
"""

from __future__ import annotations

import argparse
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

QWEN7B_PARAMS = 7.62e9
QWEN7B_LORA16 = 28 * 16 * (2 * (3584 + 3584) + 2 * (3584 + 512) + 3 * (3584 + 18944))  # q, o; k, v; gate, up, down


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start(count: int, logs: Path, *settings: str):
    procs, urls = [], []
    for i in range(count):
        port = free_port()
        log = open(logs / f"serve-{port}.log", "w")
        procs.append(subprocess.Popen([sys.executable, "-m", "rlvr.cli", "vllm-serve", f"vllm_server_port={port}",
                                       "vllm_server_host=127.0.0.1", "vllm_kv_cache_gb=0.25", "max_prompt_length=256",
                                       "max_completion_length=256", *settings], stdout=log, stderr=subprocess.STDOUT))
        urls.append(f"http://127.0.0.1:{port}")
    return procs, urls


def measure(name: str, urls: list[str], model, tokenizer, eos, repeats: int) -> tuple[int, float]:
    from rlvr.rollout.vllm_client import VLLMServers

    pool = VLLMServers(urls, tokenizer, eos, timeout=600)
    times = []
    for _ in range(repeats):
        pool.update_weights(model)
        times.append(pool.last_sync[1])
    sent, best = pool.last_sync[0], min(times)
    print(f"{name:<38} {sent / 1e6:9.1f} MB  {best:6.2f} s (best of {repeats}: {', '.join(f'{t:.2f}' for t in times)})"
          f"  {sent / 1e6 / best:7.1f} MB/s", flush=True)
    return sent, best


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--servers", type=int, default=2)
    args = parser.parse_args()
    from rlvr.config import build_config
    from rlvr.lora import wrap
    from rlvr.models import eos_token_ids, load_model

    model, tokenizer, path = load_model("default", "float32")
    eos = eos_token_ids(model, tokenizer)
    with tempfile.TemporaryDirectory(prefix="rlvr-sync-") as tmp:
        logs = Path(tmp)
        results = {}
        for name, settings in (("float32", ()), ("bfloat16", ("dtype=bfloat16",)), ("lora", ("use_peft=true", "lora_r=16"))):
            procs, urls = start(args.servers, logs, *settings)  # one kind at a time: two vLLM servers fit in 24 GB
            try:
                if name == "lora":
                    model = wrap(model, build_config({"use_peft": True, "lora_r": 16}), path)
                what = "LoRA r=16 adapter" if name == "lora" else f"full model, {name}"
                results[name] = measure(f"{what}, {args.servers} server(s)", urls, model, tokenizer, eos, args.repeats)
            finally:
                for p in procs:
                    p.terminate()
                for p in procs:
                    p.wait(timeout=60)
    rate = results["bfloat16"][0] / results["bfloat16"][1]
    full7b, lora7b = QWEN7B_PARAMS * 2, QWEN7B_LORA16 * 4
    print(f"\nprojection for Qwen2.5-7B at the bf16 rate measured here ({rate / 1e6:.0f} MB/s): full model "
          f"{full7b / 1e9:.1f} GB in {full7b / rate:.0f} s; LoRA r=16 adapter (fp32) {lora7b / 1e6:.0f} MB in {lora7b / rate:.2f} s")
    print(f"at 10 Gb/s (1.25 GB/s) between nodes: full model {full7b / 1.25e9:.0f} s, adapter {lora7b / 1.25e9:.2f} s")


if __name__ == "__main__":
    main()
