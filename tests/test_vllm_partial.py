"""Partial rollouts with vLLM (rollout/vllm_partial.py): a completion continued round by round is the one
sampled in one request.  The first tests run without vLLM, on a stand-in that answers as vLLM does (stop
strings looked for in the request's own output, a max_tokens per request) from a scripted model; the
last ones (in the vLLM environment, `make test-vllm`) on the real engine, colocated and as servers."""

from __future__ import annotations

import importlib.util

import pytest
from conftest import make_tokenizer

from rlvr.rollout import SamplingParams
from rlvr.rollout.sampling import GroupGenerators
from rlvr.rollout.vllm_partial import numbered, resume
from rlvr.rollout.vllm_request import max_tokens_of
from rlvr.types import Rollout

TOKENIZER = make_tokenizer()
EOS = TOKENIZER.convert_tokens_to_ids("<|im_end|>")
# What the scripted model writes after a prompt that ends "k=": SCRIPTS[k], then EOS.
SCRIPTS = {"a": "ab</a>cdef", "b": "xy", "c": "0123456789abcdef", "d": "tuv</a>w"}


def ids(text: str) -> list[int]:
    return TOKENIZER.encode(text, add_special_tokens=False)


class ScriptedVLLM:
    """vLLM's answers for the scripted model: each request n=1, its own max_tokens; it ends at EOS or at a stop
    string found in its own output's text (cut before it), else after max_tokens; the log-prob of the token
    at script position p is -0.1 (p + 1).  `context`: the most tokens a prompt and its output may hold."""

    def __init__(self, context: int = 1000):
        self.context, self.calls = context, []

    def __call__(self, prompt_ids, params, seeds):
        self.calls.append({"prompts": [list(p) for p in prompt_ids], "max_tokens": params["max_tokens"], "seeds": list(seeds)})
        assert params["n"] == 1
        return [[self.one(list(p), max_tokens_of(params, i), params["stop_strings"])] for i, p in enumerate(prompt_ids)]

    def one(self, prompt: list[int], max_tokens: int, stops) -> dict:
        text = TOKENIZER.decode(prompt, skip_special_tokens=True)
        start = text.rindex("=")
        script, done = SCRIPTS[text[start - 1]], len(text) - start - 1  # characters of the script already there
        out, logprobs = [], []
        while len(out) < max_tokens and len(prompt) + len(out) < self.context:
            position = done + len(out)
            out.append(ids(script[position])[0] if position < len(script) else EOS)
            logprobs.append(-0.1 * (position + 1))
            said = TOKENIZER.decode(out, skip_special_tokens=True)
            hits = [said.find(s) for s in stops if s in said]
            if out[-1] == EOS or hits:
                return {"prompt_ids": prompt, "completion_ids": out, "logprobs": logprobs, "finish_reason": "stop",
                        "text": said[: min(hits)] if hits else said}
        return {"prompt_ids": prompt, "completion_ids": out, "logprobs": logprobs, "finish_reason": "length",
                "text": TOKENIZER.decode(out, skip_special_tokens=True)}


def blank(prompt: str) -> Rollout:
    return Rollout(ids(prompt), [], [], "partial", "")


def continued(step, partials) -> tuple[list[Rollout], int]:
    """`partials` resumed round after round (step: partials -> rollouts) until none is partial; (the
    rollouts, how many rounds)."""
    out, rounds = list(partials), 0
    while any(r.finish_reason == "partial" for r in out):
        carried = [i for i, r in enumerate(out) if r.finish_reason == "partial"]
        for i, r in zip(carried, step([out[i] for i in carried])):
            assert r.completion_ids[: len(out[i].completion_ids)] == out[i].completion_ids
            assert r.logprobs[: len(out[i].logprobs)] == out[i].logprobs
            out[i] = r
        rounds += 1
    return out, rounds


@pytest.mark.parametrize("round_tokens", [1, 2, 3, 4, 7])
def test_a_completion_continued_round_by_round_is_the_one_sampled_in_one_request(round_tokens):
    """"a" stops at "</a>", which rounds of 3 (and of 2, 4) split; "d" at "</a>" too, later; "b" at EOS; "c" runs
    to max_tokens: the tokens, log-probs, finish reasons and texts are those of one request each."""
    send = ScriptedVLLM()
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_strings=("</a>",), round_tokens=round_tokens)
    prompts = ["1+1 a=", "what b=", "c=", "and d="]
    whole = [g[0] for g in send([ids(p) for p in prompts], {"n": 1, "max_tokens": 12, "stop_strings": ["</a>"]}, [0] * 4)]
    out, rounds = continued(lambda rows: resume(send, rows, params, None, [EOS], TOKENIZER), [blank(p) for p in prompts])
    assert rounds == -(-12 // round_tokens)  # "c" runs the whole length
    for r, w in zip(out, whole):
        assert (r.completion_ids, r.logprobs, r.finish_reason, r.text) == (w["completion_ids"], w["logprobs"], w["finish_reason"], w["text"])
    assert [r.text for r in out] == ["ab", "xy", "0123456789ab", "tuv"] and out[2].finish_reason == "length"
    assert [r.finish_reason for r in out] == ["stop", "stop", "length", "stop"]


def test_a_stop_string_split_over_two_rounds_ends_the_completion_at_the_token_that_completes_it():
    send = ScriptedVLLM()
    params = SamplingParams(max_tokens=12, temperature=0.0, stop_strings=("</a>",), round_tokens=3)
    (first,) = resume(send, [blank("a=")], params, None, [EOS], TOKENIZER)
    assert first.finish_reason == "partial" and TOKENIZER.decode(first.completion_ids) == "ab<"
    (second,) = resume(send, [first], params, None, [EOS], TOKENIZER)
    # vLLM, looking in "/a>" alone, saw no stop string and went on: the round is cut after ">"
    assert send.calls[-1]["prompts"] == [ids("a=ab<")] and send.calls[-1]["max_tokens"] == [3]
    assert TOKENIZER.decode(second.completion_ids) == "ab</a>" and second.finish_reason == "stop" and second.text == "ab"
    assert second.logprobs == pytest.approx([-0.1, -0.2, -0.3, -0.4, -0.5, -0.6])


def test_each_row_is_asked_for_what_it_has_left_and_says_why_it_ended():
    send = ScriptedVLLM(context=9)  # "c=" + 7 tokens fill the context
    params = SamplingParams(max_tokens=10, temperature=0.0, round_tokens=4)
    c = ids("0123456789")
    partials = [blank("c="), Rollout(ids("c="), c[:8], [-1.0] * 8, "partial", "01234567"),
                Rollout(ids("c="), c[:5], [-1.0] * 5, "partial", "01234"), Rollout(ids("c="), c[:10], [-1.0] * 10, "partial", "x")]
    out = resume(ScriptedVLLM(), partials, params, None, [EOS], TOKENIZER)
    assert [len(r.completion_ids) for r in out] == [4, 10, 9, 10]
    assert [r.finish_reason for r in out] == ["partial", "length", "partial", "length"]  # the last had nothing left to ask for
    # vLLM does not say which weights sampled a token: the versions are left to RolloutStage._stamped (None)
    assert [r.versions for r in out] == [None, None, None, None]
    resume(send, partials[:3], params, None, [EOS], TOKENIZER)
    assert send.calls[-1]["max_tokens"] == [4, 2, 4]  # one call, each row its own budget
    # vLLM's context filled before the round's tokens did (3 tokens where 4 were asked): it cannot go on
    out = resume(send, [Rollout(ids("c="), c[:4], [-1.0] * 4, "partial", "0123")], params, None, [EOS], TOKENIZER)
    assert len(out[0].completion_ids) == 7 and out[0].finish_reason == "length"
    # without rounds (round_tokens=0) a row is given all it has left, and an unfinished one is cut by max_tokens
    (whole,) = resume(send, [blank("b=")], SamplingParams(max_tokens=1), None, [EOS], TOKENIZER)
    assert send.calls[-1]["max_tokens"] == [1] and whole.finish_reason == "length"


def test_a_new_groups_rows_are_seeded_as_vllm_seeds_one_requests_completions_and_reruns_draw_the_same():
    """Three new rows of one group (its stream repeated: GroupGenerators.per_row) get seed, seed + 1, seed + 2,
    as vLLM gives the n completions of a request with that seed; carried rows their own streams' seeds."""
    send = ScriptedVLLM()
    params = SamplingParams(max_tokens=12, round_tokens=3)
    partials = [Rollout(ids("b="), ids("x"), [-1.0], "partial", "x")] + [blank("c=")] * 3

    def streams():
        return GroupGenerators.per_row([(GroupGenerators([11]), 1), (GroupGenerators([12]), 3)])

    resume(send, partials, params, streams(), [EOS], TOKENIZER)
    resume(send, partials, params, streams(), [EOS], TOKENIZER)
    first, again = send.calls[-2]["seeds"], send.calls[-1]["seeds"]
    assert first == again and first[2:] == [first[1] + 1, first[1] + 2] and first[0] != first[1]
    assert numbered([5, 5, 7, 5, 5, 5]) == [5, 6, 7, 5, 6, 7]


def test_vllm_servers_continue_completions_and_move_a_dropped_servers_share_mid_round():
    """VLLMServers.resume over three `rlvr vllm-serve` HTTP servers (their engine the scripted model): the
    round's requests are split over them; one that fails while the round is out is dropped and its share
    goes to another, and the completions are those of one request each."""
    from test_vllm_servers import Policy, Running

    from rlvr.rollout.vllm_client import VLLMServers

    class Engine:
        model_path, dtype, adapters, version = "scripted", "float32", False, 0

        def __init__(self, fail_on_call: int | None = None):
            self.send, self.fail_on_call = ScriptedVLLM(), fail_on_call

        def load(self, meta, tensors):
            self.version = meta["version"]
            return len(list(tensors))

        def generate(self, prompt_ids, params, seeds):
            if len(self.send.calls) + 1 == self.fail_on_call:
                raise RuntimeError("the engine died")
            return self.send(prompt_ids, params, seeds)

    running = [Running(Engine()), Running(Engine(fail_on_call=2)), Running(Engine())]
    try:
        pool = VLLMServers([r.url for r in running], TOKENIZER, [EOS], timeout=5)
        pool.update_weights(Policy())
        prompts = ["1+1 a=", "what b=", "c=", "and d=", "b=", "a="]
        params = SamplingParams(max_tokens=12, temperature=0.0, stop_strings=("</a>",), round_tokens=3)
        out, _ = continued(lambda rows: pool.resume(rows, params, GroupGenerators(list(range(len(rows))))),
                           [blank(p) for p in prompts])
    finally:
        for r in running:
            r.stop()
    assert pool.metrics()["vllm/server_failures"] == 1  # the second server, in the second round
    whole = [ScriptedVLLM().one(ids(p), 12, ["</a>"]) for p in prompts]
    assert [(r.completion_ids, r.finish_reason, r.text) for r in out] == [(w["completion_ids"], w["finish_reason"], w["text"]) for w in whole]
    assert all(r.engine.send.calls for r in running)


def test_on_vllms_own_server_each_row_is_a_request_from_its_tokens_so_far_naming_the_adapter(monkeypatch):
    """VLLMServers.resume on a stand-in of vLLM's OpenAI server with a LoRA slot: one request per row (n=1), its
    prompt the prompt and completion so far, its own max_tokens and seed, the model the adapter's name."""
    import rlvr.rollout.weights as weights
    from test_vllm_openai import FakeVLLM, LoraPolicy

    from rlvr.rollout.vllm_client import VLLMServers

    monkeypatch.setattr(weights, "adapter_weights", lambda m: ({"base_model.model.q_proj.lora_A.weight": m.lora_A.detach()},
                                                             {"peft_type": "LORA", "r": 2, "target_modules": ["q_proj"]}))
    fake = FakeVLLM(lora=True)
    try:
        pool = VLLMServers([fake.url], TOKENIZER, [EOS], timeout=30)
        pool.update_weights(LoraPolicy())
        partials = [Rollout([1, 2], [5, 6, 7], [-1.0] * 3, "partial", "abc"), blank("b="), blank("b=")]
        out = pool.resume(partials, SamplingParams(max_tokens=4, round_tokens=2), GroupGenerators.per_row([(GroupGenerators([3]), 1),
                                                                                                          (GroupGenerators([4]), 2)]))
    finally:
        fake.stop()
    sent = sorted(fake.completions, key=lambda r: r["seed"])
    assert [(r["prompt"], r["max_tokens"], r["n"], r["model"]) for r in sent if r["prompt"][0] == 1] == [([1, 2, 5, 6, 7], 1, 1, "rlvr-policy-1")]
    rows = [r for r in sent if r["prompt"] == ids("b=")]
    assert [r["max_tokens"] for r in rows] == [2, 2] and rows[1]["seed"] == rows[0]["seed"] + 1
    # the stand-in answers two tokens, [seed % 1000, 0], whatever max_tokens says: the first row is past max_tokens
    # ("length"), the new ones have their round's two and go on
    assert out[0].completion_ids[:3] == [5, 6, 7] and out[0].logprobs == [-1.0] * 3 + [-0.25, -0.5]
    assert [r.finish_reason for r in out] == ["length", "partial", "partial"]


def test_continued_text_is_cut_before_the_first_stop_string_and_drops_the_eos():
    from rlvr.rollout import decoded_text
    from rlvr.rollout.vllm_partial import straddling_stop

    assert decoded_text(ids("ab</a>cd") + [EOS], ("</a>", "cd"), {EOS}, TOKENIZER) == "ab"
    assert decoded_text(ids("xy") + [EOS], (), {EOS}, TOKENIZER) == "xy"
    assert straddling_stop(ids("ab<"), ids("/a>cd"), ("</a>",), TOKENIZER) == 3
    assert straddling_stop([], ids("</a>"), ("</a>",), TOKENIZER) is None  # vLLM's own to find
    assert straddling_stop(ids("ab"), ids("cdefgh</a>"), ("</a>",), TOKENIZER) is None  # past the window: vLLM found it


# --- the real engine (the vLLM environment): colocated, rlvr's server, vLLM's own server -------------

needs_vllm = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not installed here; run in "
                                "the vLLM environment: make vllm && .venv-vllm/bin/python -m pytest tests/test_vllm_partial.py")
SAMPLERS = ["colocate", "server", "stock_server"]
LOGPROB_TOLERANCE = 1e-4  # fp32 on the CPU; measured: 0 colocated and on rlvr's server, 1e-5 on vLLM's own (printed)


@pytest.fixture(scope="module")
def policy():
    """The default model's tokenizer, EOS ids and two chat prompts' ids (test_vllm.py's)."""
    from rlvr.chat import encode_prompts
    from rlvr.models import eos_token_ids, load_model

    model, tokenizer, path = load_model("default", "float32")
    prompts = ["What is 3 + 5? Explain.", "Write a short poem about the sea."]
    return tokenizer, eos_token_ids(model, tokenizer), encode_prompts(tokenizer, prompts, None, None), path


@pytest.fixture(scope="module")
def colocate(policy):
    from rlvr.rollout.vllm import VLLMColocateSampler

    tokenizer, eos, _, path = policy
    sampler = VLLMColocateSampler(path, tokenizer, eos, dtype="float32", kv_cache_memory_bytes=2**28, max_model_len=512,
                                  enforce_eager=True)
    yield sampler
    sampler.close()


def _serve(policy, log, *settings):
    from conftest import start_vllm_serve

    from rlvr.rollout.vllm_client import VLLMServers

    tokenizer, eos, _, _ = policy
    proc, url = start_vllm_serve(log, "vllm_kv_cache_gb=0.25", "max_prompt_length=256", "max_completion_length=256", *settings)
    try:
        client = VLLMServers([url], tokenizer, eos, timeout=400)
    except Exception:
        print(log.read_text()[-5000:])
        proc.terminate()
        proc.wait(timeout=60)
        raise
    client.url, client.proc = url, proc
    return client


@pytest.fixture(scope="module")
def server(policy, tmp_path_factory):
    """`rlvr vllm-serve` (rlvr's own server) and a client."""
    client = _serve(policy, tmp_path_factory.mktemp("serve") / "serve.log")
    yield client
    client.proc.terminate()
    client.proc.wait(timeout=60)


@pytest.fixture(scope="module")
def stock_server(policy, tmp_path_factory):
    """vLLM's own server (`rlvr vllm-serve vllm_server_impl=vllm`) and a client."""
    client = _serve(policy, tmp_path_factory.mktemp("serve") / "serve.log", "vllm_server_impl=vllm")
    yield client
    client.proc.terminate()
    client.proc.wait(timeout=60)


def _rows(sampler, prompt_ids, params, size):
    """Each prompt's `size` completions continued round by round from empty partials."""
    partials = [Rollout(list(p), [], [], "partial", "") for p in prompt_ids for _ in range(size)]
    first = GroupGenerators.per_row([(GroupGenerators(list(range(len(prompt_ids)))), size)])
    rounds = [0]

    def step(rows):
        rounds[0] += 1
        return sampler.resume(rows, params, first if rounds[0] == 1 else GroupGenerators(list(range(len(rows)))))

    return continued(step, partials)


@needs_vllm
@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("name", SAMPLERS)
@pytest.mark.parametrize("repetition_penalty", [1.0, 1.3])
def test_greedy_rounds_on_vllm_give_the_uninterrupted_completion(request, policy, name, repetition_penalty):
    """Greedy, 40 tokens in rounds of 7: the tokens, finish reasons and texts of one request, and its log-probs
    within LOGPROB_TOLERANCE (the tokens so far are read again, from the prefix cache); with a repetition
    penalty too (vLLM's counts the prompt's tokens, where the tokens so far now are)."""
    sampler = request.getfixturevalue(name)
    _, _, prompt_ids, _ = policy
    whole = SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=repetition_penalty)  # (vLLM: greedy is n=1)
    in_one_go = [r for g in sampler.generate(prompt_ids, whole, GroupGenerators([0, 1])) for r in g]
    out, rounds = _rows(sampler, prompt_ids, SamplingParams(max_tokens=40, temperature=0.0, repetition_penalty=repetition_penalty,
                                                            round_tokens=7), size=1)
    assert rounds >= 3
    gap = max(abs(a - b) for r, w in zip(out, in_one_go) for a, b in zip(r.logprobs, w.logprobs))
    print(f"\n{name}, repetition_penalty={repetition_penalty}: {rounds} rounds, largest log-prob gap {gap:.2e}")
    for r, w in zip(out, in_one_go):
        assert (r.completion_ids, r.finish_reason, r.text) == (w.completion_ids, w.finish_reason, w.text)
    assert gap < LOGPROB_TOLERANCE


@needs_vllm
@pytest.mark.trains
@pytest.mark.processes
@pytest.mark.parametrize("name", SAMPLERS)
def test_a_stop_string_split_over_two_rounds_is_found_on_vllm(request, policy, name):
    """A stop string made of the last characters of a greedy completion's first 10 tokens and the first of the next:
    in rounds of 10 tokens the completion ends where one request ends it, with its text."""
    sampler = request.getfixturevalue(name)
    tokenizer, _, prompt_ids, _ = policy
    (free,) = sampler.generate(prompt_ids[:1], SamplingParams(max_tokens=30, temperature=0.0), GroupGenerators([0]))
    text, head = free[0].text, len(tokenizer.decode(free[0].completion_ids[:10], skip_special_tokens=True))
    stop = next(text[head - 3 : head + k] for k in (2, 3, 4, 5) if text.find(text[head - 3 : head + k]) == head - 3)
    params = SamplingParams(max_tokens=30, temperature=0.0, stop_strings=(stop,))
    (whole,) = sampler.generate(prompt_ids[:1], params, GroupGenerators([0]))
    out, rounds = _rows(sampler, prompt_ids[:1], SamplingParams(max_tokens=30, temperature=0.0, stop_strings=(stop,), round_tokens=10),
                        size=1)
    assert whole[0].finish_reason == "stop" and whole[0].text == text[: head - 3] and rounds == 2
    assert (out[0].completion_ids, out[0].finish_reason, out[0].text) == (whole[0].completion_ids, "stop", whole[0].text)


@needs_vllm
@pytest.mark.trains
def test_new_groups_on_vllm_draw_what_generate_draws_for_them(colocate, policy):
    """Sampled (temperature 1, top-p): a round's new rows, their group's stream repeated for them, are seeded as
    vLLM seeds one request's n completions, so they are generate()'s completions of the group."""
    _, _, prompt_ids, _ = policy
    params = SamplingParams(n=3, max_tokens=12, temperature=1.0, top_p=0.9)
    groups = [r for g in colocate.generate(prompt_ids, params, GroupGenerators([5, 6])) for r in g]
    blank_rows = [Rollout(list(p), [], [], "partial", "") for p in prompt_ids for _ in range(3)]
    rows = colocate.resume(blank_rows, params, GroupGenerators.per_row([(GroupGenerators([5, 6]), 3)]))
    assert [r.completion_ids for r in rows] == [r.completion_ids for r in groups]
    assert len({tuple(r.completion_ids) for r in rows}) > 2  # sampled: not all alike


@needs_vllm
@pytest.mark.slow
@pytest.mark.trains
@pytest.mark.processes
def test_a_free_running_run_with_partial_rollouts_trains_on_a_vllm_server(server, tmp_path):
    """Three steps, completions of up to 32 tokens, 8 a round, sampled on `rlvr vllm-serve`: every step trains,
    completions were carried on to later rounds, and no token is older than max_staleness.  (Last: it sends
    the server new weights.)"""
    from pathlib import Path

    from conftest import metrics_rows

    from rlvr.config import build_config
    from rlvr.run import train

    out = tmp_path / "run"
    reward = f"{Path(__file__).parents[1] / 'benchmarks' / 'speed.py'}:bench_reward"
    train(build_config({"use_vllm": True, "vllm_mode": "server", "vllm_server_base_url": server.url, "max_steps": 3,
                        "num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 32,
                        "max_prompt_length": 256, "learning_rate": 1e-5, "eval_on_start": False, "eval_on_end": False,
                        "report_steps": 0, "logging_steps": 1, "save_steps": 1000, "reward_funcs": [reward],
                        "max_staleness": 2, "async_mode": "free", "partial_rollout_tokens": 8, "output_dir": str(out)}))
    rows = metrics_rows(out)
    assert [r["step"] for r in rows] == [1, 2, 3]
    print("\n" + "\n".join(f"step {r['step']}: rounds {r['sampling/rounds']}, carried {r['sampling/carried_groups']}, "
                           f"staleness max {r['sampling/staleness_max']}" for r in rows))
    assert any(r["sampling/rounds"] >= 1 for r in rows) and all("sampling/carried_groups" in r for r in rows)
    assert all(r["sampling/staleness_max"] <= 2 for r in rows)
