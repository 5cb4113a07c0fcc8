"""pass@k and maj@k against values computed by hand."""

import math

import pytest

from rlvr.evaluate import sample_metrics
from rlvr.passk import ks_to_report, maj_at_k, majority_index, pass_at_k


@pytest.mark.parametrize(
    "n, c, k, expected",
    [
        (4, 1, 1, 0.25),  # 1 - C(3,1)/C(4,1) = 1 - 3/4
        (4, 1, 2, 0.5),  # 1 - C(3,2)/C(4,2) = 1 - 3/6
        (4, 2, 2, 5 / 6),  # 1 - C(2,2)/C(4,2) = 1 - 1/6
        (5, 2, 3, 0.9),  # 1 - C(3,3)/C(5,3) = 1 - 1/10
        (10, 3, 1, 0.3),  # pass@1 is c/n: 1 - C(7,1)/C(10,1) = 1 - 7/10
        (4, 1, 4, 1.0),  # k = n: the only draw is all 4 samples, which include the correct one
        (4, 3, 2, 1.0),  # n - c = 1 < k: every pair holds a correct sample
        (4, 4, 1, 1.0),  # all correct
        (4, 0, 1, 0.0),  # all wrong: 1 - C(4,1)/C(4,1)
        (4, 0, 4, 0.0),  # all wrong, k = n: 1 - C(4,4)/C(4,4)
        (1, 1, 1, 1.0),
        (1, 0, 1, 0.0),
        (200, 1, 100, 0.5),  # 1 - C(199,100)/C(200,100) = 1 - 100/200; the binomials have ~60 digits
    ],
)
def test_pass_at_k_hand_values(n, c, k, expected):
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_matches_the_binomial_formula():
    for n in range(1, 9):
        for c in range(n + 1):
            for k in range(1, n + 1):
                assert pass_at_k(n, c, k) == pytest.approx(1 - math.comb(n - c, k) / math.comb(n, k), abs=1e-12)


@pytest.mark.parametrize("n, c, k", [(4, 5, 1), (4, -1, 1), (4, 1, 0), (4, 1, 5)])
def test_pass_at_k_rejects_impossible_counts(n, c, k):
    with pytest.raises(ValueError):
        pass_at_k(n, c, k)


@pytest.mark.parametrize(
    "answers, correct, k, expected",
    [
        (["7", "8", "8", "7", "8"], [1, 0, 0, 1, 0], 5, 0.0),  # 8 has 3 votes, 7 has 2: 8 is submitted, wrong
        (["8", "7", "7"], [0, 1, 1], 3, 1.0),  # 7 has 2 votes, 8 one
        (["3", "5", "3", "5"], [0, 1, 0, 1], 4, 0.0),  # tie 2-2: "3" appears first and wins
        (["5", "3", "3", "5"], [1, 0, 0, 1], 4, 1.0),  # the same tie, "5" first
        (["7", None, None, "8", "8"], [1, 0, 0, 0, 0], 5, 0.0),  # no answer does not vote: 8 wins 2-1
        ([None, None, "4"], [0, 0, 1], 3, 1.0),  # one vote is a majority
        ([None, None], [0, 0], 2, 0.0),  # nobody answers: wrong
        (["4", "4", "4"], [1, 1, 1], 3, 1.0),  # all correct
        (["1", "2", "3"], [0, 0, 0], 3, 0.0),  # all wrong
        (["7", "8", "8"], [1, 0, 0], 2, 1.0),  # only the first k = 2 vote: tie 7-8, 7 first
        (["7", "8", "8"], [1, 0, 0], 1, 1.0),  # maj@1 is the first sample
    ],
)
def test_maj_at_k(answers, correct, k, expected):
    assert maj_at_k(answers, [bool(x) for x in correct], k) == expected


def test_majority_index_breaks_ties_by_first_appearance():
    assert majority_index(["b", "a", "a", "b"]) == 0
    assert majority_index(["a", "b", "b"]) == 1
    assert majority_index([None]) is None


def test_maj_at_k_checks_its_inputs():
    with pytest.raises(ValueError, match="3 answers but 2"):
        maj_at_k(["1", "2", "3"], [True, False], 3)
    with pytest.raises(ValueError, match="k=4"):
        maj_at_k(["1", "2", "3"], [True, False, False], 4)


def test_ks_to_report():
    assert ks_to_report(1) == [1]
    assert ks_to_report(4) == [1, 2, 4]
    assert ks_to_report(5) == [1, 2, 4, 5]
    assert ks_to_report(16) == [1, 2, 4, 8, 16]


def test_sample_metrics_two_problems_of_four_samples():
    rewards = [1.0, 0.0, 0.0, 0.0,  # c = 1
               1.0, 1.0, 1.0, 1.0]  # c = 4
    keys = ["a", "b", "b", None,  # b wins 2-1 and is wrong
            "c", "c", "c", "c"]  # c wins, right
    m = sample_metrics(rewards, 4, keys)
    assert m["pass@1"] == pytest.approx((0.25 + 1) / 2)  # 1/4 and 4/4
    assert m["pass@2"] == pytest.approx((0.5 + 1) / 2)  # 1 - C(3,2)/C(4,2) = 1/2, and 1
    assert m["pass@4"] == pytest.approx(1.0)  # k = n: each problem has a correct sample
    assert m["maj@4"] == pytest.approx(0.5)
    assert m["mean@4"] == pytest.approx(5 / 8)  # five rewards of 1 among eight
    assert list(m) == ["pass@1", "pass@2", "pass@4", "maj@4", "mean@4"]


def test_sample_metrics_partial_credit_does_not_pass_and_unscored_problems_are_left_out():
    rewards = [0.5, 1.0,  # fraction-of-tests rewards: only the 1.0 passes, c = 1
               None, None]  # no reference: left out
    m = sample_metrics(rewards, 2)
    assert m == {"pass@1": 0.5, "pass@2": 1.0, "mean@2": 0.75}  # no keys: no maj@k


def test_sample_metrics_one_sample_is_plain_pass_at_1():
    assert sample_metrics([1.0, 0.0, 1.0, -0.5], 1) == {"pass@1": 0.5}
