"""Completion tokens per second when one and when two trainer processes sample from one server:
rlvr's own server (`rlvr vllm-serve`, one request at a time) against vLLM's own server
(`rlvr vllm-serve vllm_server_impl=vllm`, concurrent requests batched by vLLM).

    .venv-vllm/bin/python benchmarks/vllm_concurrency.py                # both servers, 3 rounds each
    .venv-vllm/bin/python benchmarks/vllm_concurrency.py --impl vllm --rounds 5 --prompts 16

Each process is the trainer's sampler (rollout/vllm_client.VLLMServers) asking for --prompts groups of
--generations completions of up to --tokens tokens, the demo's sampling settings (temperature 1),
each group with its own seed; both processes start at the same instant.  Tokens/s is every
completion token both processes received over the wall time from that instant to the last reply;
the ratio is two processes' tokens/s over one's.  The servers run the default model in float32 on
every core of this machine (VLLM_CPU_NUM_OF_RESERVED_CPU=0: vLLM's CPU engine would otherwise leave one
core to its API process); the trainer processes only wait on HTTP while sampling.  RLVR_SERVE_LOG=path
keeps the server's log there.  Needs vLLM: `make vllm`.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def start_server(impl: str, log: Path) -> tuple[subprocess.Popen, str]:
    import re

    cmd = [sys.executable, "-m", "rlvr.cli", "vllm-serve", "vllm_server_port=0", "vllm_server_host=127.0.0.1",
           "vllm_kv_cache_gb=0.5", "max_prompt_length=256", "max_completion_length=256", f"vllm_server_impl={impl}"]
    with open(log, "w") as out:
        # vLLM's CPU engine keeps one core for its API process by default; rlvr's server runs on every core: both on every core
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONWARNINGS": "ignore", "VLLM_CPU_NUM_OF_RESERVED_CPU": "0"})
    for _ in range(600):
        found = re.search(r"rlvr vllm-serve: .*?(http://127\.0\.0\.1:\d+)", log.read_text())
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.5)
    raise SystemExit(f"the {impl} server did not start:\n{log.read_text()[-3000:]}")


def wait_ready(url: str, proc: subprocess.Popen, log: Path) -> None:
    import urllib.request

    for _ in range(900):
        try:
            urllib.request.urlopen(url + "/health", timeout=5).read()
            return
        except OSError:
            if proc.poll() is not None:
                raise SystemExit(f"the server at {url} stopped:\n{log.read_text()[-3000:]}") from None
            time.sleep(2)
    raise SystemExit(f"the server at {url} never answered")


def child(url: str, prompts: int, generations: int, tokens: int, seed: int, start_at: float) -> dict:
    """One trainer process: sample once (after start_at), and report the completion tokens and the time it ended."""
    from rlvr.models import DEFAULT_MODEL, load_tokenizer, resolve_model_path
    from rlvr.rollout import SamplingParams
    from rlvr.rollout.sampling import GroupGenerators
    from rlvr.rollout.vllm_client import VLLMServers

    tok = load_tokenizer(resolve_model_path(DEFAULT_MODEL))
    servers = VLLMServers([url], tok, [tok.eos_token_id], timeout=600)
    texts = [tok.apply_chat_template([{"role": "user", "content": f"What is {seed * 100 + i} plus {i + 7}? Think step by step."}],
                                     tokenize=False, add_generation_prompt=True) for i in range(prompts)]
    ids = [tok(t, add_special_tokens=False)["input_ids"] for t in texts]
    params = SamplingParams(n=generations, max_tokens=tokens, temperature=1.0)
    time.sleep(max(0.0, start_at - time.time()))
    groups = servers.generate(ids, params, GroupGenerators([seed * 1000 + i for i in range(prompts)]))
    return {"tokens": sum(len(r.completion_ids) for g in groups for r in g), "end": time.time()}


def measure(url: str, processes: int, ns, round_: int) -> float:
    start_at = time.time() + 20.0  # after every child has imported torch and built its sampler
    with tempfile.TemporaryDirectory(prefix="rlvr-conc-") as scratch:
        procs = [subprocess.Popen([sys.executable, __file__, "--child", url, str(ns.prompts), str(ns.generations), str(ns.tokens),
                                   str(round_ * 10 + p + 1), str(start_at), str(Path(scratch) / f"{p}.json")],
                                  env={**os.environ, "PYTHONWARNINGS": "ignore"}) for p in range(processes)]
        if any(p.wait() != 0 for p in procs):
            raise RuntimeError("a sampling process failed")
        results = [json.loads((Path(scratch) / f"{p}.json").read_text()) for p in range(processes)]
    if time.time() < start_at:
        raise SystemExit("increase the start delay")
    return sum(r["tokens"] for r in results) / (max(r["end"] for r in results) - start_at)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--impl", choices=["rlvr", "vllm", "both"], default="both")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--prompts", type=int, default=8, help="groups each process asks for")
    ap.add_argument("--generations", type=int, default=4)
    ap.add_argument("--tokens", type=int, default=128)
    ap.add_argument("--child", nargs=7, help=argparse.SUPPRESS)
    ns = ap.parse_args()
    if ns.child:
        url, prompts, gens, tokens, seed, start_at, out = ns.child
        Path(out).write_text(json.dumps(child(url, int(prompts), int(gens), int(tokens), int(seed), float(start_at))))
        return
    print(f"{'server':<8} {'1 process tok/s':>16} {'2 processes tok/s':>18} {'ratio':>6}   (median of {ns.rounds} rounds; "
          f"{ns.prompts} groups x {ns.generations} x <= {ns.tokens} tokens per process)")
    for impl in (["rlvr", "vllm"] if ns.impl == "both" else [ns.impl]):
        with tempfile.TemporaryDirectory(prefix="rlvr-conc-serve-") as logs:
            log = Path(os.environ.get("RLVR_SERVE_LOG", Path(logs) / "serve.log"))
            proc, url = start_server(impl, log)
            try:
                wait_ready(url, proc, log)
                one, two = [], []
                for r in range(ns.rounds):
                    one.append(measure(url, 1, ns, r))
                    two.append(measure(url, 2, ns, r))
                    print(f"  {impl} round {r + 1}: {one[-1]:.1f} / {two[-1]:.1f} tok/s", flush=True)
            except RuntimeError as e:
                raise SystemExit(f"{e}; the server's log ends:\n{log.read_text()[-5000:]}") from None
            finally:
                proc.terminate()
                proc.wait(timeout=120)
        a, b = statistics.median(one), statistics.median(two)
        print(f"{impl:<8} {a:16.1f} {b:18.1f} {b / a:6.2f}", flush=True)


if __name__ == "__main__":
    main()
