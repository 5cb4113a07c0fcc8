"""async_mode=free: a producer thread samples generation after generation while the trainer trains.

The trainer takes generations in the order they were sampled (`Producer.take`).  The producer keeps
at most max_staleness generations in flight (ready in its queue, or being sampled), the most that
can still be trained on, and waits while that many are ready (`timing/sampler_idle`).  A
generation whose oldest token is more than max_staleness weight versions behind the policy when it
is taken is dropped and counted (`sampling/stale_dropped_groups`), as TRL's AsyncGRPOTrainer drops
stale samples; so no token older than max_staleness versions enters a loss.

Weights.  `WeightVersions` counts the optimizer steps in the policy's weights (`current`, moved under
`lock`, which the trainer holds around each optimizer step) and the version the trainer wants the
samplers to have (`published`, every weight_sync_steps).  The producer loads newer weights itself,
under the lock (no optimizer step writes them meanwhile): before each generation, and with the
in-process engine also between two decode steps of a running one (an in-flight update: the tokens
after it come from the new weights, the cache before it stays), with vLLM's own server while its
requests are out (paused with mode=keep around the load: rollout/vllm_openai.push).
The trainer never waits for a generation to finish before it steps.  Each completion token records
the version that sampled it (Rollout.versions, where the engine can say; else the version the
generation started with, its oldest), and the update's importance correction uses the sampler's own
log-prob of each token.

Partial rollouts (partial_rollout_tokens, Generations.carry_partials): completions not done within a
round's tokens are carried to the next round, so a generation may hold tokens older than the version it
started with; `take` then checks each group by its own oldest token and leaves out those past
max_staleness (Generations.reassemble), counted with the groups the producer dropped before continuing
them (Generation.stale_groups).

Stopping.  `drain` stops the producer at a generation boundary: a generation being sampled is
cancelled (the in-process engine stops at its next token; a server's request is let finish and
thrown away) and the prompt stream and generator are rewound to before it, so they stand right
after the ready generations, which the checkpoint saves with them (`restore` puts them back).
Nothing is lost or sampled twice; which weights sample what depends on timing, so a free-running
run is not reproducible step for step (async_mode=lockstep is).  The trainer serves the generation's
reward calls (rollout/home.py) whenever it waits here.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections import Counter, deque
from concurrent.futures import Future

from rlvr.types import Generation, oldest_token_version


class Cancelled(Exception):
    """The producer was told to stop while it sampled: the generation is thrown away and rewound."""


class WeightVersions:
    def __init__(self, load, version: int = 0):
        """load(): copy the policy's current weights into the samplers (the trainer's weight subscribers)."""
        self.lock = threading.Lock()  # the trainer's optimizer step, or a load: never both at once
        self.current = version  # optimizer steps in the policy's weights
        self.published = version  # the version the samplers should hold at least
        self.held = version  # the version the samplers hold
        self.cancelled = False  # set by Producer.drain: a sampler asking `refresh` stops
        self.generating = False  # the producer is sampling a generation: a load now is an in-flight one
        self.in_flight_loads = 0  # loads made while a generation was being sampled
        self._load = load

    def step_begin(self) -> None:
        """The trainer, just before its optimizer step writes the weights."""
        self.lock.acquire()

    def step_end(self, version: int) -> None:
        """The trainer, after the optimizer step: the weights are now `version`."""
        self.current = version
        self.lock.release()

    def publish(self) -> None:
        """The trainer: the samplers should take the current weights (every weight_sync_steps steps)."""
        self.published = self.current

    def refresh(self) -> bool:
        """The sampling thread, between generations or decode steps: load the weights if a newer
        version was published; True when it did.  Raises Cancelled when the producer is stopping."""
        if self.cancelled:
            raise Cancelled()
        if self.held >= self.published:
            return False
        self.load_now()
        self.in_flight_loads += self.generating
        return True

    def load_now(self) -> None:
        with self.lock:
            self._load()
            self.held = self.current

    def loaded(self, version: int) -> None:
        """The trainer loaded the samplers itself (several processes: rank 0's producer never loads): they
        hold `version`, which is also the newest they should have (held first, so `refresh` never sees
        one ahead of the other)."""
        self.held = version
        self.published = version
        self.in_flight_loads += self.generating

    def catch_up(self) -> None:
        """Load the current weights unless the samplers hold them already (evaluation, after a drain)."""
        if self.held < self.current:
            self.load_now()


class Producer:
    def __init__(self, generations, versions: WeightVersions, state, max_staleness: int, home, in_flight=None,
                 stream=contextlib.nullcontext):
        """generations: rollout.generation.Generations (what one generation is); state(): the
        TrainerState reward functions get; home: the rollout.home.HomeThread of the training loop;
        in_flight: the in-process sampler (rollout/engine.py), which loads newer weights between decode
        steps while this thread samples with it (not while evaluation does), or None; stream(): the
        context this thread samples in (on a GPU a CUDA stream of its own: RolloutStage.side_stream)."""
        self.generations, self.versions, self.state, self.home = generations, versions, state, home
        self.in_flight, self.stream = in_flight, stream
        self.max_staleness = max_staleness
        self.ready: deque[Generation] = deque()
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.stopped: Future | None = None  # done when the thread has ended
        self.error: BaseException | None = None
        self.sampling = False  # a generation is being sampled and scored
        self.holding = False  # the trainer loads the samplers: no generation starts (between_generations)
        self._signal: Future = Future()  # done when something happened that `take` waits for
        # since the last take: the sampler's seconds waiting with a full queue, generations and groups dropped
        self.idle_seconds = 0.0
        self.dropped_generations = self.dropped_groups = 0

    # --- the sampling thread -------------------------------------------------------------------

    def start(self) -> None:
        self.versions.cancelled = False
        self.error, self.stopped = None, Future()
        self.thread = threading.Thread(target=self._run, name="rlvr-producer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            while True:
                with self.cond:
                    t0 = time.perf_counter()
                    while not self.versions.cancelled and (len(self.ready) >= self.max_staleness or self.holding):
                        self.cond.wait()
                    self.idle_seconds += time.perf_counter() - t0
                    if self.versions.cancelled:
                        return
                    self.sampling = True
                try:
                    gen = self._generate()
                finally:
                    with self.cond:
                        self.sampling = False
                with self.cond:
                    self.ready.append(gen)
                self._wake()
        except Cancelled:
            pass
        except BaseException as e:  # raised to the trainer by take()
            self.error = e
        finally:
            self.stopped.set_result(None)
            self._wake()

    def _generate(self) -> Generation:
        before = self.generations.position()
        if self.in_flight is not None:
            self.in_flight.live = self.versions
        try:
            with self.stream():
                self.versions.refresh()
                version = self.versions.held
                if self.versions.cancelled:  # told to stop during the load
                    raise Cancelled()
                self.versions.generating = True
                gen = self.generations.generate_or_rewind(self.state())  # a Cancelled from the engine rewinds too
        finally:
            self.versions.generating = False
            if self.in_flight is not None:
                self.in_flight.live = None
        if self.versions.cancelled:  # finished after all (a server's request): thrown away all the same
            self.generations.rewind(before)
            raise Cancelled()
        gen.weight_version = version
        versions = Counter(gen.token_versions or {None: 1})  # None: no engine recorded a token's version
        unknown = versions.pop(None, 0)
        if unknown:  # tokens of an engine that does not say: the version the generation started with
            versions[version] += unknown
        gen.token_versions = dict(versions)
        return gen

    def _wake(self) -> None:
        with self.cond:
            signal, self._signal = self._signal, Future()
            self.cond.notify_all()
        signal.set_result(None)

    # --- the trainer's side --------------------------------------------------------------------

    def take(self, step: int) -> Generation:
        """The next generation no more than max_staleness versions behind `step`, the policy's
        version; older ones are dropped and counted.  Serves reward calls while it waits."""
        while True:
            with self.cond:
                gen = self.ready.popleft() if self.ready else None
                if gen is not None:
                    self.cond.notify_all()  # room in the queue
                signal = self._signal
                error = self.error
            if gen is None:
                if error is not None:
                    self.error = None
                    raise error
                if self.thread is None or not self.thread.is_alive():
                    self.start()
                    continue
                self.home.serve_until(signal)
                continue
            self.dropped_groups += gen.stale_groups  # partial rollouts: carried groups dropped while it was sampled
            if gen.parts is not None and self.generations.partial is not None:  # partial rollouts: each group by its own oldest token
                keep = [step - oldest_token_version(g.rollouts) <= self.max_staleness for g in gen.parts[0]]
                if any(keep) and not all(keep):
                    self.dropped_groups += keep.count(False)
                    gen = self.generations.reassemble(gen, keep)
            if step - oldest_version(gen) > self.max_staleness:
                self.dropped_generations += 1
                self.dropped_groups += gen.groups
                continue
            return gen

    @contextlib.contextmanager
    def between_generations(self):
        """The trainer's own load of samplers that cannot take weights while they sample (rlvr's own server, or
        in_flight_weight_updates=false; several processes): it waits for the generation being sampled to be
        done, serving its reward calls meanwhile, and no other starts until it is over."""
        with self.cond:
            self.holding = True
        try:
            while True:
                with self.cond:
                    if not self.sampling:
                        break
                    signal = self._signal
                self.home.serve_until(signal)
            yield
        finally:
            with self.cond:
                self.holding = False
                self.cond.notify_all()

    def since_take(self) -> dict:
        """What happened since the last call, for the step's metrics; the counters start again."""
        with self.cond:
            out = {"sampling/queue_depth": len(self.ready), "sampling/stale_dropped_groups": self.dropped_groups,
                   "sampling/stale_dropped_generations": self.dropped_generations, "timing/sampler_idle": self.idle_seconds,
                   "sampling/in_flight_loads": self.versions.in_flight_loads}
            self.idle_seconds, self.dropped_groups, self.dropped_generations = 0.0, 0, 0
            self.versions.in_flight_loads = 0
        return out

    def drain(self) -> list[Generation]:
        """Stop the thread at a generation boundary (the one being sampled is cancelled and rewound)
        and return the ready generations, which stay queued; the next `take` starts it again."""
        if self.thread is not None and self.thread.is_alive():
            with self.cond:
                self.versions.cancelled = True
                self.cond.notify_all()
            self.home.serve_until(self.stopped)
            self.thread.join()
        self.thread = None
        return list(self.ready)

    def restore(self, generations: list[Generation]) -> None:
        """A checkpoint's queued generations, taken before anything sampled after it."""
        with self.cond:
            self.ready.extendleft(reversed(generations))

    def close(self) -> None:
        """Stop sampling for good without waiting for it: reward calls are refused, so a thread
        waiting for one ends (a daemon, it never holds the process)."""
        if self.thread is not None and self.thread.is_alive():
            self.versions.cancelled = True
            with self.cond:
                self.cond.notify_all()
            self.home.refuse()
            self.thread.join(timeout=0)
        self.thread = None


def oldest_version(gen: Generation) -> int:
    """The oldest weight version among a generation's tokens (the version it started with)."""
    return min(gen.token_versions) if gen.token_versions else gen.weight_version


def token_staleness(gen: Generation, step: int) -> tuple[float, int]:
    """(mean, max) over a generation's tokens of the versions the policy is ahead of the one that sampled it."""
    versions = gen.token_versions or {gen.weight_version: 1}
    tokens = sum(versions.values()) or 1
    return sum((step - v) * n for v, n in versions.items()) / tokens, max(step - v for v in versions)
