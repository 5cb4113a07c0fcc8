"""The optimizer settings as TRL has them (optim.py): the learning-rate schedules step by step
against transformers' own (the library TRL takes them from), their knobs checked before any model
loads, torch's three AdamW implementations, and fp16's loss scaling (GradScaler) in optimizer_step."""

import copy
import json
import os
import subprocess
import sys

import pytest
import torch
from transformers import get_scheduler

from conftest import make_tiny_model, make_tokenizer
from rlvr.config import ConfigError, build_config
from rlvr.distributed import World
from rlvr.llama import _version
from rlvr.logprobs import LogProbs
from rlvr.optim import apply_optimizer_settings, build_optimizer, loss_scaler
from rlvr.settings import check_runnable, check_settings
from rlvr.types import Batch, Rollout
from rlvr.update import MIN_LOSS_SCALE, NonFinite, backward, optimizer_step

SCHEDULES = [
    ("constant", {}),
    ("constant_with_warmup", {}),
    ("linear", {}),
    ("cosine", {}),
    ("cosine", {"num_cycles": 1.5}),
    ("cosine_with_min_lr", {"min_lr_rate": 0.1}),
    ("cosine_with_min_lr", {"min_lr": 2e-6, "num_cycles": 0.25}),
    ("polynomial", {}),
    ("polynomial", {"power": 2.0, "lr_end": 1e-6}),
]


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


def _lrs(optimizer, scheduler, steps: int) -> list[float]:
    out = []
    for _ in range(steps):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()  # no gradients: nothing moves, but the schedule may step without a warning
        scheduler.step()
    return out


@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("kind,kwargs", SCHEDULES)
def test_every_schedule_gives_transformers_learning_rate_at_every_step(kind, kwargs, warmup):
    """Past the last step too (resume with a larger max_steps continues the same formula)."""
    total, lr = 12, 2e-5
    cfg = build_config({"learning_rate": lr, "lr_scheduler_type": kind, "lr_scheduler_kwargs": kwargs,
                        "warmup_steps": warmup, "optim": "adamw_torch"})
    ours = _lrs(*build_optimizer(torch.nn.Linear(2, 2), cfg, total), total + 3)
    optimizer = torch.optim.AdamW(_params(), lr=lr)
    theirs = _lrs(optimizer, get_scheduler(kind, optimizer, warmup, total, scheduler_specific_kwargs=dict(kwargs)), total + 3)
    assert ours == pytest.approx(theirs, rel=1e-12, abs=1e-18)


def test_warmup_starts_at_zero_as_in_transformers_and_constant_has_none():
    """w = 4 warmup steps: lr x step / 4 for steps 0..3, so the first update has learning rate 0."""
    cfg = build_config({"learning_rate": 1.0, "lr_scheduler_type": "linear", "warmup_steps": 4})
    assert _lrs(*build_optimizer(torch.nn.Linear(2, 2), cfg, 8), 6) == pytest.approx([0, 0.25, 0.5, 0.75, 1.0, 0.75])
    cfg = build_config({"learning_rate": 1.0, "lr_scheduler_type": "constant", "warmup_steps": 4})
    assert _lrs(*build_optimizer(torch.nn.Linear(2, 2), cfg, 8), 3) == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("kind,kwargs,message", [
    ("linear", {"num_cycles": 1}, "'num_cycles' not known to lr_scheduler_type=linear (it takes none)"),
    ("cosine", {"min_lr_rate": 0.1, "power": 2}, "'min_lr_rate', 'power' not known to lr_scheduler_type=cosine (it takes num_cycles)"),
    ("polynomial", {"lr_end": "small"}, "lr_scheduler_kwargs.lr_end must be a number"),
    ("polynomial", {"lr_end": 1e-3}, "lr_end (0.001, default 1e-7) must be below learning_rate"),
    ("cosine_with_min_lr", {}, "needs one of lr_scheduler_kwargs.min_lr"),
    ("cosine_with_min_lr", {"min_lr": 1e-7, "min_lr_rate": 0.1}, "needs one of lr_scheduler_kwargs.min_lr"),
])
def test_schedule_knobs_are_checked_before_any_model_loads(kind, kwargs, message):
    with pytest.raises(ConfigError) as error:
        check_settings(build_config({"lr_scheduler_type": kind, "lr_scheduler_kwargs": kwargs, "learning_rate": 1e-4}))
    assert message in str(error.value)


def test_a_resumed_schedule_continues_where_it_stopped():
    """The schedule's state is its step (LambdaLR.last_epoch): a fresh optimizer and schedule that
    load the saved states give the rest of the uninterrupted run's learning rates; with
    resume_override a new learning rate applies from the same position."""
    cfg = build_config({"learning_rate": 1e-3, "lr_scheduler_type": "polynomial", "lr_scheduler_kwargs": {"power": 2.0},
                        "warmup_steps": 2})
    straight = _lrs(*build_optimizer(torch.nn.Linear(2, 2), cfg, 10), 10)
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), cfg, 10)
    first = _lrs(optimizer, scheduler, 4)
    saved = copy.deepcopy((optimizer.state_dict(), scheduler.state_dict()))
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), cfg, 10)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    assert first + _lrs(optimizer, scheduler, 6) == pytest.approx(straight)
    doubled = build_config({**cfg.to_dict(), "learning_rate": 2e-3})
    optimizer, scheduler = build_optimizer(torch.nn.Linear(2, 2), doubled, 10)
    optimizer.load_state_dict(saved[0])
    scheduler.load_state_dict(saved[1])
    apply_optimizer_settings(optimizer, scheduler, doubled)
    rest = _lrs(*build_optimizer(torch.nn.Linear(2, 2), doubled, 10), 10)[4:]
    assert _lrs(optimizer, scheduler, 6) == pytest.approx(rest)


def _sft_steps(model, optim: str, steps: int = 4) -> dict:
    """A few AdamW steps of next-token loss on fixed random tokens, with weight decay and clipping."""
    cfg = build_config({"optim": optim, "learning_rate": 1e-2, "weight_decay": 0.1, "lr_scheduler_type": "constant"})
    optimizer, scheduler = build_optimizer(model, cfg, steps)
    g = torch.Generator().manual_seed(0)
    for step in range(1, steps + 1):
        ids = torch.randint(0, model.config.vocab_size, (2, 10), generator=g)
        optimizer.zero_grad()
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer_step(model, optimizer, scheduler, 1.0, loss.item(), step)
    return {k: v.clone() for k, v in model.state_dict().items()}


def test_the_three_adamw_implementations_give_the_same_weights():
    """torch's loop, foreach and fused AdamW on CPU, fp32: the same update up to rounding
    (measured: foreach identical to the loop, fused within 2e-7 after 4 steps at lr 1e-2)."""
    start = make_tiny_model(len(make_tokenizer()))
    weights = {optim: _sft_steps(copy.deepcopy(start), optim) for optim in ("adamw_torch", "adamw_torch_foreach", "adamw_torch_fused")}
    base = weights["adamw_torch"]
    assert max((base[k] - start.state_dict()[k]).abs().max().item() for k in base) > 1e-2  # the steps did move the weights
    for optim in ("adamw_torch_foreach", "adamw_torch_fused"):
        gap = max((weights[optim][k] - base[k]).abs().max().item() for k in base)
        assert gap < 1e-5, (optim, gap)
    optimizer, _ = build_optimizer(start, build_config({"optim": "adamw_torch_fused"}), 1)
    assert optimizer.defaults["fused"] is True


def test_a_fused_step_is_seen_by_the_sampler():
    """The fused kernel leaves the parameters' version counters alone; build_optimizer bumps them,
    since the fast sampler (llama.py) rebuilds its copy of the weights only when they change."""
    model = make_tiny_model(len(make_tokenizer()))
    optimizer, scheduler = build_optimizer(model, build_config({"optim": "adamw_torch_fused", "learning_rate": 1e-2}), 4)
    before = _version(model)
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    optimizer.step()
    assert _version(model) != before


# --- fp16: refused where it cannot run, and GradScaler's path through optimizer_step ------------------------


def test_fp16_with_bf16_is_refused():
    with pytest.raises(ConfigError, match="fp16 and bf16 cannot both be true"):
        build_config({"fp16": True, "bf16": True})


def test_fp16_on_a_cpu_is_refused_before_the_model_loads():
    cfg = build_config({"fp16": True})
    with pytest.raises(ConfigError, match="fp16=true needs a CUDA GPU .* on a CPU use bf16=true"):
        check_runnable(cfg, World(device="cpu"))
    check_runnable(build_config({"bf16": True}), World(device="cpu"))  # the suggestion is runnable


def _batch(tokenizer):
    p = tokenizer("what is 2+2?", add_special_tokens=False)["input_ids"]
    c = tokenizer("the answer is 4", add_special_tokens=False)["input_ids"]
    return Batch.from_rollouts([Rollout(p, c, [0.0] * len(c), "stop", "")], torch.zeros(1), torch.ones(1, dtype=torch.bool), 0, False, 1)


def _step(model, scaler=None, autocast=None, poison=False):
    """One SFT step on a fixed completion; returns (grad norm, lr, loss)."""
    tokenizer = make_tokenizer()
    batch = _batch(tokenizer)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: 1.0 / (s + 1))
    logp, _ = LogProbs(fast=True, temperature=1.0, autocast=autocast)(model, batch)
    loss = -logp[batch.completion_mask].mean()
    backward(loss, scaler)
    if poison:
        next(model.parameters()).grad[0, 0] = float("inf")  # an fp16 overflow somewhere in the backward
    grad_norm, lr = optimizer_step(model, optimizer, scheduler, 1.0, loss.item(), 1, scaler=scaler)
    return grad_norm, scheduler.get_last_lr()[0], loss.item()


def test_a_loss_scaled_step_is_the_unscaled_step():
    """Scaling by a power of two and unscaling is exact in fp32: the same gradient norm and weights."""
    start = make_tiny_model(len(make_tokenizer()))
    plain, scaled = copy.deepcopy(start), copy.deepcopy(start)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    norm_plain, _, _ = _step(plain)
    norm_scaled, _, _ = _step(scaled, scaler)
    assert norm_scaled == pytest.approx(norm_plain, rel=1e-6)
    for (name, a), b in zip(plain.named_parameters(), scaled.parameters()):
        assert torch.allclose(a, b, rtol=0, atol=1e-7), name
    assert scaler.get_scale() == 2.0**10  # no overflow: the scale stays until growth_interval good steps


def test_an_fp16_overflow_is_a_skipped_step_not_an_error():
    """As in TRL: no update, no step of the schedule, the scale halved, the non-finite norm
    reported; the same gradients without a scaler stop the run (NonFinite)."""
    model = make_tiny_model(len(make_tokenizer()))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**10)
    grad_norm, lr_next, _ = _step(model, scaler, poison=True)
    assert grad_norm == float("inf")
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())
    assert lr_next == 1e-2  # the schedule did not move: factor 1 / (0 + 1)
    assert scaler.get_scale() == 2.0**9
    assert all(p.grad is None for p in model.parameters())
    with pytest.raises(NonFinite, match="the gradient norm inf"):
        _step(model, poison=True)


def test_overflow_at_every_scale_stops_the_run():
    model = make_tiny_model(len(make_tokenizer()))
    scaler = torch.amp.GradScaler("cpu", init_scale=MIN_LOSS_SCALE)
    with pytest.raises(NonFinite, match="overflow fp16 at every loss scale.*Try bf16=true"):
        _step(model, scaler, poison=True)


def test_fp16_autocast_and_loss_scaling_give_fp32s_gradient_within_fp16_precision():
    """The whole fp16 path on the CPU (autocast to float16 on the fast path, the scaler from the
    config): the loss and the (unscaled) gradient within fp16's precision of fp32's, the master
    weights fp32.  Not covered: fp16 on a GPU (its kernels differ; fp16 runs only there)."""
    start = make_tiny_model(len(make_tokenizer()))
    fp32, fp16 = copy.deepcopy(start), copy.deepcopy(start)
    scaler = loss_scaler(build_config({"fp16": True}), "cpu")
    assert scaler.is_enabled() and not loss_scaler(build_config({}), "cpu").is_enabled()
    norm32, _, loss32 = _step(fp32)
    norm16, _, loss16 = _step(fp16, scaler, autocast=torch.float16)
    # fp16 keeps 11 significant bits (2^-11 = 5e-4 relative per rounding); measured: loss 3e-6, gradient 5e-4
    assert loss16 != loss32 and loss16 == pytest.approx(loss32, rel=1e-3)
    assert norm16 == pytest.approx(norm32, rel=5e-3)
    g32 = torch.cat([p.grad.flatten() for p in fp32.parameters()])
    g16 = torch.cat([p.grad.flatten() for p in fp16.parameters()])
    assert (g16 - g32).norm() / g32.norm() < 5e-3
    assert all(p.dtype == torch.float32 for p in fp16.parameters())


def test_an_fp16_trainer_steps_through_its_scaler_and_checkpoints_it(tiny, tmp_path):
    """The Trainer's wiring (built directly: the CPU refusal is check_runnable's, before a run):
    fp16 log-probs under float16 autocast, each optimizer step through the scaler, whose state is a
    checkpoint part; a run without fp16 saves none."""
    from rlvr.checkpoint import restore_trainer_state
    from rlvr.trainer import Trainer
    from rlvr.types import Example
    from test_trainer import make_batch

    model, tokenizer = tiny

    def trainer(**kw):
        cfg = build_config({"model": "default", "learning_rate": 1e-3, "num_generations": 2, **kw})
        return Trainer(cfg, model, tokenizer, [Example("What is 1+1?", "2")], output_dir=tmp_path, total_steps=10)

    fp16 = trainer(fp16=True)
    assert fp16.logprobs.autocast_dtype == torch.float16
    assert fp16.update(make_batch(fp16))["grad_norm"] > 0
    assert fp16.scaler.state_dict()["_growth_tracker"] == 1  # one step went through scaler.update()
    fp16.scaler.update(new_scale=128.0)
    state = fp16.state_dict()
    resumed = trainer(fp16=True)
    restore_trainer_state(state, resumed._parts())
    assert resumed.scaler.get_scale() == 128.0
    assert "scaler" not in trainer().state_dict()


def test_weight_decay_spares_biases_and_norm_weights_as_transformers_does(tiny):
    """The decayed parameters are exactly those transformers' Trainer decays (get_decay_parameter_names)."""
    from transformers import Trainer

    from rlvr.optim import param_groups

    model, _ = tiny
    groups = param_groups(model, 0.1)
    names = {id(p): n for n, p in model.named_parameters()}
    theirs = {id(model.get_parameter(n)) for n in Trainer.get_decay_parameter_names(None, model)}  # tied weights: one
    assert {id(p) for p in groups[0]["params"]} == theirs
    assert groups[1]["weight_decay"] == 0.0 and any("norm" in names[id(p)] for p in groups[1]["params"])
    assert len(param_groups(model, 0.0)) == 1  # no decay: one group, as checkpoints before this had


def test_bf16_on_a_cpu_without_bf16_instructions_is_named(monkeypatch):
    """A CPU with AVX2 only (as some machines of this project's kind are) has no bf16 kernel: a run
    says so when it starts.  With AVX-512 BF16 or AMX, on a GPU, or in fp32 there is nothing to say."""
    from rlvr.runtime import slow_bf16_note

    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: False)
    monkeypatch.setattr(torch.cpu, "_is_amx_tile_supported", lambda: False)
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    note = slow_bf16_note(True, "cpu")
    assert note.startswith("bf16=true on a CPU without bf16 matmul instructions (torch reports AVX2") and "set bf16=false" in note
    assert slow_bf16_note(False, "cpu") is None and slow_bf16_note(True, "cuda:0") is None
    monkeypatch.setattr(torch.cpu, "_is_avx512_bf16_supported", lambda: True)
    assert slow_bf16_note(True, "cpu") is None


KEPT_THEN_RELEASED = """
import json
from pathlib import Path
import torch
from rlvr.runtime import configure_allocator, map_large_blocks, release_free_memory

def rss():
    return next(int(l.split()[1]) for l in Path("/proc/self/status").read_text().splitlines() if l.startswith("VmRSS:")) // 1024

def blocks():
    return [torch.ones(1 << 20) for _ in range(100)]  # 100 x 4 MiB

assert configure_allocator()
keep = [torch.ones(1000)]  # live beside the freed blocks
# first mapped (fsdp's sharded phases), while the heap holds no free block they could reuse
mapped = map_large_blocks(True)
held = blocks()
keep.append(torch.ones(1000))
mapped_full = rss()
del held
mapped_freed = rss()
map_large_blocks(False)  # then kept (configure_allocator's setting)
held = blocks()
keep.append(torch.ones(1000))
full = rss()
del held
kept = rss()
ran = release_free_memory()
print(json.dumps({"mapped": mapped, "mapped_full": mapped_full, "mapped_freed": mapped_freed, "full": full, "kept": kept,
                  "released": rss(), "ran": ran}))
"""


@pytest.mark.processes
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's allocator")
def test_memory_kept_for_reuse_is_given_back_between_phases(tmp_path):
    """configure_allocator keeps freed memory in the heap (fast on the CPU); release_free_memory, which
    fsdp calls between sampling and the update, gives it back: 400 MiB freed stay resident until then;
    map_large_blocks(True), which fsdp turns on outside sampling, gives each large block back when freed."""
    out = subprocess.run([sys.executable, "-c", KEPT_THEN_RELEASED], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    # map_large_blocks(True) (fsdp's sharded phases): each large block leaves the moment it is freed
    assert seen["mapped"] and seen["mapped_freed"] < seen["mapped_full"] - 300, seen
    assert seen["ran"] and seen["full"] > seen["mapped_freed"] + 300 and seen["kept"] > seen["full"] - 50, seen  # freed, but kept
    assert seen["released"] < seen["kept"] - 300, seen  # given back
