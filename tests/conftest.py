"""Shared fixtures: a tiny random Llama with a character-level tokenizer and a chat template.

It loads through the same code path as any local model directory, in well
under a second, so the logic of the whole pipeline can be tested on CPU.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch

import warm

CHARS = list("abcdefghijklmnopqrstuvwxyz0123456789 +-*=?.,{}\\<>/\n")
SPECIALS = ["<pad>", "<|im_start|>", "<|im_end|>", "<unk>"]
CHAT_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def pytest_configure(config):
    """Everything the tests and the libraries under them write to a temporary directory (pytest's
    tmp_path, torchrun's logs, Ray's sessions, the inductor cache, vLLM's files) goes to one
    directory, removed when the session ends: CI's /tmp is left as it was found. Set
    RLVR_KEEP_TMP=1 to keep it for a look at a failure.

    `make test` runs the suite in two pytest-xdist workers (`-n 2`), one per core, each with one torch
    thread: the tiny models gain nothing from a second thread (the training tests took 74 s with two
    threads and 74 s with one), so two tests side by side halve the time. A worker, started by the
    main process after this hook ran there, writes to a folder of its own in that directory (tests look
    for what they left behind there); Ray's sessions stay at the top, its socket paths must be short."""
    torch.set_num_threads(1)
    os.environ["OMP_NUM_THREADS"] = "1"  # and the processes the tests start
    worker = os.environ.get("PYTEST_XDIST_WORKER")
    if worker:
        own = os.path.join(os.environ["TMPDIR"], worker)
        os.makedirs(own, exist_ok=True)
        os.environ["TMPDIR"] = tempfile.tempdir = own
        return
    root = tempfile.mkdtemp(prefix="rlvr-tests-")
    os.environ.update(TMPDIR=root, RAY_TMPDIR=root, TORCHINDUCTOR_CACHE_DIR=os.path.join(root, "inductor"))
    tempfile.tempdir = root
    config.rlvr_tmp = root


def pytest_unconfigure(config):
    warm.stop()
    root = getattr(config, "rlvr_tmp", None)
    if root and not os.environ.get("RLVR_KEEP_TMP"):
        shutil.rmtree(root, ignore_errors=True)


# The modules that take longest (seconds in `make test`, --durations=0, 2026-12-06), run first: with
# `--dist loadscope --no-loadscope-reorder` (make test) each xdist worker takes whole modules in this
# order, so the long ones start at once and the many short ones fill in at the end, instead of
# xdist's default order (most tests first) leaving a long module to run alone at the end.  The
# modules of ONE_LANE (two training processes a launch) go to one worker together, so that the two
# cores never hold two such launches at once beside each other.
LONGEST_FIRST = ["test_distributed.py", "test_fsdp_runs.py", "test_chaos.py", "test_end_to_end.py", "test_trl_differential.py",
                 "test_workers.py", "test_trl_scripts.py",
                 # few tests but a long one each: started early, so none is left running alone at the end
                 "test_learning_benchmark.py", "test_math_hostile.py", "test_check.py", "test_humaneval.py",
                 "test_trainer_callbacks.py"]
ONE_LANE = ("tests/test_distributed.py", "tests/test_fsdp_runs.py")


def pytest_xdist_make_scheduler(config, log):
    """xdist's loadscope, with the modules of ONE_LANE one scope (module fixtures work as before)."""
    if config.getoption("dist") != "loadscope":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class OneLane(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            scope = super()._split_scope(nodeid)
            return ONE_LANE[0] if scope in ONE_LANE else scope

    return OneLane(config, log)


def pytest_collection_modifyitems(config, items):
    """A test marked neither `trains` nor `processes` is a unit test: `pytest -m unit` (make test-fast).
    The modules in LONGEST_FIRST come first, then the others, most tests first (xdist's own order)."""
    for item in items:
        if item.get_closest_marker("trains") is None and item.get_closest_marker("processes") is None:
            item.add_marker(pytest.mark.unit)
    sizes: dict[str, int] = {}
    for item in items:
        sizes[item.path.name] = sizes.get(item.path.name, 0) + 1
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}
    items.sort(key=lambda item: (rank.get(item.path.name, len(rank)), -sizes[item.path.name], str(item.path)))


# The modules that look at report.html and its plots, or run everything as a user would: their runs draw them.
DRAW_REPORTS = ("test_report.py", "test_audit.py", "test_end_to_end.py")


@pytest.fixture(autouse=True)
def _no_report_drawing(request, monkeypatch):
    """Training runs in this process draw no report (rlvr.loop.LiveReport), outside DRAW_REPORTS: its
    plots cost about 0.8 s a run, a third or more of a module of short runs' time (test_resume,
    test_step_faults, test_timeline, test_interrupts: 121 s with them, 41 s without, 93 reports)."""
    if request.node.path.name in DRAW_REPORTS:
        return
    from rlvr.loop import LiveReport

    monkeypatch.setattr(LiveReport, "refresh", lambda self: None)


def launch_ranks(argv: list[str], processes: int, timeout: float, env: dict | None = None) -> subprocess.CompletedProcess:
    """`python argv` as `processes` training processes, each with the environment torchrun gives its
    workers (RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT: all rlvr reads),
    without torchrun's agent process, which costs 2.6 s of CPU a launch on the 2-core machine, each
    forked from an interpreter that has imported torch and rlvr already (warm.py: 5 s of CPU less).  As
    torchrun does, the others are stopped when one fails.  Returns rank 0's stdout, every rank's stderr
    and the exit code of the first rank to fail (0 when all succeed); a launch still running at
    `timeout` is killed whole and fails the test."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    base = {**os.environ, **(env or {}), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "WORLD_SIZE": str(processes),
            "LOCAL_WORLD_SIZE": str(processes)}
    with tempfile.TemporaryDirectory() as logs:
        procs = [warm.Process(argv, str(Path(logs) / f"{rank}.out"), str(Path(logs) / f"{rank}.err"),
                              {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}) for rank in range(processes)]
        deadline, timed_out = time.monotonic() + timeout, False
        try:
            while None in [p.poll() for p in procs]:  # every rank polled (any() would stop at the first running)
                failed = [p.returncode for p in procs if p.returncode not in (None, 0)]
                timed_out = time.monotonic() > deadline
                if failed or timed_out:
                    code = failed[0] if failed else None  # the first to fail, not the ranks stopped after it
                    break
                time.sleep(0.1)
            else:
                code = next((p.returncode for p in procs if p.returncode), 0)
        finally:  # also when the test itself is interrupted: no rank is left running
            for p in procs:
                if p.poll() is None:
                    p.kill_session()
            for p in procs:
                p.wait()
        stdout = (Path(logs) / "0.out").read_text()
        stderr = "".join((Path(logs) / f"{rank}.err").read_text() for rank in range(processes))
    if timed_out:
        pytest.fail(f"{processes} processes of {' '.join(argv[:3])}... still ran after {timeout} s:\n{stdout[-3000:]}{stderr[-3000:]}")
    return subprocess.CompletedProcess([sys.executable, *argv], code, stdout, stderr)


def start_vllm_serve(log: Path, *settings: str, timeout: float = 120) -> tuple[subprocess.Popen, str]:
    """`rlvr vllm-serve` on a free port (vllm_server_port=0) in a subprocess logging to `log`, and
    its URL, read from the first line it prints (before vLLM loads; the caller waits for /health)."""
    cmd = [sys.executable, "-m", "rlvr.cli", "vllm-serve", "vllm_server_port=0", "vllm_server_host=127.0.0.1", *settings]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT)
    t0 = time.perf_counter()
    while time.perf_counter() - t0 < timeout:
        found = re.search(r"rlvr vllm-serve: .*(http://127\.0\.0\.1:\d+)", log.read_text())  # rlvr's server or vLLM's
        if found:
            return proc, found.group(1)
        if proc.poll() is not None:
            break
        time.sleep(0.2)
    proc.kill()
    proc.wait()
    raise RuntimeError(f"rlvr vllm-serve did not say where it listens (exit {proc.returncode}):\n{log.read_text()[-3000:]}")


def make_tokenizer(chars=None):
    """The tiny models' character tokenizer (over `chars`, default CHARS) with a ChatML template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIALS + (chars or CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    tok.add_special_tokens(SPECIALS)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<|im_end|>", bos_token="<|im_start|>", unk_token="<unk>"
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def tiny_llama_config(vocab_size: int, **overrides):
    """The tiny models' Llama shape: 2 layers of width 32, 4 heads over 2 key-value heads."""
    from transformers import LlamaConfig

    return LlamaConfig(**{"vocab_size": vocab_size, "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
                          "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
                          "tie_word_embeddings": True, "pad_token_id": 0, "eos_token_id": 2, "bos_token_id": 1, **overrides})


def make_tiny_model(vocab_size: int, seed: int = 0):
    from transformers import LlamaForCausalLM

    torch.manual_seed(seed)
    return LlamaForCausalLM(tiny_llama_config(vocab_size))


def save_tiny_model(tokenizer, path):
    """A tiny model over `tokenizer`'s vocabulary saved with it in `path`, usable as model=<path>; `path`."""
    make_tiny_model(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory):
    """A saved tiny model + tokenizer directory, usable as model=<path>."""
    return save_tiny_model(make_tokenizer(), tmp_path_factory.mktemp("tiny-llama"))


def make_tiny_classifier(vocab_size: int, num_labels: int = 1, seed: int = 0):
    """A tiny random Llama sequence classifier: a reward model when num_labels is 1."""
    from transformers import LlamaForSequenceClassification

    torch.manual_seed(seed)
    # 512 positions: it reads the default model's prompts and completions, a character a token
    config = tiny_llama_config(vocab_size, max_position_embeddings=512, tie_word_embeddings=False, num_labels=num_labels,
                               pad_token_id=None)
    return LlamaForSequenceClassification(config).eval()  # no pad_token_id: the reward side must tell it the tokenizer's


@pytest.fixture(scope="session")
def tiny_reward_model_dir(tmp_path_factory):
    """A saved tiny random reward model (num_labels 1) with the tiny tokenizer: reward_funcs=[<path>]."""
    path = tmp_path_factory.mktemp("tiny-rm")
    tokenizer = make_tokenizer()
    make_tiny_classifier(len(tokenizer)).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def tiny_run_config(tiny_model_dir):
    """A factory: tiny_run_config(output_dir, **settings) is the Config of a short run of the tiny
    model (4 steps of 2 prompts x 4 completions, 6 tokens each, a checkpoint every 2 steps, no
    held-out evaluation), with the test's own settings over these."""
    from rlvr.config import build_config

    def make(output_dir, **settings):
        return build_config({
            "model": str(tiny_model_dir), "task_args": {"digits": 2, "num_train": 50, "num_test": 8},
            "reward_funcs": ["boxed_format"], "num_generations": 4, "per_device_train_batch_size": 8,
            "max_completion_length": 6, "learning_rate": 1e-3, "max_steps": 4, "save_steps": 2, "logging_steps": 1,
            "eval_on_start": False, "eval_on_end": False, "output_dir": str(output_dir), **settings,
        })

    return make


@pytest.fixture
def tiny(tiny_model_dir):
    """(model, tokenizer) freshly loaded from the tiny model directory."""
    from rlvr.models import load_model

    model, tokenizer, _ = load_model(str(tiny_model_dir))
    return model, tokenizer


def stop_in_update(monkeypatch, step: int, before=None):
    """Make Trainer.update raise KeyboardInterrupt in the update that follows step `step` (as Ctrl-C there
    would), after before(trainer) where given (a check, or a wait); returns a function that puts the
    update back, for the resumed run."""
    from rlvr.trainer import Trainer

    original = Trainer.update

    def update(self, batch, *rest):
        if self.step == step:
            if before is not None:
                before(self)
            raise KeyboardInterrupt
        return original(self, batch, *rest)

    monkeypatch.setattr(Trainer, "update", update)
    return lambda: monkeypatch.setattr(Trainer, "update", original)


def metrics_rows(out) -> list[dict]:
    """A run directory's metrics.jsonl, a dict per row."""
    import json

    return [json.loads(line) for line in (Path(out) / "metrics.jsonl").read_text().splitlines()]


def free_running_run(model_dir, tmp_path, **settings) -> list[dict]:
    """A free-running run (async_mode=free, max_staleness=2) of the tiny model at `model_dir`, learning to
    start its completions with a 7 (about 1 in 20 at first); `settings` over these; its metrics rows."""
    from rlvr.config import build_config
    from rlvr.run import train

    plugin = tmp_path / "seven.py"
    plugin.write_text("def starts_with_seven(completions, **kw):\n    return [float(c.startswith('7')) for c in completions]\n")
    out = tmp_path / "run"
    train(build_config({
        "model": str(model_dir), "task_args": {"digits": 2, "num_train": 200, "num_test": 10},
        "reward_funcs": [f"{plugin}:starts_with_seven"], "per_device_train_batch_size": 64, "learning_rate": 1e-2,
        "logging_steps": 1, "save_steps": 1000, "eval_on_start": False, "eval_on_end": False, "max_staleness": 2,
        "async_mode": "free", **settings, "output_dir": str(out),
    }))
    return metrics_rows(out)
