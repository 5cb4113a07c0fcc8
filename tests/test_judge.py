"""The LLM judge (rewards/llm_judge.py) against a stub OpenAI-compatible endpoint written here: verdicts
read strictly, requests concurrent up to max_concurrency, a cache, cost metrics, and the endpoint's
failures (a timeout, a 500, malformed JSON, a rambling reply) as None and counted, never 0 or 1;
then a local model as the judge, and what is refused before the model loads."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from rlvr.config import ConfigError, build_config
from rlvr.rewards import RewardSet
from rlvr.rewards import llm_judge as judge_module
from rlvr.rewards.llm_judge import RUBRIC, fill, parse_verdict
from rlvr.settings import check_settings
from rlvr.types import Example, Rollout


class Stub:
    """An OpenAI-compatible server: GET /v1/models, POST /v1/chat/completions.  It answers VERDICT:
    yes when the graded answer contains the reference, and misbehaves on purpose for completions
    that say SLOW (answers only when the stub closes), ERROR (a 500), BADJSON, RAMBLE (no verdict line) or MEET
    (waits until `meet` requests are in flight at once)."""

    def __init__(self, meet: int = 0):
        self.requests, self.in_flight, self.most_in_flight, self.meet = [], 0, 0, meet
        self.lock, self.met, self.released = threading.Lock(), threading.Event(), threading.Event()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def do_GET(self):
                self._send(200, json.dumps({"data": [{"id": "stub-judge"}]}))

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                text = body["messages"][0]["content"]
                with stub.lock:
                    stub.requests.append(body)
                    stub.in_flight += 1
                    stub.most_in_flight = max(stub.most_in_flight, stub.in_flight)
                    if stub.in_flight >= stub.meet:
                        stub.met.set()
                try:
                    graded = text.split("Answer to grade:\n")[1].split("\n\n")[0]
                    reference = text.split("Reference answer:\n")[1].split("\n\n")[0]
                    if "MEET" in graded:
                        stub.met.wait(30)
                    if "SLOW" in graded:
                        stub.released.wait(60)  # past any timeout the test gives; released when the stub closes
                    if "ERROR" in graded:
                        return self._send(500, "internal error")
                    if "BADJSON" in graded:
                        return self._send(200, "{not json")
                    reply = "I think so." if "RAMBLE" in graded else f"VERDICT: {'yes' if reference in graded else 'no'}"
                    self._send(200, json.dumps({"choices": [{"message": {"role": "assistant", "content": reply}}],
                                                "usage": {"total_tokens": 10}}))
                finally:
                    with stub.lock:
                        stub.in_flight -= 1

            def _send(self, code, text):
                data = text.encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def close(self):
        self.released.set()
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    judge_module._CACHE.clear()
    server = Stub()
    yield server
    server.close()


def _score(texts, answer="42", **args):
    rewards = RewardSet(["judge"], args={"judge": args})
    rollouts = [Rollout([1], [5], [-0.1], "stop", t) for t in texts]
    return rewards.score_groups([Example("What is 6 * 7?", answer)], [rollouts])


def test_verdicts_are_read_strictly():
    assert [parse_verdict(r) for r in ("VERDICT: yes", "Working...\n\n**Verdict: No**", "SCORE: 0.25", "verdict:yes\n")] == \
        [1.0, 0.0, 0.25, 1.0]
    # no verdict line last, a score out of range, a verdict inside prose, nothing: None, never 0 or 1
    assert [parse_verdict(r) for r in ("VERDICT: yes\nbut maybe not", "SCORE: 1.5", "my verdict is yes", "", None)] == \
        [None] * 5


def test_the_rubric_is_filled_and_keeps_its_other_braces():
    text = fill("Q: {prompt}\nA: {completion} (ref {answer}) \\boxed{x}", [{"role": "user", "content": "6*7?"}],
                [{"role": "assistant", "content": "42"}], 42)
    assert text == "Q: 6*7?\nA: 42 (ref 42) \\boxed{x}"


def test_endpoint_verdicts_cache_and_cost(stub):
    scores = _score(["it is 42", "it is 41", "it is 42"], base_url=stub.url)
    assert scores.per_func["judge"] == [1.0, 0.0, 1.0]
    assert len(stub.requests) == 2  # the repeated completion is asked once
    assert all(r["model"] == "stub-judge" and r["temperature"] == 0 for r in stub.requests)
    asked = sorted(r["messages"][0]["content"] for r in stub.requests)  # sent at once: in either order
    assert asked == sorted(fill(RUBRIC, "What is 6 * 7?", text, "42") for text in ("it is 42", "it is 41"))
    assert scores.logged["judge/calls"] == [2.0] and scores.logged["judge/tokens"] == [20.0]
    again = _score(["it is 41"], base_url=stub.url)  # a later step: from the cache
    assert again.per_func["judge"] == [0.0] and len(stub.requests) == 2 and again.logged["judge/cached"] == [1.0]


def test_endpoint_failures_are_none_and_counted(stub):
    scores = _score(["42 SLOW", "42 ERROR", "42 BADJSON", "42 RAMBLE", "42"], base_url=stub.url, timeout=2)
    assert scores.per_func["judge"] == [None, None, None, None, 1.0]
    assert scores.counters["judge"] == {"timeouts": 1, "errors": 3, "retries": 0}
    assert scores.logged["judge/unparsed"] == [1.0]  # the rambling reply; the 500 and the bad JSON are errors of the call
    assert _score(["42 ERROR"], base_url=stub.url).per_func["judge"] == [None]  # a failure is not cached as a verdict
    assert len([r for r in stub.requests if "42 ERROR" in r["messages"][0]["content"]]) == 2


def test_requests_are_concurrent_up_to_max_concurrency():
    """Each request waits until four are in flight at once: sent one by one, the first would wait
    out its 30 s and the judge's 20 s timeout would score them None."""
    judge_module._CACHE.clear()
    stub = Stub(meet=4)
    try:
        scores = _score([f"MEET {i} 42" for i in range(12)], base_url=stub.url, max_concurrency=4, timeout=20)
    finally:
        stub.close()
    assert scores.per_func["judge"] == [1.0] * 12
    assert stub.most_in_flight == 4  # never more than max_concurrency


def test_a_judge_endpoint_that_does_not_answer_and_a_rubric_without_placeholders_are_refused(tiny_model_dir):
    def problems(**args):
        with pytest.raises(ConfigError) as raised:
            check_settings(build_config({"model": str(tiny_model_dir), "reward_funcs": ["judge"], "reward_args": {"judge": args}}))
        return str(raised.value)

    import socket

    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        closed = f"http://127.0.0.1:{s.getsockname()[1]}/v1"
    assert f"reward_args.judge: judge endpoint {closed} does not answer GET /models" in problems(base_url=closed)
    assert "rubric must be text with the placeholder {completion}" in problems(rubric="Is this right? VERDICT: yes or no")
    assert "max_concurrency must be a whole number >= 1" in problems(max_concurrency=0)


def test_a_local_model_judges_and_its_rambling_is_counted(tiny_model_dir):
    """The tiny random model as the judge: it generates, but no verdict line, so every score is None
    and counted; a model path loads once per process."""
    judge_module._CACHE.clear()
    scores = _score(["42", "41"], model=str(tiny_model_dir), max_tokens=6)
    assert scores.per_func["judge"] == [None, None] and scores.counters["judge"]["errors"] == 2
    assert scores.logged["judge/calls"] == [2.0] and scores.logged["judge/tokens"][0] > 2 * 6


@pytest.mark.slow
def test_the_default_model_as_the_judge():
    """SmolLM2-135M-Instruct judging two answers with a score rubric: its replies parse, or count."""
    judge_module._CACHE.clear()
    rubric = ("Question: {prompt}\nReference answer: {answer}\nStudent answer: {completion}\n"
              "Is the student answer equal to the reference answer? Reply with one line: VERDICT: yes or VERDICT: no")
    scores = _score(["The answer is 42.", "The answer is 17."], model="default", rubric=rubric, max_tokens=8)
    values, counted = scores.per_func["judge"], scores.counters["judge"]["errors"]
    assert all(v in (0.0, 1.0, None) for v in values) and counted == values.count(None)
    assert scores.logged["judge/calls"] == [2.0]
