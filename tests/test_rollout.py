import math

import pytest
import torch

from rlvr.chat import encode_prompts
from rlvr.models import eos_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, HFSampler
from rlvr.rollout.sampling import filter_logits, penalize_repetition, sample_next, seen_tokens

NEG = float("-inf")


def test_top_k_keeps_the_k_largest():
    out = filter_logits(torch.tensor([[1.0, 4.0, 3.0, 2.0]]), top_k=2)
    assert out.tolist() == [[NEG, 4.0, 3.0, NEG]]


def test_top_p_keeps_the_smallest_set_reaching_p():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    # sorted: 0.5, 0.3, 0.15, 0.05; mass before 0.15 is 0.8 >= 0.8 -> dropped
    kept = torch.isfinite(filter_logits(logits, top_p=0.8))
    assert kept.tolist() == [[False, True, False, True]]
    kept = torch.isfinite(filter_logits(logits, top_p=0.81))
    assert kept.tolist() == [[False, True, True, True]]
    # the most likely token survives any top_p
    assert torch.isfinite(filter_logits(logits, top_p=0.01)).sum() == 1


def test_greedy_and_logprob_definitions():
    logits = torch.tensor([[0.0, 2.0, 1.0]])
    tok, lp = sample_next(logits, temperature=0)
    assert tok.item() == 1
    assert lp.item() == pytest.approx(torch.log_softmax(logits, -1)[0, 1].item())
    g = torch.Generator().manual_seed(0)
    tok, lp = sample_next(logits, temperature=0.5, top_k=1, generator=g)
    # top_k=1 is greedy; the log-prob is under softmax(logits / T), untruncated
    assert tok.item() == 1
    assert lp.item() == pytest.approx(torch.log_softmax(logits / 0.5, -1)[0, 1].item(), abs=1e-6)


def test_sampling_frequencies_follow_the_truncated_distribution():
    probs = torch.tensor([0.1, 0.2, 0.3, 0.4])
    logits = torch.log(probs).expand(20000, 4)
    tok, _ = sample_next(logits, temperature=1.0, top_k=2, generator=torch.Generator().manual_seed(0))
    freq = torch.bincount(tok, minlength=4).float() / len(tok)
    assert freq[0] == 0 and freq[1] == 0  # outside the top 2
    assert freq[3].item() == pytest.approx(0.4 / 0.7, abs=0.015)  # renormalised over the top 2


@pytest.mark.parametrize(
    "shape,top_k,top_p,min_p",
    [
        ("peaked", 0, 0.9, 0.0),
        ("peaked", 5, 1.0, 0.0),
        ("peaked", 20, 0.8, 0.0),
        ("flat", 0, 0.95, 0.0),  # the nucleus spans ~950 of 1000 tokens: beyond the 256 examined first
        ("flat", 600, 0.5, 0.0),
        ("flat", 0, 1.0, 0.0),
        ("peaked", 0, 1.0, 0.1),
        ("peaked", 20, 0.9, 0.05),  # all three truncations: top-k, then top-p, then min-p
        ("flat", 0, 1.0, 0.5),  # min-p keeps every token: beyond the 256 examined first
    ],
)
def test_fast_sampling_draws_from_the_reference_distribution(shape, top_k, top_p, min_p):
    g = torch.Generator().manual_seed(0)
    vocab = 1000
    base = torch.randn(vocab, generator=g) * (3.0 if shape == "peaked" else 0.05)
    expected = torch.softmax(filter_logits(base[None] / 0.7, top_k, top_p, min_p), -1)[0]
    draws = 40_000
    tokens, logprobs = sample_next(base.expand(draws, vocab), 0.7, top_k, top_p, torch.Generator().manual_seed(1), min_p=min_p)
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (freq[expected == 0] == 0).all()  # nothing outside the top-k / nucleus is ever drawn
    # total variation distance between the empirical and the reference distribution
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < (0.02 if shape == "peaked" else 0.13)  # 1000 tokens, 40k draws: sampling noise ~0.1
    assert torch.allclose(logprobs, torch.log_softmax(base / 0.7, -1)[tokens], atol=1e-5)


# --- repetition penalty and min-p, against transformers' logits processors -----------------


def test_repetition_penalty_by_hand():
    logits = torch.tensor([[2.0, -1.0, 0.5, 0.0, 3.0]])
    seen = seen_tokens([[0, 1, 3, 1]], vocab=5)  # tokens 0, 1 and 3 were seen (1 twice: penalised once)
    # seen: 2.0 / 2 = 1.0, -1.0 * 2 = -2.0, 0.0 stays 0.0; unseen 0.5 and 3.0 unchanged
    assert penalize_repetition(logits, seen, 2.0).tolist() == [[1.0, -2.0, 0.5, 0.0, 3.0]]
    # a penalty below 1 makes seen tokens more likely: 2.0 / 0.5 = 4.0, -1.0 * 0.5 = -0.5
    assert penalize_repetition(logits, seen, 0.5).tolist() == [[4.0, -0.5, 0.5, 0.0, 3.0]]


@pytest.mark.parametrize("penalty", [1.3, 0.7, 5.0])
def test_repetition_penalty_equals_transformers(penalty):
    from transformers import RepetitionPenaltyLogitsProcessor

    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 300, generator=g) * 4
    ids = torch.randint(0, 300, (6, 40), generator=g)  # each row's prompt and completion so far
    expected = RepetitionPenaltyLogitsProcessor(penalty)(ids, logits.clone())
    assert torch.equal(penalize_repetition(logits, seen_tokens(ids.tolist(), 300), penalty), expected)


def test_min_p_by_hand():
    logits = torch.log(torch.tensor([[0.05, 0.5, 0.15, 0.3]]))
    # min_p 0.2: threshold 0.2 x 0.5 = 0.1 drops only the 0.05 token
    assert torch.isfinite(filter_logits(logits, min_p=0.2)).tolist() == [[False, True, True, True]]
    # min_p 0.5: threshold 0.25 keeps 0.5 and 0.3
    assert torch.isfinite(filter_logits(logits, min_p=0.5)).tolist() == [[False, True, False, True]]
    # min_p 1 keeps only the most likely token
    assert torch.isfinite(filter_logits(logits, min_p=1.0)).tolist() == [[False, True, False, False]]


@pytest.mark.parametrize("top_k,top_p,min_p", [(0, 1.0, 0.05), (0, 1.0, 0.3), (0, 1.0, 1.0), (0, 1.0, 0.0),
                                               (50, 0.9, 0.1), (0, 0.95, 0.02)])
def test_truncation_equals_transformers_warpers(top_k, top_p, min_p):
    """filter_logits is transformers' TopK -> TopP -> MinP chain, in that order (generate's)."""
    from transformers import MinPLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    logits = torch.randn(8, 500, generator=torch.Generator().manual_seed(0)) * 3
    ids = torch.zeros(8, 1, dtype=torch.long)
    expected = logits.clone()
    if top_k:
        expected = TopKLogitsWarper(top_k)(ids, expected)
    if top_p < 1.0:
        expected = TopPLogitsWarper(top_p)(ids, expected)
    expected = MinPLogitsWarper(min_p)(ids, expected)
    assert torch.equal(filter_logits(logits, top_k, top_p, min_p), expected)


def test_penalised_sampling_draws_from_the_penalised_distribution_and_reports_the_models_logprobs():
    g = torch.Generator().manual_seed(0)
    vocab, draws = 50, 40_000
    base = torch.randn(vocab, generator=g) * 2
    seen = torch.zeros(vocab, dtype=torch.bool)
    seen[:10] = True
    expected = torch.softmax(filter_logits(penalize_repetition(base[None], seen[None], 2.0) / 0.7, min_p=0.05), -1)[0]
    tokens, logprobs = sample_next(base.expand(draws, vocab), 0.7, generator=torch.Generator().manual_seed(1), min_p=0.05,
                                   repetition_penalty=2.0, seen=seen.expand(draws, vocab))
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (freq[expected == 0] == 0).all()
    assert 0.5 * (freq - expected).abs().sum().item() < 0.02
    # the log-prob is the model's, unpenalised and untruncated: what the update recomputes
    assert torch.allclose(logprobs, torch.log_softmax(base / 0.7, -1)[tokens], atol=1e-5)
    # greedy takes the argmax of the penalised logits and reports the model's log-prob of it
    tok, lp = sample_next(base[None], 0, repetition_penalty=2.0, seen=seen[None])
    assert tok.item() == penalize_repetition(base[None], seen[None], 2.0).argmax().item()
    assert lp.item() == pytest.approx(torch.log_softmax(base, -1)[tok].item())
    with pytest.raises(ValueError, match="repetition_penalty needs `seen`"):
        sample_next(base[None], 0.7, repetition_penalty=2.0)


# --- the settings: the config's, with generation_kwargs over them (TRL's order) ----------------


def test_generation_kwargs_set_the_sampling_settings_by_their_transformers_and_vllm_names():
    from rlvr.config import build_config
    from rlvr.rollout import sampling_params

    cfg = build_config({"num_generations": 4, "per_device_train_batch_size": 8, "max_completion_length": 64,
                        "temperature": 0.9, "top_k": 5, "min_p": 0.2, "stop_strings": ["</answer>"],
                        "generation_kwargs": {"temperature": 0.6, "top_k": -1, "top_p": 0.95, "repetition_penalty": 1.1,
                                              "stop": "\n\n", "max_new_tokens": 64, "do_sample": True}})
    assert sampling_params(cfg.rollout_settings) == SamplingParams(n=4, max_tokens=64, temperature=0.6, top_p=0.95, top_k=0, min_p=0.2,
                                                  repetition_penalty=1.1, stop_strings=("\n\n",))
    # min_p null is off; vLLM's spelling of the stop strings, and transformers' of "no top-k"
    cfg = build_config({"generation_kwargs": {"min_p": None, "stop_strings": ["a", "b"], "top_k": None}, "min_p": 0.1})
    assert (sampling_params(cfg.rollout_settings).min_p, sampling_params(cfg.rollout_settings).stop_strings, sampling_params(cfg.rollout_settings).top_k) == (0.0, ("a", "b"), 0)


@pytest.mark.parametrize("kwargs,message", [
    ({"seed": 3}, "generation_kwargs.seed is not supported yet; generation_kwargs may set: temperature, top_p, top_k, min_p"),
    ({"frequency_penalty": 0.5}, "generation_kwargs.frequency_penalty is not supported yet"),
    ({"max_tokens": 100}, "generation_kwargs.max_tokens=100: set max_completion_length=100 instead"),
    ({"max_new_tokens": 100}, "generation_kwargs.max_new_tokens=100: set max_completion_length=100 instead"),
    ({"do_sample": False}, "generation_kwargs.do_sample=False: training rollouts are always sampled"),
    ({"top_k": 2.5}, "generation_kwargs.top_k must be a whole number; got 2.5"),
    ({"temperature": "hot"}, "generation_kwargs.temperature must be a number; got 'hot'"),
    ({"stop": [1, 2]}, "generation_kwargs.stop must be a string or a list of strings"),
    ({"top_p": 1.5}, "top_p must be in (0, 1]; got 1.5"),  # the settings' own rules apply to the values given here
    ({"temperature": 0}, "temperature must be > 0"),
    ({"min_p": 2}, "min_p must be in [0, 1]"),
    ({"repetition_penalty": -1}, "repetition_penalty must be > 0"),
])
def test_generation_kwargs_rlvr_cannot_take_fail_before_a_model_loads(kwargs, message):
    from rlvr.config import ConfigError, build_config
    from rlvr.settings import check_settings

    with pytest.raises(ConfigError) as e:
        check_settings(build_config({"generation_kwargs": kwargs}))  # generation_kwargs are checked at launch
    assert message in str(e.value)


# --- the in-process engines on the tiny model: the generic one and rlvr's fast one ---------


@pytest.fixture(params=[HFSampler, FastSampler], ids=["generic", "fast"])
def sampler_cls(request):
    return request.param


def _prompts(tokenizer, texts):
    return encode_prompts(tokenizer, texts, None, None)


def test_greedy_matches_transformers_generate(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, eos_token_ids=[10_000])  # an id never produced: run to length
    ids = _prompts(tokenizer, ["what is 3+5?"])
    out = sampler.generate(ids, SamplingParams(n=1, max_tokens=12, temperature=0))[0][0]
    x = torch.tensor(ids)
    ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12, eos_token_id=None, pad_token_id=0)
    assert out.completion_ids == ref[0, x.shape[1]:].tolist()
    assert out.finish_reason == "length" and len(out.completion_ids) == 12


def test_batched_left_padded_rows_equal_their_unbatched_runs(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, eos_token_ids=[10_000])
    texts = ["a", "what is 12+7?", "hello there, how are you"]
    params = SamplingParams(n=1, max_tokens=8, temperature=0)
    batched = sampler.generate(_prompts(tokenizer, texts), params)
    for text, group in zip(texts, batched):
        alone = sampler.generate(_prompts(tokenizer, [text]), params)[0][0]
        assert group[0].completion_ids == alone.completion_ids
        assert group[0].logprobs == pytest.approx(alone.logprobs, abs=1e-4)


def test_rows_that_stop_early_leave_the_others_unchanged(tiny, sampler_cls):
    model, tokenizer = tiny
    texts = ["a", "what is 12+7?", "hello there"]
    params = SamplingParams(n=1, max_tokens=10, temperature=0)
    free = sampler_cls(model, tokenizer, eos_token_ids=[10_000]).generate(_prompts(tokenizer, texts), params)
    # Make the 3rd token of the first row an end token: that row stops, the cache drops it.
    stop_id = free[0][0].completion_ids[2]
    stopped = sampler_cls(model, tokenizer, eos_token_ids=[stop_id]).generate(_prompts(tokenizer, texts), params)
    first = stopped[0][0]
    assert first.finish_reason == "stop" and first.completion_ids[-1] == stop_id
    assert first.completion_ids == free[0][0].completion_ids[: free[0][0].completion_ids.index(stop_id) + 1]
    for i in (1, 2):
        ids = free[i][0].completion_ids
        expect = ids[: ids.index(stop_id) + 1] if stop_id in ids else ids
        assert stopped[i][0].completion_ids == expect


def test_eos_is_cut_from_the_text(tiny, sampler_cls):
    model, tokenizer = tiny
    free = sampler_cls(model, tokenizer, [10_000]).generate(_prompts(tokenizer, ["x"]), SamplingParams(max_tokens=6, temperature=0))[0][0]
    stop_id = free.completion_ids[3]
    out = sampler_cls(model, tokenizer, [stop_id]).generate(_prompts(tokenizer, ["x"]), SamplingParams(max_tokens=6, temperature=0))[0][0]
    k = free.completion_ids.index(stop_id)
    assert out.text == tokenizer.decode(free.completion_ids[:k], skip_special_tokens=True)


def test_stop_strings_end_the_completion_and_are_cut(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, eos_token_ids=[10_000])
    ids = _prompts(tokenizer, ["what is 3+5?"])
    free = sampler.generate(ids, SamplingParams(max_tokens=16, temperature=0))[0][0]
    stop = free.text[5:7]  # two characters the greedy text contains
    cut = free.text.find(stop)
    out = sampler.generate(ids, SamplingParams(max_tokens=16, temperature=0, stop_strings=(stop,)))[0][0]
    assert out.finish_reason == "stop"
    assert out.text == free.text[:cut]
    assert len(out.completion_ids) == cut + len(stop)  # one character per token here: up to the stop string's end


def test_groups_and_sampling_logprobs_match_the_update(tiny, sampler_cls):
    from rlvr.config import build_config
    from rlvr.trainer import Trainer
    from rlvr.types import Batch, Example

    model, tokenizer = tiny
    cfg = build_config({"model": "default", "temperature": 0.7, "task_args": {"num_test": 10}})
    trainer = Trainer(cfg, model, tokenizer, [Example("q", "1")], output_dir=".", total_steps=1)
    sampler = sampler_cls(model, tokenizer, eos_token_ids(model, tokenizer))
    ids = _prompts(tokenizer, ["what is 3+5?", "a"])
    groups = sampler.generate(ids, SamplingParams(n=3, max_tokens=7, temperature=0.7), torch.Generator().manual_seed(0))
    assert [len(g) for g in groups] == [3, 3]
    assert all(r.prompt_ids == ids[i] for i, g in enumerate(groups) for r in g)
    rollouts = [r for g in groups for r in g]
    batch = Batch.from_rollouts(rollouts, torch.zeros(6), torch.ones(6, dtype=torch.bool), 0, False, group_size=3)
    with torch.no_grad():
        fast, _ = trainer.logprobs(model, batch)  # rlvr's forward
        reference, _ = trainer.logprobs.padded(model, batch)  # the Hugging Face forward
    for i, r in enumerate(rollouts):
        assert fast[i, : len(r.logprobs)].tolist() == pytest.approx(r.logprobs, abs=1e-4)
        assert reference[i, : len(r.logprobs)].tolist() == pytest.approx(r.logprobs, abs=1e-4)


def test_many_rows_finishing_at_different_times(tiny, sampler_cls):
    model, tokenizer = tiny
    texts = ["a", "bb", "what is 12+7?", "hello there", "x y z", "7", "q?", "the end"]
    params = SamplingParams(n=2, max_tokens=12, temperature=0)
    free = HFSampler(model, tokenizer, [10_000]).generate(_prompts(tokenizer, texts), params)
    # every token id that some row produces early becomes an end token: rows stop one by one
    stop_ids = sorted({g[0].completion_ids[k] for g in free for k in (1, 4)})[:3]
    stopped = sampler_cls(model, tokenizer, stop_ids).generate(_prompts(tokenizer, texts), params)
    for f, s in zip(free, stopped):
        for fr, sr in zip(f, s):
            cut = next((k + 1 for k, t in enumerate(fr.completion_ids) if t in stop_ids), len(fr.completion_ids))
            assert sr.completion_ids == fr.completion_ids[:cut]
            assert sr.finish_reason == ("stop" if cut < len(fr.completion_ids) or fr.completion_ids[-1] in stop_ids else "length")


def test_sampling_is_reproducible_with_a_seeded_generator(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, eos_token_ids(model, tokenizer))
    ids = _prompts(tokenizer, ["a", "b"])
    params = SamplingParams(n=4, max_tokens=6, temperature=1.0, top_p=0.9)
    a = sampler.generate(ids, params, torch.Generator().manual_seed(3))
    b = sampler.generate(ids, params, torch.Generator().manual_seed(3))
    assert [[r.completion_ids for r in g] for g in a] == [[r.completion_ids for r in g] for g in b]
    model.train()
    sampler.generate(ids, params)
    assert model.training  # the sampler switched to eval for the call and back afterwards


def test_empty_prompt_is_refused(tiny, sampler_cls):
    model, tokenizer = tiny
    with pytest.raises(ValueError, match="empty prompt"):
        sampler_cls(model, tokenizer, [2]).generate([[]], SamplingParams())


def test_a_long_prompt_is_not_cut_and_one_past_the_context_is_refused(tiny, sampler_cls):
    # The tiny model's context is 256 positions. As TRL, nothing cuts a prompt unless max_prompt_length does.
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, [2])
    long_prompt = [5 + i % 20 for i in range(250)]
    [[rollout]] = sampler.generate([long_prompt], SamplingParams(max_tokens=3, n=1))
    assert rollout.prompt_ids == long_prompt
    with pytest.raises(RuntimeError, match="a prompt of 256 tokens does not fit the model's context of 256 tokens "
                                           r"\(max_position_embeddings\); set max_prompt_length"):
        sampler.generate([long_prompt + [5] * 6], SamplingParams(max_tokens=3, n=1))


def test_a_max_prompt_length_past_the_models_context_is_refused_when_the_model_loads(tiny_run_config, tmp_path):
    """open-r1's recipes set max_prompt_length 512; on a model of 256 positions that cuts nothing and
    leaves no room to sample: the run says so in one line before any step."""
    from rlvr.config import ConfigError
    from rlvr.run import train

    with pytest.raises(ConfigError, match=r"^max_prompt_length=512 leaves no room for a completion in the model's context "
                                          r"of 256 tokens \(max_position_embeddings\): set it below 256$"):
        train(tiny_run_config(tmp_path / "run", max_prompt_length=512))
    assert not (tmp_path / "run" / "metrics.jsonl").exists()


def test_repetition_penalty_greedy_equals_transformers_generate(tiny, sampler_cls):
    """Greedy with a repetition penalty decodes what transformers' generate decodes with the same
    penalty (over the prompt and the completion so far), also for rows whose neighbours stopped early."""
    model, tokenizer = tiny
    ids = _prompts(tokenizer, ["a", "what is 12+7?", "hello there"])
    params = SamplingParams(n=2, max_tokens=12, temperature=0, repetition_penalty=10.0)
    free = sampler_cls(model, tokenizer, [10_000]).generate(ids, params)
    plain = sampler_cls(model, tokenizer, [10_000]).generate(ids, SamplingParams(n=1, max_tokens=12, temperature=0))
    assert [g[0].completion_ids for g in free] != [g[0].completion_ids for g in plain]  # the penalty changes the text
    stop_id = free[0][0].completion_ids[2]  # the first prompt's rows end early, the others decode on without them
    stopped = sampler_cls(model, tokenizer, [stop_id]).generate(ids, params)
    for prompt, group in zip(ids, stopped):
        x = torch.tensor([prompt])
        ref = model.generate(x, attention_mask=torch.ones_like(x), do_sample=False, max_new_tokens=12,
                             repetition_penalty=10.0, eos_token_id=stop_id, pad_token_id=0)[0, x.shape[1]:].tolist()
        assert [r.completion_ids for r in group] == [ref, ref]


def test_min_p_of_one_is_greedy(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, [10_000])
    ids = _prompts(tokenizer, ["what is 3+5?", "a"])
    greedy = sampler.generate(ids, SamplingParams(n=1, max_tokens=10, temperature=0))
    sampled = sampler.generate(ids, SamplingParams(n=3, max_tokens=10, temperature=1.0, min_p=1.0), torch.Generator().manual_seed(0))
    for g, s in zip(greedy, sampled):
        assert all(r.completion_ids == g[0].completion_ids for r in s)


def _repeated_fraction(groups) -> float:
    """The share of completion tokens already present in the prompt or earlier in the completion."""
    repeats = total = 0
    for r in (r for g in groups for r in g):
        seen = set(r.prompt_ids)
        for t in r.completion_ids:
            repeats, total = repeats + (t in seen), total + 1
            seen.add(t)
    return repeats / total


def test_a_strong_repetition_penalty_repeats_fewer_tokens(tiny, sampler_cls):
    model, tokenizer = tiny
    sampler = sampler_cls(model, tokenizer, [10_000])
    ids = _prompts(tokenizer, ["what is 3+5?", "hello there"])

    def repeated(penalty: float) -> float:
        params = SamplingParams(n=8, max_tokens=24, temperature=0.1, repetition_penalty=penalty)
        return _repeated_fraction(sampler.generate(ids, params, torch.Generator().manual_seed(0)))

    plain, penalised = repeated(1.0), repeated(3.0)
    # measured on this model, both engines: 0.88 of the tokens are repeats without the penalty, 0.34 with it
    assert penalised < 0.6 * plain, (plain, penalised)
