"""Your own reward functions run in a worker process (reward_isolation=process): one that overruns
is killed, with what it started, even stuck in C code or behind a bare `except:`; sys.exit,
KeyboardInterrupt and a crash there are errors naming the function; inline keeps them in-process."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from rlvr.config import ConfigError, build_config
from rlvr.rewards import RewardError, RewardSet, register_reward
from rlvr.tasks import build_rewards
from rlvr.types import Example, Rollout



def _rewards(tmp_path, body: str, name: str = "f", **kwargs) -> RewardSet:
    """A RewardSet of one function `name` written to a file, as `reward_funcs=[file.py:f]` gives it."""
    plugin = tmp_path / f"{name}.py"
    plugin.write_text(textwrap.dedent(body))
    return RewardSet([f"{plugin}:{name}"], **kwargs)


def _score(rewards: RewardSet, n: int = 2):
    rollouts = [Rollout([1], [5, 6], [-0.1, -0.2], "stop", f"completion {i}") for i in range(n)]
    return rewards.score_groups([Example("p", "1")], [rollouts])


def _running(pid: int, wait: float = 5.0) -> bool:
    """Whether process `pid` still runs after up to `wait` seconds (a zombie waiting to be reaped is gone)."""
    deadline = time.monotonic() + wait
    while True:
        try:
            os.kill(pid, 0)
            with open(f"/proc/{pid}/stat") as f:
                alive = f.read().rpartition(")")[2].split()[0] != "Z"
        except (ProcessLookupError, FileNotFoundError):
            alive = False
        if not alive or time.monotonic() > deadline:
            return alive
        time.sleep(0.05)


@pytest.mark.processes
def test_a_reward_stuck_in_c_code_is_stopped_at_reward_timeout(tmp_path, caplog):
    rewards = _rewards(tmp_path, """
        import re

        def f(completions, **kwargs):
            re.match(r"(a+)+$", "a" * 40 + "b")  # hours of backtracking inside re's C code, holding the GIL
            return [1.0] * len(completions)
    """, timeout=1)
    scores = _score(rewards)  # its scores come back as timeouts: the call was stopped, not waited for
    assert scores.per_func["f"] == [None, None] and scores.counters["f"]["timeouts"] == 2
    assert "reward function 'f' ran past reward_timeout=1 s" in caplog.text


@pytest.mark.processes
def test_a_bare_except_does_not_keep_a_reward_past_its_timeout(tmp_path):
    rewards = _rewards(tmp_path, """
        import time

        def f(completions, **kwargs):
            try:
                time.sleep(100)
            except:  # noqa: E722 - swallows any exception a signal could raise
                pass
            return [1.0] * len(completions)
    """, timeout=1)
    scores = _score(rewards)
    assert scores.counters["f"]["timeouts"] == 2 and scores.per_func["f"] == [None, None]  # stopped, not returned


@pytest.mark.processes
def test_what_a_reward_started_is_killed_with_it(tmp_path):
    pid_file = tmp_path / "sleep.pid"
    rewards = _rewards(tmp_path, f"""
        import subprocess, time

        def f(completions, **kwargs):
            child = subprocess.Popen(["sleep", "1000"])
            open({str(pid_file)!r}, "w").write(str(child.pid))
            time.sleep(100)
    """, timeout=1)
    assert _score(rewards).counters["f"]["timeouts"] == 2
    assert not _running(int(pid_file.read_text()))


@pytest.mark.processes
def test_sys_exit_and_keyboard_interrupt_in_a_reward_are_errors_naming_it(tmp_path):
    with pytest.raises(RewardError, match=r"^reward function 'f' called sys\.exit\(3\)$"):
        _score(_rewards(tmp_path, "import sys\ndef f(completions, **kwargs):\n    sys.exit(3)\n"))
    with pytest.raises(RewardError, match="reward function 'g' raised KeyboardInterrupt itself"):
        _score(_rewards(tmp_path, "def g(completions, **kwargs):\n    raise KeyboardInterrupt\n", name="g"))


@pytest.mark.processes
def test_an_exception_keeps_its_message_and_the_functions_traceback(tmp_path):
    with pytest.raises(RewardError, match=r"^reward function 'f' raised KeyError: 'answer'$") as raised:
        _score(_rewards(tmp_path, "def f(completions, **kwargs):\n    return {}['answer']\n"))
    assert 'f.py", line 2, in f' in str(raised.value.__cause__)  # chained: the user's own line


@pytest.mark.processes
def test_a_cuda_error_in_the_worker_says_to_run_inline(tmp_path):
    body = "def f(completions, **kwargs):\n    raise RuntimeError('Cannot re-initialize CUDA in forked subprocess')\n"
    with pytest.raises(RewardError, match="set reward_isolation=inline"):
        _score(_rewards(tmp_path, body))


@pytest.mark.processes
@pytest.mark.parametrize("body, how", [
    ("import os\ndef f(completions, **kwargs):\n    os._exit(7)\n", "exited with code 7"),
    ("import os, signal\ndef f(completions, **kwargs):\n    os.kill(os.getpid(), signal.SIGKILL)\n",  # as the OOM killer
     "was killed by SIGKILL"),
])
def test_a_worker_that_dies_is_an_error_not_a_hang(tmp_path, body, how):
    with pytest.raises(RewardError, match=f"^reward function 'f' did not return: its worker process {how}"):
        _score(_rewards(tmp_path, body))  # no reward_timeout: only the worker's end can stop the wait


@pytest.mark.processes
def test_a_closure_over_local_state_runs_in_the_worker(tmp_path):
    lock, offset, seen = threading.Lock(), 0.5, []  # neither the lock nor the closure can be pickled

    def near(completions, **kwargs):
        with lock:
            seen.append(len(completions))
            return [offset + len(c) for c in completions]

    name = register_reward(near)
    assert _score(RewardSet([name])).per_func[name] == [12.5, 12.5]
    assert seen == []  # the worker's copy of `seen` grew, not the trainer's
    assert _score(RewardSet([name], isolation="inline")).per_func[name] == [12.5, 12.5] and seen == [2]


@pytest.mark.processes
def test_the_worker_is_reused_and_replaced_after_a_kill(tmp_path):
    pids, slow = tmp_path / "pids", tmp_path / "slow"

    def where(completions, **kwargs):
        with open(pids, "a") as f:
            f.write(f"{os.getpid()}\n")
        if slow.exists():
            time.sleep(100)
        return [0.0] * len(completions)

    rewards = RewardSet([register_reward(where)], timeout=1)
    _score(rewards), _score(rewards)
    slow.touch()
    assert _score(rewards).counters["where"]["timeouts"] == 2
    slow.unlink()
    _score(rewards)
    first, second, killed, fresh = (int(p) for p in pids.read_text().split())
    assert first == second == killed != fresh and os.getpid() not in (first, fresh)
    assert not _running(killed) and _running(fresh, wait=0)
    rewards.close()
    assert not _running(fresh)


@pytest.mark.processes
def test_ctrl_c_is_the_trainers_not_the_workers(tmp_path):
    rewards = _rewards(tmp_path, """
        import os, signal

        def f(completions, **kwargs):
            os.kill(os.getpid(), signal.SIGINT)  # what a terminal's Ctrl-C would send the worker too
            return [1.0] * len(completions)
    """)
    assert _score(rewards).per_func["f"] == [1.0, 1.0]


def test_inline_runs_in_the_trainers_process_with_the_signal_deadline(tmp_path):
    rewards = _rewards(tmp_path, "import os, time\ndef f(completions, **kwargs):\n    time.sleep(100)\n",
                       timeout=1, isolation="inline")
    assert rewards.worker is None
    assert _score(rewards).counters["f"]["timeouts"] == 2


@pytest.mark.processes
@pytest.mark.parametrize("end", ["exit", "kill -9"])
def test_the_worker_ends_with_the_trainer(tmp_path, end):
    """A script scores once (its reward leaves a `sleep` running), then exits or is killed: the worker
    goes too, and on a normal exit what it started."""
    pids = tmp_path / "pids"
    script = textwrap.dedent(f"""
        import os, signal, subprocess
        from rlvr.rewards import RewardSet, register_reward
        from rlvr.types import Example, Rollout

        def starts(completions, **kwargs):
            open({str(pids)!r}, "w").write(f"{{os.getpid()}} {{subprocess.Popen(['sleep', '1000'], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid}}")
            return [1.0] * len(completions)

        rewards = RewardSet([register_reward(starts)])
        print(rewards.score_groups([Example("p", "1")], [[Rollout([1], [2], [0.0], "stop", "x")]]).total, flush=True)
        if {end == "kill -9"}:
            os.kill(os.getpid(), signal.SIGKILL)
    """)
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert done.stdout.strip() == "[1.0]", done.stderr
    worker, sleep = (int(pid) for pid in pids.read_text().split())
    assert not _running(worker)
    if end == "exit":
        assert done.returncode == 0 and not _running(sleep)
    else:
        os.kill(sleep, signal.SIGKILL)  # not covered: what the worker started outlives a SIGKILL of the trainer


def test_reward_isolation_is_a_setting_checked_before_the_model_loads():
    with pytest.raises(ConfigError, match="reward_isolation must be one of process, inline; got 'thread'"):
        build_config({"reward_isolation": "thread"})
    assert build_config({}).reward_isolation == "process"
    inline = build_config({"reward_isolation": "inline"})
    assert build_rewards(inline.reward_settings, inline.data_settings).isolation == "inline"


@pytest.mark.skipif(not __import__("torch").cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.processes
def test_a_reward_using_cuda_after_the_trainer_did_is_told_to_run_inline(tmp_path):
    import torch

    torch.zeros(1, device="cuda")  # the trainer has initialised CUDA, as it has when training on a GPU

    def on_gpu(completions, **kwargs):
        return torch.ones(len(completions), device="cuda").tolist()

    name = register_reward(on_gpu)
    with pytest.raises(RewardError, match="set reward_isolation=inline"):
        _score(RewardSet([name]))
    assert _score(RewardSet([name], isolation="inline")).per_func[name] == [1.0, 1.0]
