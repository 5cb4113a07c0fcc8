"""Process rewards: step scores (char_offset, score), placed on their tokens, normalised per group,
summed from each token to the end (advantages.step_advantages); values worked out by hand."""

import math

import pytest
import torch

from conftest import make_tokenizer
from rlvr.advantages import EPS, group_advantages, step_advantages
from rlvr.config import build_config
from rlvr.losses import LossNorm, policy_loss
from rlvr.rewards import RewardError, RewardSet, register_reward
from rlvr.rollout.steps import token_of, token_steps
from rlvr.trainer import Trainer
from rlvr.types import Batch, Example, Rollout


# --- the rule -------------------------------------------------------------------------------


def close(t: torch.Tensor, expected) -> bool:
    return torch.allclose(t, torch.tensor(expected, dtype=t.dtype), atol=1e-6)


def test_step_advantages_by_hand():
    # One group of 2.  Completion A (4 tokens): steps ending at tokens 1 (score 1) and 3 (score 0);
    # completion B (3 tokens): one step ending at token 2 (score 1).  The pool [1, 0, 1] has mean 2/3;
    # without scaling the steps are +1/3, -2/3 (A) and +1/3 (B).  A token's advantage sums the steps
    # ending at or after it: A = [1/3 - 2/3, 1/3 - 2/3, -2/3, -2/3]; B = [1/3] * 3, then padding 0.
    adv, zero_std = step_advantages([{1: 1.0, 3: 0.0}, {2: 1.0}], [4, 3], 2, "none")
    third = 1 / 3
    assert close(adv, [[-third, -third, -2 * third, -2 * third], [third, third, third, 0.0]])
    assert zero_std.tolist() == [False]
    # group scaling divides by the pool's sample std: squared deviations 1/9 + 4/9 + 1/9 over 2 -> 1/3
    scaled, _ = step_advantages([{1: 1.0, 3: 0.0}, {2: 1.0}], [4, 3], 2, "group")
    assert torch.allclose(scaled, adv / (math.sqrt(1 / 3) + EPS))


def test_batch_scaling_divides_every_group_by_the_std_of_all_steps():
    # group 1 pool [2, 0] (mean 1), group 2 pool [1, 1, 1] (no signal); all five: mean 1, squares 1 + 1 over 4
    adv, zero_std = step_advantages([{0: 2.0}, {0: 0.0}, {0: 1.0, 1: 1.0}, {1: 1.0}], [1, 1, 2, 2], 2, "batch")
    a = 1 / (math.sqrt(0.5) + EPS)
    assert close(adv, [[a, 0.0], [-a, 0.0], [0.0, 0.0], [0.0, 0.0]])
    assert zero_std.tolist() == [False, True]


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_one_step_at_the_end_is_grpo_on_every_token(scale):
    # scores given as one number end at the last token: every token gets group_advantages' value
    rewards = torch.tensor([1.0, 0.0, 0.5, 3.0, 3.0, 3.0])
    lengths = [3, 1, 2, 4, 2, 3]
    adv, zero_std = step_advantages([{n - 1: r.item()} for r, n in zip(rewards, lengths)], lengths, 3, scale)
    expected, expected_zero = group_advantages(rewards, 3, scale)
    for i, n in enumerate(lengths):
        assert adv[i, :n].tolist() == pytest.approx([expected[i].item()] * n, abs=1e-6)
        assert adv[i, n:].abs().sum() == 0
    assert zero_std.tolist() == expected_zero.tolist() == [False, True]


def test_a_step_must_end_at_a_token_of_its_completion():
    with pytest.raises(ValueError, match="every completion needs a step"):
        step_advantages([{0: 1.0}, {}], [1, 1], 2)
    with pytest.raises(ValueError, match="every completion needs a step"):
        step_advantages([{0: 1.0}, {5: 1.0}], [1, 3], 2)


# --- from characters to tokens --------------------------------------------------------------


def test_a_step_ends_at_the_token_that_holds_its_last_character():
    tok = make_tokenizer(list("abcxyz") + ["abc", "xy"])  # multi-character tokens, by id
    ids = [tok.convert_tokens_to_ids(t) for t in ["abc", "x", "xy", "z"]]  # "abc" "x" "xy" "z" -> "abcxxyz"
    assert tok.decode(ids) == "abcxxyz"
    # offsets 1..3 end inside "abc" (token 0), 4 is "x" (token 1), 5 and 6 are "xy" (token 2), 7 is "z"
    assert [token_of(tok, ids, c) for c in range(1, 8)] == [0, 0, 0, 1, 2, 2, 3]
    rollout = Rollout([1], ids, [0.0] * 4, "stop", "abcxxyz")
    # steps ending in the same token add up; what a KL in the reward charged goes to the end
    assert token_steps([(2, 1.0), (3, 0.5), (6, -1.0), (None, 2.0)], rollout, tok, charged=-0.25) == \
        {0: 1.5, 2: -1.0, 3: 1.75}
    assert token_steps([], rollout, tok) == {3: 0.0}  # no score at all: 0 at the end, as a total of Nones
    # a step that ends where the text ends takes the end-of-sequence token with it, as a number does
    ended = Rollout([1], ids + [tok.eos_token_id], [0.0] * 5, "stop", "abcxxyz")
    assert token_steps([(6, 1.0), (7, 0.5), (None, 2.0)], ended, tok) == {2: 1.0, 4: 2.5}


def test_step_scores_are_for_single_turn_rollouts():
    tok = make_tokenizer()
    multi = Rollout([1], [5, 6, 7], [0.0] * 3, "stop", "abc", mask=[True, False, True])
    with pytest.raises(RewardError, match="single-turn"):
        token_steps([(1, 1.0)], multi, tok)
    assert token_steps([(None, 1.0)], multi, tok) == {2: 1.0}  # a number per rollout still works


# --- what reward functions may return -------------------------------------------------------


def rewards_of(*fns, **kwargs) -> RewardSet:
    """The functions as GRPOTrainer's reward_funcs gives them, run in this process."""
    return RewardSet([register_reward(fn) for fn in fns], isolation="inline", **kwargs)


def _steps(completions, **kwargs):
    return [[(1, 1.0), (len(c), 0.5)] if c.startswith("a") else 0.25 for c in completions]


def _outcome(completions, **kwargs):
    return [1.0 if c.endswith("b") else None for c in completions]


def test_a_reward_set_weighs_steps_and_puts_the_numbers_at_the_end():
    rs = rewards_of(_steps, _outcome, weights=[2.0, -1.0])
    scores = rs.score(["ab", "cb", "cc"], {})
    assert scores.per_func == {"_steps": [1.5, 0.25, 0.25], "_outcome": [1.0, 1.0, None]}  # a step list counts as its sum
    assert scores.total == [2.0, -0.5, 0.5]
    # "ab": its two steps x 2, and _outcome's 1 x -1 at the end; "cb": both numbers at the end; "cc": one
    assert scores.steps == [[(1, 2.0), (2, 1.0), (None, -1.0)], [(None, -0.5)], [(None, 0.5)]]
    assert rewards_of(_outcome).score(["ab"], {}).steps is None  # no steps: as before


@pytest.mark.parametrize("returned, message", [
    ("[[(0, 1.0)]]", r"step offset 0 for a completion of 2 characters; .* an integer from 1 to 2"),
    ("[[(3, 1.0)]]", "step offset 3"),
    ("[[(1.5, 1.0)]]", "step offset 1.5"),
    ("[[(1, float('nan'))]]", "step score nan"),
    ("[[(1, 'good')]]", "step score 'good'"),
    ("[[(1, 1.0, 2)]]", r"the step \(1, 1.0, 2\); a step score is a pair"),
])
def test_malformed_steps_get_one_line_naming_the_function(returned, message):
    fn = eval(f"lambda completions, **kw: {returned}")
    fn.__name__ = "prm"
    with pytest.raises(RewardError, match=f"reward function 'prm' returned (the )?{message}"):
        rewards_of(fn).score(["ab"], {})


def test_steps_of_a_conversation_of_several_turns_are_refused():
    turns = [{"role": "assistant", "content": "call"}, {"role": "tool", "content": "4"}, {"role": "assistant", "content": "4"}]
    prm = lambda completions, **kw: [[(1, 1.0)]]  # noqa: E731
    with pytest.raises(RewardError, match="conversation of several turns"):
        rewards_of(prm).score([turns], {})
    one = [{"role": "assistant", "content": "ab"}]
    assert rewards_of(prm).score([one], {}).steps == [[(1, 1.0)]]  # one message: its content


# --- the update reads one advantage per token ----------------------------------------------


def test_the_loss_takes_an_advantage_per_token():
    # ratio 1: each token's loss is -A_t, and its gradient with respect to its log-prob is -A_t / norm
    logp = torch.log(torch.tensor([[0.5, 0.25, 0.5], [0.1, 0.9, 0.9]])).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = torch.tensor([[2.0, 1.0, -1.0], [-1.0, 0.0, 0.0]])
    norm = LossNorm(num_sequences=2, num_tokens=4, max_completion_length=4)
    loss, _ = policy_loss(logp, logp.detach(), adv, mask, norm, loss_type="dapo")
    assert loss.item() == pytest.approx(-(2.0 + 1.0 - 1.0 - 1.0) / 4)
    loss.backward()
    assert close(logp.grad, [[-0.5, -0.25, 0.25], [0.25, 0.0, 0.0]])
    # a row whose tokens share one advantage is the [B] form exactly
    same, _ = policy_loss(logp, logp.detach(), torch.tensor([[2.0] * 3, [-1.0] * 3]), mask, norm, loss_type="grpo")
    plain, _ = policy_loss(logp, logp.detach(), torch.tensor([2.0, -1.0]), mask, norm, loss_type="grpo")
    assert same.item() == pytest.approx(plain.item())


def test_a_batch_keeps_its_advantages_as_wide_as_its_completions():
    rollouts = [Rollout([1], [5, 6], [0.0] * 2, "stop", "ab"), Rollout([1], [5, 6, 7, 8], [0.0] * 4, "stop", "abcd"),
                Rollout([1], [5], [0.0], "stop", "a")]
    adv = torch.tensor([[1.0, 2.0, 0.0, 0.0, 0.0], [3.0, 4.0, 5.0, 6.0, 0.0], [7.0, 0.0, 0.0, 0.0, 0.0]])
    batch = Batch.from_rollouts(rollouts, adv, torch.tensor([True, False, True]), 0, False)
    assert batch.advantages.tolist() == [[1.0, 2.0], [7.0, 0.0]]  # the widest kept completion has 2 tokens
    assert batch.select(slice(1, 2)).advantages.tolist() == [[7.0]]


# --- a step of the trainer ------------------------------------------------------------------


def test_a_generation_gives_each_token_the_return_of_the_steps_after_it(tiny, tmp_path, monkeypatch):
    import rlvr.rewards as rewards

    # Each completion (the tiny model writes a character a token) is scored at its first character: the
    # first completion of each group 1, the second 0.  No number is given at the end, so each group's pool
    # is [1, 0]: +-0.5 / (sample std sqrt(0.5) + eps) on the first token, 0 on the tokens after it.
    def first_character(completions, **kwargs):
        return [[(1, float(i % 2 == 0))] if c else None for i, c in enumerate(completions)]

    monkeypatch.setitem(rewards.REWARDS, "boxed_format", first_character)
    model, tokenizer = tiny
    cfg = build_config({"model": "default", "task_args": {"num_test": 10}, "reward_funcs": ["boxed_format"],
                        "num_generations": 2, "per_device_train_batch_size": 4, "max_completion_length": 4,
                        "temperature": 1.0, "seed": 3})
    trainer = Trainer(cfg, model, tokenizer, [Example("a", "1"), Example("b", "2")], tmp_path, 10)
    gen = trainer.generate()
    assert all(s["completion"] for s in gen.samples), "this seed's completions all have text"
    a = 0.5 / (math.sqrt(0.5) + EPS)
    widths = gen.batch.completion_mask.sum(-1).tolist()
    assert gen.batch.advantages.shape == gen.batch.completion_mask.shape
    for i, row in enumerate(gen.batch.advantages.tolist()):
        assert row[0] == pytest.approx(a if i % 2 == 0 else -a)
        assert row[1:] == [0.0] * (len(row) - 1)
        assert widths[i] >= 1
    assert [s["steps"] for s in gen.samples] == [[(0, 1.0)], [(0, 0.0)]] * 2
    assert [s["advantage"] for s in gen.samples] == pytest.approx([a, -a] * 2)
    assert gen.samples[0]["rewards"] == {"boxed_format": 1.0}
    metrics = trainer.update(gen.batch)  # and the update trains on them
    assert metrics["grad_norm"] > 0.0


def test_rollout_workers_carry_the_steps_of_their_slices():
    from rlvr.rewards import Scores
    from rlvr.rollout.workers import _slice_scores, concat_scores

    stepped = Scores([1.5, 0.0], {"f": [1.5, None]}, steps=[[(1, 1.0), (None, 0.5)], []])
    plain = Scores([2.0], {"f": [2.0]})
    assert _slice_scores(stepped, 1, 2, first=False).steps == [[]]
    # a slice scored with numbers only: each total is a step at the end
    assert concat_scores([stepped, plain]).steps == [[(1, 1.0), (None, 0.5)], [], [(None, 2.0)]]
    assert concat_scores([plain, plain]).steps is None
