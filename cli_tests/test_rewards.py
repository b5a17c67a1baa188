"""Every formula in sptool.rewards against values computed by hand from the papers' equations."""

from __future__ import annotations

import math

import pytest

from sptool import rewards as R

approx = pytest.approx


# ------------------------------------------------------------------ WIST Eqs. 12–14

def test_gaussian_variance_reward_hand_values():
    # exp(-(Var - 0.25)^2 / 0.02): sigma divides directly (Eq. 14), not 2 sigma^2
    assert R.gaussian_variance_reward(0.25) == approx(1.0)
    assert R.gaussian_variance_reward(0.0) == approx(math.exp(-0.0625 / 0.02)) == approx(0.0439369, abs=1e-6)
    assert R.gaussian_variance_reward(0.1875) == approx(math.exp(-0.1953125)) == approx(0.8225775, abs=1e-6)
    assert R.gaussian_variance_reward(0.09) == approx(math.exp(-1.28))
    assert R.gaussian_variance_reward(0.0, sigma=0.5) == approx(math.exp(-0.125))
    with pytest.raises(ValueError):
        R.gaussian_variance_reward(0.1, sigma=0)


def test_wist_challenger_reward_and_invalid_penalty():
    assert R.wist_challenger_reward(False, 0.25) == -0.1
    assert R.wist_challenger_reward(True, None) == -0.1
    assert R.wist_challenger_reward(True, 0.25) == approx(1.0)
    assert R.wist_challenger_reward(False, 0.25, invalid_penalty=-0.5) == -0.5


def test_accuracy_variance_and_document_skip():
    assert R.empirical_accuracy([True, False, True, True]) == 0.75
    assert R.empirical_accuracy([True] * 8) == 1.0          # all correct
    assert R.empirical_accuracy([False] * 8) == 0.0         # none correct
    assert R.empirical_accuracy([True]) == 1.0              # single sample
    assert R.empirical_accuracy([]) == 0.0                  # empty
    assert R.empirical_variance(0.75) == approx(0.1875)
    assert R.empirical_variance(1.0) == 0.0 and R.empirical_variance(0.0) == 0.0
    assert R.wist_document_is_learnable([0.0, 0.0]) is False
    assert R.wist_document_is_learnable([]) is False
    assert R.wist_document_is_learnable([0.0, 0.1875]) is True


def test_binary_correctness():
    assert [R.binary_correctness_reward(c) for c in (True, False, None)] == [1.0, 0.0, 0.0]


# ------------------------------------------------------------------ R-Zero

def test_uncertainty_reward_paper_and_reference():
    assert R.uncertainty_reward(0.5) == 1.0
    assert R.uncertainty_reward(0.3) == approx(0.6)
    assert R.uncertainty_reward(0.8) == approx(0.4)
    assert R.uncertainty_reward(1.0) == 0.0 and R.uncertainty_reward(0.0) == 0.0
    assert R.uncertainty_reward(0.3, "reference") == approx(0.3)
    assert R.uncertainty_reward(0.8, "reference") == approx(0.2)
    assert R.uncertainty_reward(0.5, "reference") == 0.5
    with pytest.raises(ValueError):
        R.uncertainty_reward(0.5, "other")


def test_sentence_bleu_hand_values():
    # p1..p4 = 4/5, 3/4, 2/3, 1/2, BP = 1  ->  (0.2)^(1/4)
    assert R.sentence_bleu("a b c d e".split(), "a b c d f".split()) == approx(0.2 ** 0.25)
    # hypothesis shorter than 4: p4 = 0/1 smoothed to 0.1/1; BP = exp(1 - 4/3)
    assert R.sentence_bleu("a b c".split(), "a b c d".split()) == approx(math.exp(-1 / 3) * 0.1 ** 0.25)
    assert R.sentence_bleu("x y".split(), "a b c".split()) == 0.0      # no unigram match
    assert R.sentence_bleu([], "a b".split()) == 0.0                   # empty hypothesis
    assert R.sentence_bleu("a b c d".split(), "a b c d".split()) == approx(1.0)


NEAR_DUPLICATES = [
    "What is the sum of 3 and 5 ?",
    "What is the sum of 3 and 7 ?",
    "What is the sum of 4 and 5 ?",
    "A train travels 60 km in 2 hours , what is its speed ?",
    "Find the area of a circle with radius 2 .",
]


def test_bleu_distance_matrix_by_hand():
    dist = R.bleu_distance_matrix(NEAR_DUPLICATES[:3], pairing="reference")
    # q1 vs q2 differ in one token: p = 8/9, 6/8, 5/7, 4/6, equal lengths (BP = 1)
    assert dist[0][1] == approx(1 - (8 / 9 * 6 / 8 * 5 / 7 * 4 / 6) ** 0.25)
    # q1 vs q3: p = 8/9, 6/8, 4/7, 2/6
    assert dist[0][2] == approx(1 - (8 / 9 * 6 / 8 * 4 / 7 * 2 / 6) ** 0.25)
    # q2 vs q3: p = 7/9, 4/8, 3/7, 2/6
    assert dist[1][2] == approx(1 - (7 / 9 * 4 / 8 * 3 / 7 * 2 / 6) ** 0.25)
    assert dist[0][0] == 0.0 and dist[1][0] == dist[0][1]
    assert R.bleu_distance_matrix(["same text", "same text"]) == [[0.0, 0.0], [0.0, 0.0]]


def test_bleu_repetition_penalties_cluster_near_duplicates():
    # d12 = 0.249 merges first; then d({1,2},3) = (0.403 + 0.514) / 2 = 0.459 < 0.5 merges:
    # one cluster of 3 out of B = 5, the two unrelated questions alone.
    assert R.bleu_repetition_penalties(NEAR_DUPLICATES) == approx([0.6, 0.6, 0.6, 0.2, 0.2])
    # Average (not single) linkage: at threshold 0.45 q3 stays out (0.459 >= 0.45) although its
    # nearest member is at 0.403.
    assert R.bleu_repetition_penalties(NEAR_DUPLICATES, threshold=0.45) == approx([0.4, 0.4, 0.2, 0.2, 0.2])
    assert R.bleu_repetition_penalties(NEAR_DUPLICATES, threshold=0.2) == approx([0.2] * 5)
    assert R.bleu_repetition_penalties([]) == []                       # empty batch
    assert R.bleu_repetition_penalties(["only one question here"]) == [1.0]
    assert R.bleu_repetition_penalties(["a b c d e"] * 4) == [1.0] * 4


def test_average_linkage_matches_scipy():
    hierarchy = pytest.importorskip("scipy.cluster.hierarchy")
    from scipy.spatial.distance import squareform

    import random
    rng = random.Random(3)
    words = "what is the sum of 3 and 5 area circle".split()
    for _ in range(30):
        questions = [" ".join(rng.choice(words) for _ in range(rng.randint(3, 8)))
                     for _ in range(rng.randint(2, 12))]
        dist = R.bleu_distance_matrix(questions)
        ours = R.average_linkage_clusters(dist, 0.5)
        tree = hierarchy.linkage(squareform(dist, checks=False), method="average")
        theirs = hierarchy.fcluster(tree, t=math.nextafter(0.5, 0), criterion="distance")
        partition = lambda labels: sorted(sorted(i for i, l in enumerate(labels) if l == c)
                                          for c in set(labels))
        assert partition(ours) == partition(list(theirs))


def test_rzero_questioner_reward():
    assert R.rzero_questioner_reward(0.5, 0.2) == approx(0.8)
    assert R.rzero_questioner_reward(0.5, 0.2, uncertainty="reference") == approx(0.3)
    assert R.rzero_questioner_reward(1.0, 0.4) == approx(-0.4)
    assert R.rzero_questioner_reward(1.0, 0.4, clip_at_zero=True) == 0.0
    assert R.rzero_questioner_reward(0.5, 0.2, parsed=False) == -1.0
    assert R.rzero_questioner_reward(None, 0.0) == -1.0


def test_solver_reward_and_band():
    assert R.rzero_solver_reward(True, True) == approx(1.0)
    assert R.rzero_solver_reward(False, True) == approx(0.1)
    assert R.rzero_solver_reward(False, False) == 0.0
    assert R.rzero_solver_reward(True, True, format_weight=0.0) == 1.0
    assert R.pseudo_label_solver_reward(False, True, format_weight=0.0) == 0.0
    assert R.keep_for_solver_training(0.3, "5") and R.keep_for_solver_training(0.8, "5")
    assert not R.keep_for_solver_training(0.29, "5")
    assert not R.keep_for_solver_training(0.81, "5")
    assert not R.keep_for_solver_training(0.5, None)
    assert not R.keep_for_solver_training(0.5, " ")
    assert not R.keep_for_solver_training(None, "5")


# ------------------------------------------------------------------ R-Quest

def test_validity_gate():
    assert R.validity_gate(0.0) == 0.5
    assert R.validity_gate(5 / 9) == approx(-1 / 18)
    assert R.passes_validity_gate(0.5) is True       # exactly half INVALID still passes
    assert R.passes_validity_gate(5 / 9) is False


def test_rquest_questioner_reward():
    assert R.rquest_questioner_reward(5 / 9, None, None) == approx(-1 / 18)   # gate value itself
    assert R.rquest_questioner_reward(1.0, 0.5, True) == -0.5
    assert R.rquest_questioner_reward(0.0, 0.3, True) == approx(0.3)          # min(s, 1 - s)
    assert R.rquest_questioner_reward(0.0, 0.7, True) == approx(0.3)
    assert R.rquest_questioner_reward(0.0, 0.3, False) == 0.0                 # novelty gate 0
    assert R.rquest_questioner_reward(0.0, 0.4, None) == approx(0.4)          # no verdict: novel
    assert R.rquest_questioner_reward(0.0, 1.0, True) == 0.0                  # all agree
    assert R.rquest_questioner_reward(0.0, 0.3, True, parsed=False) == -1.0   # format failure
    with pytest.raises(ValueError):
        R.rquest_questioner_reward(0.0, None, True)


def test_validity_init_reward():
    valid = dict(problem_invalid=False)
    flawed = dict(problem_invalid=True)
    assert R.validity_init_reward("42", correct=True, **valid) == 1.0
    assert R.validity_init_reward("41", correct=False, **valid) == 0.0
    assert R.validity_init_reward("INVALID", correct=False, **valid) == -0.5   # false rejection
    assert R.validity_init_reward(None, correct=False, **valid) == -0.1        # empty box
    assert R.validity_init_reward("", correct=False, **valid) == -0.1
    assert R.validity_init_reward("INVALID", correct=False, **flawed) == 1.0   # correct rejection
    assert R.validity_init_reward("invalid", correct=False, **flawed) == 1.0
    assert R.validity_init_reward("7", correct=False, **flawed) == 0.0
    assert R.validity_init_reward(None, correct=False, **flawed) == -0.1


# ------------------------------------------------------------------ SvS

def test_svs_bands_and_synthesis_reward():
    # Algorithm 1 line 8, 0 < Acc < 1, on binary rewards: Acc 0.5 kept, 0 and 1 not, no samples not
    assert R.rewards_differ([1.0, 0.0]) and not R.rewards_differ([0.0, 0.0])
    assert not R.rewards_differ([1.0, 1.0]) and not R.rewards_differ([])
    assert R.svs_is_underperforming(0.125) and R.svs_is_underperforming(0.5)
    assert not R.svs_is_underperforming(0.625)
    # [12.5%, 50%] closed in §3.3, open in Algorithm 1 line 11 (strict)
    assert not R.svs_is_underperforming(0.125, strict=True) and not R.svs_is_underperforming(0.5, strict=True)
    assert R.svs_is_underperforming(0.25, (0.125, 0.5), strict=True)
    assert not R.svs_is_underperforming(0.0) and not R.svs_is_underperforming(0.875)
    assert not R.svs_is_underperforming(None)
    # Eq. 6: 1 inside [0.125, 0.625] (inclusive), 0 outside
    assert [R.synthesis_reward(a) for a in (0.125, 0.5, 0.625, 0.75, 0.0, 1.0, None)] == \
        [1.0, 1.0, 1.0, 0.0, 0.0, 0.0, 0.0]
    assert R.synthesis_reward(1.0, negative=True) == -1.0
    assert R.synthesis_reward(0.0, negative=True, negative_value=-0.5) == -0.5
    assert R.synthesis_reward(0.25, negative=True) == 1.0
    assert R.synthesis_reward(0.75, band=(0.125, 0.75)) == 1.0
    assert R.svs_keep_synthesis_group([0.0, 1.0, None]) is False
    assert R.svs_keep_synthesis_group([1.0, 0.25]) is True
    assert R.svs_keep_synthesis_group([]) is False


# ------------------------------------------------------------------ advantages

def test_rewards_differ_is_the_nonzero_advantage_gate():
    assert R.rewards_differ([1.0, 0.0]) and R.rewards_differ([0.1, 0.0, 0.0])
    assert not R.rewards_differ([0.1, 0.1, 0.1]) and not R.rewards_differ([1.0]) and not R.rewards_differ([])
    for rewards in ([0.0, 1.0, 1.0], [0.1, 0.1], [1.0, 0.1, 0.0]):
        # the gate keeps a group exactly when some Dr. GRPO advantage r_i - mean(r) is non-zero
        assert R.rewards_differ(rewards) == any(a != 0 for a in R.group_advantages(rewards, "dr_grpo"))


def test_group_advantages():
    assert R.group_advantages([1, 0, 0, 1]) == [0.5, -0.5, -0.5, 0.5]
    # GRPO: sample std sqrt(4 * 0.25 / 3) = 0.57735
    assert R.group_advantages([1, 0, 0, 1], "grpo") == approx([0.8660241] * 1 + [-0.8660241] * 2 + [0.8660241], rel=1e-5)
    assert R.group_advantages([1, 1, 1]) == [0.0, 0.0, 0.0]              # all correct
    assert R.group_advantages([0, 0], "grpo") == [0.0, 0.0]              # none correct
    assert R.group_advantages([1.0]) == [0.0]                            # single sample
    assert R.group_advantages([1.0], "grpo") == [0.0]
    assert R.group_advantages([]) == []                                  # empty
    assert R.group_advantages([1.0, 0.04, -0.1]) == approx([1.0 - 0.94 / 3, 0.04 - 0.94 / 3, -0.1 - 0.94 / 3])
    with pytest.raises(ValueError):
        R.group_advantages([1, 0], "ppo")


def test_indexed_bleu_distances_equal_the_pairwise_loop():
    """The near-linear BLEU (inverted n-gram index, sparse products) gives the pairwise loop's
    distances and clusters, both pairings, with repeated words, duplicates and empty strings."""
    import random

    rng = random.Random(7)
    words = "what is the sum of 3 and 5 area circle the the of".split()
    for trial in range(40):
        questions = [" ".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
                     for _ in range(rng.randint(1, 16))]
        if trial % 3 == 0:
            questions.append(questions[0])
        for pairing in ("mean", "reference"):
            fast = R.bleu_distance_matrix(questions, pairing)
            slow = R.bleu_distance_matrix_pairwise(questions, pairing)
            assert [[approx(v, abs=1e-12) for v in row] for row in slow] == fast
            assert R.average_linkage_clusters(fast) == R.average_linkage_clusters(slow)
