import math

import pytest
import torch

from rlvr.chat import encode_prompts
from rlvr.models import eos_token_ids
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, HFSampler
from rlvr.rollout.sampling import filter_logits, sample_next

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
    "shape,top_k,top_p",
    [
        ("peaked", 0, 0.9),
        ("peaked", 5, 1.0),
        ("peaked", 20, 0.8),
        ("flat", 0, 0.95),  # the nucleus spans ~950 of 1000 tokens: beyond the 256 examined first
        ("flat", 600, 0.5),
        ("flat", 0, 1.0),
    ],
)
def test_fast_sampling_draws_from_the_reference_distribution(shape, top_k, top_p):
    from rlvr.rollout.sampling import sample_next

    g = torch.Generator().manual_seed(0)
    vocab = 1000
    base = torch.randn(vocab, generator=g) * (3.0 if shape == "peaked" else 0.05)
    expected = torch.softmax(filter_logits(base[None] / 0.7, top_k, top_p), -1)[0]
    draws = 40_000
    tokens, logprobs = sample_next(base.expand(draws, vocab), 0.7, top_k, top_p, torch.Generator().manual_seed(1))
    freq = torch.bincount(tokens, minlength=vocab).float() / draws
    assert (freq[expected == 0] == 0).all()  # nothing outside the top-k / nucleus is ever drawn
    # total variation distance between the empirical and the reference distribution
    tv = 0.5 * (freq - expected).abs().sum().item()
    assert tv < (0.02 if shape == "peaked" else 0.13)  # 1000 tokens, 40k draws: sampling noise ~0.1
    assert torch.allclose(logprobs, torch.log_softmax(base / 0.7, -1)[tokens], atol=1e-5)


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
