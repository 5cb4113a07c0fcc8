"""`async def` reward functions are awaited together (TRL's asyncio.gather), each bounded by
reward_timeout, in their own worker process while the other functions score (or in the trainer's
process with reward_isolation=inline).  No assertion here reads a clock: concurrency is shown by
functions that can only finish if the others run at the same time."""

from __future__ import annotations

import textwrap

import pytest

from rlvr.rewards import RewardError, RewardSet
from rlvr.rewards import calls
from rlvr.types import Example, Rollout

pytestmark = pytest.mark.processes

# Three functions that each return only once all three have started: awaited one after another,
# the first would wait for the others until its 30 s wait_for raised (an error, not a slow pass).
MEETING = """
    import asyncio

    arrived = []
    everyone = None

    async def meet(completions, **kwargs):
        global everyone
        everyone = everyone or asyncio.Event()
        arrived.append(1)
        if len(arrived) == 3:
            everyone.set()
        await asyncio.wait_for(everyone.wait(), 30)
        return [1.0] * len(completions)

    meet_2 = meet_3 = meet
"""


def _rewards(tmp_path, body: str, names, **kwargs) -> RewardSet:
    plugin = tmp_path / "mine.py"
    plugin.write_text(textwrap.dedent(body))
    return RewardSet([n if n == "boxed_format" else f"{plugin}:{n}" for n in names], **kwargs)


def _score(rewards: RewardSet):
    rollouts = [Rollout([1], [5, 6], [-0.1, -0.2], "stop", text) for text in ("0", "\\boxed{1}")]  # boxed_format: 0, 1
    try:
        return rewards.score_groups([Example("p", "1")], [rollouts])
    finally:
        rewards.close()


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_async_rewards_are_awaited_together(tmp_path, isolation):
    rewards = _rewards(tmp_path, MEETING, ["meet", "boxed_format", "meet_2", "meet_3"], timeout=60, isolation=isolation)
    scores = _score(rewards)
    assert scores.per_func == {"meet": [1.0, 1.0], "boxed_format": [0.0, 1.0], "meet_2": [1.0, 1.0], "meet_3": [1.0, 1.0]}
    assert list(scores.per_func) == rewards.names  # reported in the order they were given
    assert scores.total == [3.0, 4.0]


def test_async_rewards_wait_while_the_others_score(tmp_path):
    """The async function runs in its own worker from the start of the batch: the plain function,
    which waits for the file the async one writes, would wait out its 30 s if they took turns."""
    signal_file = tmp_path / "async-started"
    rewards = _rewards(tmp_path, f"""
        import os, time

        async def writes(completions, **kwargs):
            open({str(signal_file)!r}, "w").close()
            return [1.0] * len(completions)

        def waits(completions, **kwargs):
            for _ in range(600):
                if os.path.exists({str(signal_file)!r}):
                    return [2.0] * len(completions)
                time.sleep(0.05)
            return [0.0] * len(completions)
    """, ["waits", "writes"], timeout=60)
    assert _score(rewards).per_func == {"waits": [2.0, 2.0], "writes": [1.0, 1.0]}


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_each_async_reward_is_bounded_by_reward_timeout_on_its_own(tmp_path, isolation, caplog):
    rewards = _rewards(tmp_path, """
        import asyncio

        async def quick(completions, **kwargs):
            return [1.0] * len(completions)

        async def stuck(completions, **kwargs):
            await asyncio.sleep(1000)
    """, ["quick", "stuck"], timeout=1, isolation=isolation)
    scores = _score(rewards)
    assert scores.per_func == {"quick": [1.0, 1.0], "stuck": [None, None]}
    assert scores.counters["stuck"]["timeouts"] == 2 and scores.counters["quick"]["timeouts"] == 0
    assert "reward function 'stuck' ran past reward_timeout=1 s" in caplog.text


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_an_async_reward_that_blocks_its_loop_is_stopped_with_the_others(tmp_path, isolation, monkeypatch):
    """time.sleep in an `async def` holds the event loop: nothing inside it can stop the call, so
    the backstop (the worker's kill, or the signal inline) does, and every async function's scores
    of the batch are timeouts; the plain functions are untouched."""
    import rlvr.rewards

    monkeypatch.setattr(rlvr.rewards, "ASYNC_GRACE", 0.5)
    rewards = _rewards(tmp_path, """
        import time

        async def quick(completions, **kwargs):
            return [1.0] * len(completions)

        async def blocks(completions, **kwargs):
            time.sleep(1000)
    """, ["quick", "blocks", "boxed_format"], timeout=1, isolation=isolation)
    scores = _score(rewards)
    assert scores.per_func == {"quick": [None, None], "blocks": [None, None], "boxed_format": [0.0, 1.0]}
    assert scores.counters["blocks"]["timeouts"] == scores.counters["quick"]["timeouts"] == 2


@pytest.mark.parametrize("isolation", ["process", "inline"])
def test_async_failures_name_their_function(tmp_path, isolation):
    body = """
        import sys

        async def fine(completions, **kwargs):
            return [1.0] * len(completions)

        async def exits(completions, **kwargs):
            sys.exit(3)

        async def raises(completions, **kwargs):
            return {}["answer"]
    """
    with pytest.raises(RewardError, match=r"^reward function 'exits' called sys\.exit\(3\)$"):
        _score(_rewards(tmp_path, body, ["fine", "exits"], isolation=isolation))
    with pytest.raises(RewardError, match=r"^reward function 'raises' raised KeyError: 'answer'$"):
        _score(_rewards(tmp_path, body, ["fine", "raises"], isolation=isolation))


def test_async_rewards_log_as_the_others_do_and_async_objects_count(tmp_path):
    rewards = _rewards(tmp_path, """
        async def logs(completions, log_metric, log_extra, **kwargs):
            log_metric("judge/calls", len(completions))
            log_extra("verdict", ["yes"] * len(completions))
            return [0.5] * len(completions)

        class Judge:
            async def __call__(self, completions, **kwargs):
                return [0.25] * len(completions)
    """, ["logs", "Judge"])
    assert calls.is_async(rewards.fns[1])  # an object whose __call__ is async, as TRL's is_async_callable
    scores = _score(rewards)
    assert scores.per_func == {"logs": [0.5, 0.5], "Judge": [0.25, 0.25]}
    assert scores.logged == {"judge/calls": [2.0]} and scores.extra == {"verdict": ["yes", "yes"]}
