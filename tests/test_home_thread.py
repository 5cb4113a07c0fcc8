"""rollout/home.py: calls posted from a sampling thread run on the training loop's thread."""

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest

from rlvr.rollout.home import CallRefused, HomeThread


def test_posted_calls_run_on_the_home_thread_and_return_there():
    home = HomeThread()
    ran_on = []

    def reward(x):
        ran_on.append(threading.current_thread())
        if x < 0:
            raise ValueError("negative")
        return x * 2

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(lambda: [home.call(reward, 1), home.call(reward, 2)])
        home.serve_until(future)
        assert future.result() == [2, 4]
        failing = pool.submit(home.call, reward, -1)
        home.serve_until(failing)
        with pytest.raises(ValueError, match="negative"):  # the error reaches the thread that asked
            failing.result()
    assert ran_on == [threading.main_thread()] * 3
    assert home.call(reward, 5) == 10  # from the home thread itself: at once


def test_refuse_releases_a_thread_waiting_for_the_home_thread():
    home = HomeThread()
    posted = threading.Event()
    with ThreadPoolExecutor(1) as pool:
        def ask():
            posted.set()
            return home.call(lambda: 1)

        future = pool.submit(ask)
        posted.wait(5)
        while home._calls.empty():  # the call is on its way
            pass
        home.refuse()  # the loop stopped: nothing will serve the call
        with pytest.raises(CallRefused):
            future.result(timeout=5)
        with pytest.raises(CallRefused):
            pool.submit(home.call, lambda: 1).result(timeout=5)
    home.accept()


def test_ctrl_c_while_serving_stops_the_loop_and_fails_the_caller():
    home = HomeThread()

    def interrupted():
        raise KeyboardInterrupt

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(home.call, interrupted)
        with pytest.raises(KeyboardInterrupt):
            home.serve_until(future)
        with pytest.raises(CallRefused):
            future.result(timeout=5)
