"""Seconds per GRPO step on 8 GPUs (4 sampling, 4 training) under three schedules: a discrete-event simulation.

    python benchmarks/async_sim.py [--steps 40 --warmup 10 --seed 0 --staleness 1 2 4 --json]

Every figure it prints is simulated from the assumptions below, not measured on a GPU.

The model
- A step trains on B prompts x G completions (defaults 64 x 8 = 512); a group is the G completions of one
  prompt and is ready only when all G are done.  Completion lengths are lognormal (median 1,500 tokens,
  sigma 1.0), rounded and clipped to [1, max_completion_length = 16,384]: long-tailed like a reasoning model's.
- Each rollout GPU is one inference engine with continuous batching: up to max_concurrency (256) sequences
  in flight, a decode iteration takes t(n) = a + b*n seconds for n sequences and gives each of them one
  token; a sequence joins or leaves at an iteration boundary, a group runs on one engine.  Defaults
  a = 15 ms, b = 0.27 ms: one sequence alone gets 65 tokens/s, 256 together 3,040 tokens/s per GPU.  These
  are assumptions for a 7B model on an H100-class GPU, not measurements.  Prefill, context length and the
  KV-cache limit are left out.
- Training costs (completion tokens of the batch) / train_rate seconds on the 4 training GPUs; the default,
  12,000 tokens/s, puts 76% of a sync step in rollout, inside the 70-85% reported for long-CoT RLVR: ~70% of
  a DAPO-32B step (verl, https://verl.readthedocs.io/en/latest/advance/one_step_off.html), up to 70% with
  16k-token rollouts (SortedRL, arXiv 2603.23414), ~85% in a ByteDance production trace (TLT, "Taming the
  long tail", https://chatpaper.com/paper/211522).
- After each optimizer step the trainer pushes its weights: push_time (default 2 s, a guess for 7B over
  NCCL) on the trainer, and push_time on each rollout GPU when it loads them (at once in sync and partial,
  after draining in async).  The trainer's step ends when its push does; version v = weights after v steps.

The schedules
- sync: all B groups start together with the newest weights; when the last completion is done the trainer
  trains, then pushes; rollout GPUs wait during training, the trainer during sampling.
- async k (max staleness k): engines keep admitting groups while fewer than (k+1)*B are started but not yet
  trained (the bounded queue); the trainer takes ready groups in the order they finished and drops any whose
  weight version (its engine's when it started) lags the trainer's by more than k.  A push does not
  interrupt a completion: an engine stops admitting, lets its in-flight completions finish on the old
  weights (vLLM's pause mode "wait", verl's fully-async mode without partial rollout), then loads the
  newest weights and admits again, so every group has one weight version.
- partial k: the same queue, but at a push every engine pauses its in-flight completions at the next
  iteration boundary, loads the weights (push_time) and continues them with the new weights (vLLM's pause
  mode "keep", as in OpenRLHF's --partial_rollout, verl's partial_rollout, Kimi k1.5, AReaL): the time window
  of a step is the time between two pushes, tokens of one completion can carry several weight versions, and
  nothing is dropped.  Staleness is per token: trainer version at the update minus the token's version.
  With k = 0 both async schedules degenerate to sync.

Columns: seconds per step and idle shares are over the steps after the warm-up; "idle" means waiting for
work (neither computing nor moving weights), averaged over the rollout GPUs for the sampler.
"""

from __future__ import annotations

import argparse
import heapq
import json
import math
from collections import deque
from dataclasses import asdict, dataclass

import numpy as np


@dataclass(frozen=True)
class Setup:
    prompts: int = 64  # B
    generations: int = 8  # G
    rollout_gpus: int = 4
    max_concurrency: int = 256  # sequences in flight per rollout GPU
    decode_a: float = 0.015  # seconds per decode iteration, fixed part
    decode_b: float = 0.00027  # seconds per decode iteration per sequence in flight
    length_median: float = 1500.0
    length_sigma: float = 1.0
    max_completion_length: int = 16384
    train_rate: float = 12000.0  # completion tokens per second trained on the 4 training GPUs
    push_time: float = 2.0  # seconds to move the weights to the rollout GPUs
    steps: int = 40
    warmup: int = 10
    seed: int = 0

    def __post_init__(self):
        if self.generations > self.max_concurrency:
            raise ValueError(f"a group ({self.generations} completions) must fit on one engine "
                             f"(max_concurrency={self.max_concurrency})")
        if not 0 <= self.warmup < self.steps:
            raise ValueError(f"need 0 <= warmup < steps, got warmup={self.warmup}, steps={self.steps}")


class Prompts:
    """Completion lengths, one row of G per prompt in the order prompts are started: drawn from the
    lognormal with the seed, or the rows of `lengths` over and over."""

    def __init__(self, s: Setup, lengths=None):
        self.s, self.fixed, self.drawn = s, None if lengths is None else np.asarray(lengths, int), []
        self.rng = np.random.default_rng(s.seed)

    def next(self) -> list[int]:
        s = self.s
        if self.fixed is not None:
            row = self.fixed[len(self.drawn) % len(self.fixed)]
        else:
            raw = self.rng.lognormal(math.log(s.length_median), s.length_sigma, s.generations)
            row = np.clip(np.rint(raw), 1, s.max_completion_length).astype(int)
        self.drawn.append(row)
        return [int(n) for n in row]


class Group:
    def __init__(self, version: int, lengths: list[int]):
        self.version, self.tokens, self.left, self.done_tokens = version, sum(lengths), len(lengths), 0
        self.seqs = [Seq(self, n) for n in lengths]


class Seq:
    __slots__ = ("group", "length", "start", "seg_start", "seg_version", "segs")

    def __init__(self, group: Group, length: int):
        self.group, self.length, self.segs = group, length, []  # segs: (weight version, tokens)


class Engine:
    """One rollout GPU: continuous batching, t(n) = a + b*n per decode iteration.  `t` is the time of its
    last iteration boundary (or of the end of a weight load), `it` its iteration count."""

    def __init__(self, s: Setup):
        self.a, self.b, self.cap = s.decode_a, s.decode_b, s.max_concurrency
        self.t, self.it, self.order, self.version, self.pending = 0.0, 0, 0, 0, None
        self.running, self.waiting = [], deque()  # running: heap of (iteration it finishes at, order, seq)
        self.decode, self.loads = [], []  # (start, end, tokens) and (start, end)

    def free(self) -> int:
        return self.cap - len(self.running) - len(self.waiting)

    def idle(self) -> bool:
        return not self.running and not self.waiting

    def next_time(self) -> float:
        if not self.running:
            return math.inf
        return self.t + (self.running[0][0] - self.it) * (self.a + self.b * len(self.running))

    def add(self, seq: Seq, now: float) -> None:
        if not self.running:
            self.t = max(self.t, now)
        if len(self.running) < self.cap:
            self._start(seq)
        else:
            self.waiting.append(seq)

    def complete_next(self) -> list[Seq]:
        self._decode(self.running[0][0] - self.it)
        return self._finish()

    def sync_to(self, now: float) -> list[Seq]:
        """Run whole iterations up to the first boundary at or after `now`; returns what finished."""
        if not self.running:
            self.t = max(self.t, now)
            return []
        if now <= self.t:
            return []
        dt = self.a + self.b * len(self.running)
        self._decode(min(math.ceil((now - self.t) / dt - 1e-9), self.running[0][0] - self.it))
        return self._finish()

    def load(self, version: int, seconds: float) -> None:
        """New weights at self.t: the completions in flight wait `seconds`, then go on with them."""
        for _, _, seq in self.running:
            if self.it > seq.seg_start:
                seq.segs.append((seq.seg_version, self.it - seq.seg_start))
            seq.seg_start, seq.seg_version = self.it, version
        self.loads.append((self.t, self.t + seconds))
        self.t, self.version, self.pending = self.t + seconds, version, None

    def _start(self, seq: Seq) -> None:
        seq.start = seq.seg_start = self.it
        seq.seg_version = self.version
        heapq.heappush(self.running, (self.it + seq.length, self.order, seq))
        self.order += 1

    def _decode(self, iters: int) -> None:
        if iters > 0:
            n = len(self.running)
            end = self.t + iters * (self.a + self.b * n)
            self.decode.append((self.t, end, iters * n))
            self.t, self.it = end, self.it + iters

    def _finish(self) -> list[Seq]:
        done = []
        while self.running and self.running[0][0] == self.it:
            seq = heapq.heappop(self.running)[2]
            seq.segs.append((seq.seg_version, self.it - seq.seg_start))
            done.append(seq)
        while self.waiting and len(self.running) < self.cap:
            self._start(self.waiting.popleft())
        return done


class Run:
    """The state both loops share: engines, the groups not yet trained or dropped, and the records."""

    def __init__(self, s: Setup, lengths):
        self.s, self.prompts = s, Prompts(s, lengths)
        self.engines = [Engine(s) for _ in range(s.rollout_gpus)]
        self.live, self.ready = set(), deque()
        self.step_ends, self.trainer, self.trained, self.dropped = [0.0], [], [], []  # trained: (step, V, group)

    def start_group(self, now: float, engines: list[Engine]) -> None:
        """Starts the next prompt's G completions on the least loaded of `engines` (the first on a tie)."""
        engine = max(engines, key=Engine.free)
        self.finished(engine.sync_to(now), engine)
        group = Group(engine.version, self.prompts.next())
        self.live.add(group)
        for seq in group.seqs:
            engine.add(seq, now)

    def finished(self, seqs: list[Seq], engine: Engine) -> None:
        for seq in seqs:
            group = seq.group
            group.left, group.done_tokens = group.left - 1, group.done_tokens + seq.length
            if group.left == 0:
                self.ready.append(group)

    def update(self, batch: list[Group], now: float) -> float:
        """Starts the update on `batch` at `now`; returns when its optimizer step is done (the push follows)."""
        end = now + sum(g.tokens for g in batch) / self.s.train_rate
        self.trainer += [(now, end), (end, end + self.s.push_time)]
        return end

    def updated(self, batch: list[Group]) -> None:
        version = len(self.step_ends) - 1
        for group in batch:
            self.trained.append((version + 1, version, group))  # (step, trainer version, group)
            self.live.discard(group)


def simulate_sync(s: Setup, lengths=None) -> Run:
    run, t0 = Run(s, lengths), 0.0
    for step in range(s.steps):
        for _ in range(s.prompts):
            run.start_group(t0, run.engines)
        for engine in run.engines:
            while engine.running:
                run.finished(engine.complete_next(), engine)
        batch = list(run.ready)
        run.ready.clear()
        end = run.update(batch, max(e.t for e in run.engines))
        run.updated(batch)
        for engine in run.engines:
            engine.t = end
            engine.load(step + 1, s.push_time)
        t0 = end + s.push_time
        run.step_ends.append(t0)
    return run


def simulate_async(s: Setup, k: int, partial: bool, lengths=None) -> Run:
    run, B, G = Run(s, lengths), s.prompts, s.generations
    taking, training, train_end, push_end = [], [], math.inf, math.inf

    def admit(now: float) -> None:
        while len(run.live) < (k + 1) * B:  # groups started and not yet trained or dropped
            engines = [e for e in run.engines if e.pending is None and e.free() >= G]
            if not engines:
                return
            run.start_group(now, engines)

    def take(now: float) -> None:
        nonlocal train_end
        version = len(run.step_ends) - 1
        while train_end == push_end == math.inf and run.ready and len(taking) < B:
            group = run.ready.popleft()
            if not partial and version - group.version > k:
                run.dropped.append((now, group))
                run.live.discard(group)
            else:
                taking.append(group)
        if len(taking) == B and train_end == push_end == math.inf:
            train_end = run.update(taking, now)
            training[:] = taking
            taking.clear()
        admit(now)  # drops free room in the queue

    admit(0.0)
    while len(run.step_ends) <= s.steps:
        engine = min(run.engines, key=Engine.next_time)
        now = min(engine.next_time(), train_end, push_end)  # on a tie, completions first
        if now == math.inf:
            raise RuntimeError("the simulation stalled: no completion in flight and the trainer waiting")
        if now == engine.next_time():
            run.finished(engine.complete_next(), engine)
            if engine.pending is not None and engine.idle():
                engine.load(engine.pending, s.push_time)
            admit(now)
            take(now)
        elif now == train_end:  # optimizer step done: push the weights
            train_end, push_end, version = math.inf, now + s.push_time, len(run.step_ends)
            run.updated(training)
            for e in run.engines:
                if partial or e.idle():
                    run.finished(e.sync_to(now), e)
                    e.load(version, s.push_time)
                else:
                    e.pending = version  # loaded when its completions in flight are done
            admit(now)
        else:
            push_end = math.inf
            run.step_ends.append(now)
            take(now)
    return run


def _overlap(intervals, lo: float, hi: float) -> float:
    return sum(max(0.0, min(b, hi) - max(a, lo)) for a, b, *_ in intervals)


def summarize(run: Run, name: str, k: int | None) -> dict:
    s, measured = run.s, run.s.steps - run.s.warmup
    lo, hi = run.step_ends[s.warmup], run.step_ends[s.steps]
    window = hi - lo
    sampler_busy = [_overlap(e.decode, lo, hi) + _overlap(e.loads, lo, hi) for e in run.engines]
    decoded = sum(n * _overlap([(a, b)], lo, hi) / (b - a) for e in run.engines for a, b, n in e.decode if b > a)
    groups, tokens = [], {}
    for step, version, group in run.trained:
        if step > s.warmup:
            groups.append(version - group.version)
            for seq in group.seqs:
                for seq_version, n in seq.segs:
                    tokens[version - seq_version] = tokens.get(version - seq_version, 0) + n
    token_count = sum(tokens.values())
    pending = sum(g.done_tokens for g in run.live) + sum(e.it - seq.start for e in run.engines for *_, seq in e.running)
    return {
        "schedule": name, "k": k, "seconds_per_step": window / measured,
        "trainer_idle": 1 - _overlap(run.trainer, lo, hi) / window,
        "sampler_idle": 1 - sum(sampler_busy) / (len(run.engines) * window),
        "sampler_tokens_per_s": decoded / window,
        "dropped_per_step": sum(lo < t <= hi for t, _ in run.dropped) / measured,
        "group_staleness_mean": float(np.mean(groups)), "group_staleness_max": int(max(groups)),
        "token_staleness_mean": sum(v * n for v, n in tokens.items()) / token_count,
        "token_staleness_max": max(tokens),
        "token_staleness": dict(sorted(tokens.items())),
        "tokens": {"generated": sum(n for e in run.engines for *_, n in e.decode),
                   "trained": sum(g.tokens for _, _, g in run.trained),
                   "dropped": sum(g.tokens for _, g in run.dropped), "pending": pending},
        "step_ends": run.step_ends,
    }


def compare(s: Setup, staleness=(1, 2, 4), lengths=None) -> tuple[list[dict], np.ndarray]:
    """The table's rows (sync first, speed-up over it) and the completion lengths the sync run drew."""
    sync = simulate_sync(s, lengths)
    rows = [summarize(sync, "sync", 0)]
    for partial in (False, True):
        for k in staleness:
            rows.append(summarize(simulate_async(s, k, partial, lengths), "partial" if partial else "async", k))
    for row in rows:
        row["speedup"] = rows[0]["seconds_per_step"] / row["seconds_per_step"]
    return rows, np.concatenate(sync.prompts.drawn)


def main() -> None:
    d = Setup()
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--steps", type=int, default=d.steps, help="optimizer steps simulated")
    p.add_argument("--warmup", type=int, default=d.warmup, help="first steps left out of the means")
    p.add_argument("--prompts", type=int, default=d.prompts, help="B, prompts per step")
    p.add_argument("--generations", type=int, default=d.generations, help="G, completions per prompt")
    p.add_argument("--length-median", type=float, default=d.length_median)
    p.add_argument("--length-sigma", type=float, default=d.length_sigma, help="sigma of the lognormal")
    p.add_argument("--max-completion-length", type=int, default=d.max_completion_length)
    p.add_argument("--rollout-gpus", type=int, default=d.rollout_gpus)
    p.add_argument("--max-concurrency", type=int, default=d.max_concurrency, help="sequences per rollout GPU")
    p.add_argument("--decode-a", type=float, default=d.decode_a, help="t(n) = a + b*n seconds per iteration")
    p.add_argument("--decode-b", type=float, default=d.decode_b)
    p.add_argument("--train-rate", type=float, default=d.train_rate, help="tokens/s on the training GPUs")
    p.add_argument("--push-time", type=float, default=d.push_time, help="seconds per weight push")
    p.add_argument("--staleness", type=int, nargs="+", default=[1, 2, 4], help="the k of the async rows")
    p.add_argument("--json", action="store_true", help="print the rows as JSON")
    args = vars(p.parse_args())
    staleness, as_json = args.pop("staleness"), args.pop("json")
    s = Setup(**args)
    rows, lengths = compare(s, staleness)
    for row in rows:
        del row["step_ends"]
    if as_json:
        print(json.dumps({"setup": asdict(s), "rows": rows}, indent=1))
        return
    p50, p90, p99 = np.percentile(lengths, [50, 90, 99])
    print(f"simulated, not measured. {s.prompts} prompts x {s.generations} completions per step, "
          f"{s.rollout_gpus} rollout GPUs, steps {s.warmup + 1}-{s.steps} of seed {s.seed}")
    print(f"completion lengths ({len(lengths)} drawn): p50 {p50:.0f}  p90 {p90:.0f}  p99 {p99:.0f}  "
          f"mean {lengths.mean():.0f}  at max {np.mean(lengths == s.max_completion_length):.1%}")
    print(f"sync: rollout {rows[0]['trainer_idle']:.0%} of the step\n")
    print(f"{'schedule':<11}{'s/step':>8}{'speed-up':>9}{'trainer idle':>13}{'sampler idle':>13}"
          f"{'sampler tok/s':>14}{'dropped/step':>13}{'staleness mean/max':>20}")
    for r in rows:
        name = r["schedule"] if r["schedule"] == "sync" else f"{r['schedule']} k={r['k']}"
        per = "token" if r["schedule"] == "partial" else "group"
        stale = f"{r[per + '_staleness_mean']:.2f} / {r[per + '_staleness_max']} {per}"
        print(f"{name:<11}{r['seconds_per_step']:>8.1f}{r['speedup']:>8.2f}x{r['trainer_idle']:>12.0%}"
              f"{r['sampler_idle']:>13.0%}{r['sampler_tokens_per_s']:>14,.0f}{r['dropped_per_step']:>13.2f}"
              f"{stale:>20}")


if __name__ == "__main__":
    main()
