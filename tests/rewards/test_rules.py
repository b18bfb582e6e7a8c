"""rlrun's versions of verl's rule scores (rlrun.rewards.rules) on cases whose verdicts verl's own scorers give
(verl/utils/reward_score/ gsm8k.py, math_reward.py, search_r1_like_qa_em.py at b178a3c; run by hand on each
case), including the corners where a naive reimplementation differs."""

from __future__ import annotations

import pytest

from rlrun.rewards.rules import default_compute_score, gsm8k_answer
from rlrun.rewards.verl_math import last_boxed, normalize_math


@pytest.mark.parametrize("solution, truth, score", [
    ("so the total is #### 72", "72", 1.0),
    ("#### 1,000", "1000", 1.0),  # commas dropped
    ("#### 5 then #### 7", "5", 0.0),  # the last one counts
    ("The answer is 72", "72", 0.0),  # no ####
    ("#### 72.", "72", 0.0),  # text equality: "72." is not "72"
    ("#### 72.00", "72", 0.0),
    ("#### $72", "72", 0.0),  # "$" breaks the pattern
    ("#### -3", "-3", 1.0),
    ("#### 3" + "x" * 300, "3", 0.0),  # only the last 300 characters are read
    ("x" * 400 + "#### 3", "3", 1.0),
])
def test_gsm8k(solution, truth, score):
    assert default_compute_score("openai/gsm8k", solution, truth) == score


def test_gsm8k_extraction():
    assert gsm8k_answer("#### 1,234,567") == "1234567" and gsm8k_answer("nothing") is None


@pytest.mark.parametrize("solution, truth, score", [
    (r"so \boxed{\frac12}", r"\frac{1}{2}", 1.0),
    (r"\boxed{0.5}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1/2}", r"\frac{1}{2}", 1.0),
    (r"\boxed{1} then \boxed{2}", "2", 1.0),  # the last box
    (r"\boxed{x = 5}", "5", 1.0),  # a short left side of = goes
    (r"\boxed{10\text{ cm}}", "10", 1.0),  # a unit goes
    (r"\boxed{90^\circ}", "90", 1.0),
    (r"\boxed{50\%}", "50", 1.0),
    (r"\boxed{\dfrac{\sqrt3}{2}}", r"\frac{\sqrt{3}}{2}", 1.0),
    (r"\boxed{\left(1,2\right)}", "(1,2)", 1.0),
    (r"\boxed{.5}", "0.5", 1.0),
    (r"\fbox{3}", "3", 0.0),  # found, but not a \boxed{} answer
    (r"\boxed{5", "5", 0.0),  # unbalanced
    ("answer 5", "5", 0.0),
    (r"\boxed{1,000}", "1000", 0.0),  # commas are kept
    (r"\boxed 3$ and \boxed{4}", "4", 0.0),  # the "\boxed " form wins wherever it is
    (r"\boxed 3$ and \boxed{4}", "3", 1.0),
    (r"\boxed{5\text{ m}\text{ s}}", "5", 0.0),  # two units: raw text compared
    (r"\boxed{\frac{3}{4}}", "3/4", 1.0),
])
def test_math(solution, truth, score):
    for source in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500"):
        assert default_compute_score(source, solution, truth) == score, (source, solution, truth)


def test_math_pieces():
    assert last_boxed(r"a \boxed{\frac{1}{2}} b") == r"\boxed{\frac{1}{2}}"
    assert normalize_math(r"\dfrac12") == r"\frac{1}{2}" and normalize_math("k=5") == "5"


@pytest.mark.parametrize("source", ["searchR1_nq", "searchR1_hotpotqa", "nq", "bamboogle"])
@pytest.mark.parametrize("solution, truth, score, verl_penalty", [
    ("<answer> The Beatles </answer>", {"target": ["the beatles"]}, 1.0, False),
    ("<answer>Paris</answer>", {"target": "paris."}, 1.0, False),  # a string target; punctuation goes
    ("<answer>London</answer><answer>Paris</answer>", {"target": ["Paris"]}, 1.0, False),  # the last one
    ("Paris", {"target": ["Paris"]}, 0.0, False),  # no tags
    ("<answer>Paris, France</answer>", {"target": ["Paris"]}, 0.0, False),  # exact, not substring
    ("<answer>\nParis\n</answer>", {"target": ["x", "PARIS!"]}, 1.0, False),
    ("<answer>Paris</answer>" * 11, {"target": ["Paris"]}, 1.0, True),  # verl's names: 0.25
])
def test_qa_exact_match(source, solution, truth, score, verl_penalty):
    expected = 0.25 if verl_penalty and source.startswith("searchR1_") else score
    assert default_compute_score(source, solution, truth) == expected


def test_unknown_data_source_names_the_choices():
    with pytest.raises(ValueError, match=r"no built-in rule score for data_source 'my_data'.*openai/gsm8k.*--compute_score"):
        default_compute_score("my_data", "x", "y")
