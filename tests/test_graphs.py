"""The decode step with static shapes (rollout/graphs.py), which CUDA graphs replay on a GPU, run
eagerly here: it gives llama.py's decode logits and the fast sampler's tokens, through windows that
grow, rows that finish and the cache compacted to a power of two.  The graphs themselves are
checked on a GPU (tests/test_gpu.py)."""

import pytest
import torch

from rlvr.llama import LlamaRunner
from rlvr.rollout import SamplingParams
from rlvr.rollout.engine import FastSampler, GraphSampler, make_sampler
from rlvr.rollout.graphs import StaticDecoder
from tests.test_fast_path import FAMILIES, make_family_model

PROMPTS = [[1, 24, 22, 8, 33, 41, 35], [1, 24, 9], [1, 30, 31, 32, 33, 34, 35, 36, 37, 38, 39]]


@pytest.fixture(params=FAMILIES)
def family(request, tiny):
    _, tokenizer = tiny
    return make_family_model(request.param, len(tokenizer)), tokenizer


@torch.no_grad()
def test_the_static_step_gives_the_decode_logits_as_rows_finish(family):
    """Two caches from the same prefill (3 prompts x 3 = 9 rows): one decoded by llama.py, one by
    the static step with 4-column windows.  After rows finish, 4 live rows of 9 run on a prefix of
    4 cache rows, 2 on 2, 1 on 1; the logits of the live rows agree at every step."""
    model, _ = family
    runner = LlamaRunner(model)
    _, ref = runner.prefill(PROMPTS, 3, 16, torch.float32)
    _, state = runner.prefill(PROMPTS, 3, 16, torch.float32)
    state.k[..., state.length :] = float("nan")  # unwritten columns may hold anything: they are zeroed
    state.v[..., state.length :, :] = float("nan")
    decoder = StaticDecoder(runner, state, graphs=False, block=4)
    tokens = torch.arange(40, 49)
    drops = {3: [0, 2, 3, 5, 8], 5: [1, 2, 4], 7: [0, 2], 9: [1]}  # after step: live rows kept (indices into the live rows)
    used = []
    for step in range(12):
        expected = runner.decode(tokens, ref)
        got = decoder.step(tokens)
        assert got.shape == expected.shape and torch.isfinite(got).all()
        torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
        tokens = got.argmax(-1)
        if step in drops:
            keep = torch.tensor(drops[step])
            ref.hold(keep)
            decoder.drop(keep)
            tokens = tokens[keep]
        used.append(decoder.used)
    assert used == [9] * 3 + [8] * 2 + [4] * 2 + [2] * 2 + [1] * 3


def test_the_graph_sampler_samples_what_the_fast_sampler_samples(family):
    """Sampling at temperature 1 with one seed, with an end-of-sequence token the tiny models write
    often (so rows finish at different steps): the same tokens and log-probs from both samplers."""
    model, tokenizer = family
    params = SamplingParams(n=4, max_tokens=20, temperature=1.0)
    eos = [7, 11, 13, 17, 19, 23, 29, 31]
    fast = FastSampler(model, tokenizer, eos).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    static = GraphSampler(model, tokenizer, eos, graphs=False, block=8).generate(PROMPTS, params, torch.Generator().manual_seed(3))
    lengths = set()
    for fast_group, static_group in zip(fast, static):
        for f, s in zip(fast_group, static_group):
            assert f.completion_ids == s.completion_ids and f.finish_reason == s.finish_reason
            assert max(abs(a - b) for a, b in zip(f.logprobs, s.logprobs)) < 1e-4
            lengths.add(len(f.completion_ids))
    assert len(lengths) > 3  # rows did finish at different steps


def test_the_cpu_keeps_the_fast_sampler(tiny):
    model, tokenizer = tiny
    assert type(make_sampler(model, tokenizer, [2])) is FastSampler
    assert type(make_sampler(model, tokenizer, [2], cuda_graphs=False)) is FastSampler
