"""Curriculum health: p̂ histogram, learning-signal shares, near-duplicates, collapse thresholds."""

from __future__ import annotations

import pytest

from sptool.stages.decontaminate import TextIndex
from sptool.run.config import HealthConfig
from sptool.run.health import (collapse_reasons, difficulty_histogram, duplicate_shares, group_signal_share,
                               signal_share)


def test_difficulty_histogram_separates_all_easy_and_impossible():
    histogram = difficulty_histogram([0.0, 0.0, 0.1, 0.25, 0.5, 0.6, 0.9, 1.0, None])
    assert histogram == pytest.approx({"0": 2 / 8, "(0,0.25]": 2 / 8, "(0.25,0.5]": 1 / 8,
                                       "(0.5,0.75]": 1 / 8, "(0.75,1)": 1 / 8, "1": 1 / 8})
    assert set(difficulty_histogram([])) == set(histogram) and sum(difficulty_histogram([]).values()) == 0


def test_signal_shares():
    assert signal_share([0.0, 0.5, 1.0, 0.25]) == 0.5
    assert signal_share([]) is None
    groups = [{"advantages": [0.0, 0.0]}, {"advantages": [0.5, -0.5]}, {"advantages": [1e-15, 0]},
              {"no": "advantages"}]
    assert group_signal_share(groups) == pytest.approx(1 / 3)


def test_duplicate_shares_within_and_against_earlier_iterations():
    earlier = TextIndex()
    earlier.add("iter-1", "a", "A farmer has 12 cows and buys 7 more. How many cows does he have now?")
    questions = ["A farmer has 12 cows and buys 7 more. How many cows does he have now?",  # earlier
                 "What is the sum of the first 20 odd numbers, written in binary?",
                 "what is the SUM of the first 20 odd numbers; written in binary",         # within
                 "Find the area of a circle of radius 3."]
    within, against = duplicate_shares(questions, earlier)
    assert within == 0.25 and against == 0.25
    collapsed = duplicate_shares(["What is 2 + 2?"] * 8)
    assert collapsed == (7 / 8, None)


def test_collapse_reasons_name_each_crossed_threshold():
    health = {"valid_rate": 0.2, "duplicate_share_within": 0.9, "duplicate_share_earlier": 0.1,
              "signal_share": 0.0, "pseudo_label_accuracy": None}
    assert collapse_reasons(health, HealthConfig()) == []
    reasons = collapse_reasons(health, HealthConfig(min_valid_rate=0.5, max_duplicate_share=0.5,
                                                        min_signal_share=0.1, min_pseudo_label_accuracy=0.5))
    assert reasons == ["valid-question rate 0.20 < 0.5 (valid_rate)",
                       "near-duplicate share 0.90 > 0.5 (duplicate_share_within)",
                       "share of questions with a learning signal 0.00 < 0.1 (signal_share)"]
