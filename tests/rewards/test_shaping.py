import math
import time

import pytest

from rlvr.rewards.length import cosine_length, repetition_penalty, soft_overlong


def ids(*lengths):
    return [[7] * n for n in lengths]


# --- soft_overlong: Lmax = 100, Lc = 20, so the penalty starts after 100 - 20 = 80 tokens ---------------


@pytest.mark.parametrize(
    "length, expected",
    [
        (0, 0.0),
        (80, 0.0),  # L = Lmax - Lc: still free
        (81, -0.05),  # (80 - 81) / 20
        (90, -0.5),  # (80 - 90) / 20
        (99, -0.95),  # (80 - 99) / 20
        (100, -1.0),  # L = Lmax: (80 - 100) / 20
        (101, -1.0),  # beyond Lmax
        (5000, -1.0),
    ],
)
def test_soft_overlong_regimes(length, expected):
    assert soft_overlong(["x"], max_length=100, cache=20, completion_ids=ids(length)) == [pytest.approx(expected)]


def test_soft_overlong_defaults_come_from_max_completion_length():
    # Lmax = max_completion_length = 100, Lc = 100 // 5 = 20: the same regimes as above
    scores = soft_overlong(["x"] * 4, completion_ids=ids(80, 81, 90, 100), max_completion_length=100)
    assert scores == pytest.approx([0.0, -0.05, -0.5, -1.0])
    # max_length wins over max_completion_length; Lc = 50 // 5 = 10, so 40 is free and 45 is (40 - 45) / 10
    scores = soft_overlong(["x"] * 3, max_length=50, completion_ids=ids(40, 45, 51), max_completion_length=100)
    assert scores == pytest.approx([0.0, -0.5, -1.0])


def test_soft_overlong_cache_zero_is_a_hard_cut():
    assert soft_overlong(["x"] * 2, max_length=100, cache=0, completion_ids=ids(100, 101)) == [0.0, -1.0]


def test_soft_overlong_explains_what_it_needs():
    with pytest.raises(ValueError, match="needs a maximum length"):
        soft_overlong(["x"], completion_ids=ids(3))
    with pytest.raises(ValueError, match="cache must be between 0 and max_length"):
        soft_overlong(["x"], max_length=10, cache=11, completion_ids=ids(3))
    with pytest.raises(ValueError, match="completion_ids"):
        soft_overlong(["x"], max_length=10)
    with pytest.raises(ValueError, match="2 completions but 1 completion_ids"):
        soft_overlong(["x", "y"], max_length=10, completion_ids=ids(3))


# --- cosine_length: r = at_max + 0.5 (at_0 - at_max)(1 + cos(pi L / Lmax)), Lmax = 100 ---------------

RIGHT, WRONG = "<answer>4</answer>", "<answer>5</answer>"


@pytest.mark.parametrize(
    "text, length, expected",
    [
        (RIGHT, 0, 2.0),  # 1 + 0.5 (2 - 1)(1 + cos 0) = 1 + 1
        (RIGHT, 25, 1 + 0.5 * (1 + math.sqrt(2) / 2)),  # cos(pi / 4) = 0.7071: 1.8536
        (RIGHT, 50, 1.5),  # 1 + 0.5 (1 + cos(pi / 2)) = 1 + 0.5
        (RIGHT, 100, 1.0),  # 1 + 0.5 (1 + cos pi) = 1 + 0
        (RIGHT, 101, -10.0),  # beyond Lmax: exceed
        (WRONG, 0, -10.0),  # 0 + 0.5 (-10 - 0)(1 + 1)
        (WRONG, 50, -5.0),  # 0 + 0.5 (-10)(1 + 0)
        (WRONG, 100, 0.0),  # 0 + 0.5 (-10)(1 - 1)
        (WRONG, 101, -10.0),
        ("no answer at all", 50, -5.0),  # no answer counts as wrong
    ],
)
def test_cosine_length(text, length, expected):
    # max_completion_length = 200, so nothing up to 101 tokens was cut off by the sampler
    score = cosine_length([text], answer=["4"], max_length=100, completion_ids=ids(length), max_completion_length=200)
    assert score == [pytest.approx(expected)]


def test_cosine_length_knobs_and_missing_reference():
    knobs = dict(correct_at_0=1.0, correct_at_max=0.5, wrong_at_0=-1.0, wrong_at_max=-0.5, exceed=-2.0)
    scores = cosine_length([RIGHT, WRONG, RIGHT, RIGHT], answer=["4", "4", "4", None], max_length=10,
                           completion_ids=ids(5, 5, 11, 5), **knobs)
    # correct: 0.5 + 0.5 (0.5)(1 + 0) = 0.75; wrong: -0.5 + 0.5 (-0.5)(1 + 0) = -0.75; too long: -2; no reference: None
    assert scores == [pytest.approx(0.75), pytest.approx(-0.75), -2.0, None]


def test_cosine_length_counts_a_completion_cut_off_by_the_sampler_as_too_long():
    # Default Lmax = max_completion_length = 100: 99 tokens is the cosine, 100 tokens was cut off
    scores = cosine_length([RIGHT, RIGHT, WRONG], answer=["4"] * 3, completion_ids=ids(99, 100, 100), max_completion_length=100)
    # 1 + 0.5 (1 + cos(0.99 pi)) = 1 + 0.5 (1 - 0.99951) = 1.000247
    assert scores == [pytest.approx(1 + 0.5 * (1 + math.cos(0.99 * math.pi))), -10.0, -10.0]


def test_cosine_length_needs_a_maximum_length():
    with pytest.raises(ValueError, match="needs a maximum length"):
        cosine_length([RIGHT], answer=["4"], completion_ids=ids(3))


# --- repetition_penalty: -max_penalty * (total - distinct) / total over word n-grams -----------------


@pytest.mark.parametrize(
    "text, n, expected",
    [
        ("a b c a b c", 3, -0.25),  # abc bca cab abc: 4 trigrams, 3 distinct, 1 repeated: -1/4
        ("a\nb\tc  a b c", 3, -0.25),  # any whitespace separates words
        ("the cat sat on the mat", 3, 0.0),  # 4 trigrams, all distinct
        ("a a a a a", 3, -2 / 3),  # aaa x 3: 1 distinct, 2 repeated: -2/3
        ("a b a b a", 2, -0.5),  # ab ba ab ba: 4 bigrams, 2 distinct: -2/4
        ("A b c a b c", 3, 0.0),  # case-sensitive: Abc bca cab abc are distinct
        ("a b c", 3, 0.0),  # exactly n words: one trigram
        ("a b", 3, 0.0),  # shorter than n: no n-gram
        ("", 3, 0.0),
        ("x x x x", 1, -0.75),  # unigrams: 4, 1 distinct: -3/4
    ],
)
def test_repetition_penalty(text, n, expected):
    assert repetition_penalty([text], n=n) == [pytest.approx(expected)]


def test_repetition_penalty_scale_and_chat_messages():
    completion = [{"role": "assistant", "content": "a a a a a"}]
    assert repetition_penalty([completion], max_penalty=0.5) == [pytest.approx(-1 / 3)]  # 0.5 x -2/3


def test_repetition_penalty_on_1mb_is_fast():
    text = "so we add one " * 70_000  # ~1 MB, 280,000 words: 4 distinct trigrams
    start = time.perf_counter()
    [score] = repetition_penalty([text])
    assert time.perf_counter() - start < 1.0
    assert score == pytest.approx(-(279_998 - 4) / 279_998)


@pytest.mark.parametrize("knobs", [{"n": 0}, {"n": 2.5}, {"max_penalty": -1.0}])
def test_repetition_penalty_rejects_bad_knobs(knobs):
    with pytest.raises(ValueError):
        repetition_penalty(["a b c"], **knobs)
