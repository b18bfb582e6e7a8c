"""Search-R1's exact-match reward (qa_em.py), checked on hand-written cases."""

from __future__ import annotations

import pytest

from rlrun.rewards.rules import compute_score_em, em_check, extract_solution, golden_answers, normalize_answer

pytestmark = pytest.mark.timeout(30)

EXAMPLE = "For example, <answer> Beijing </answer>. Question: capital of australia?\n"


@pytest.mark.parametrize("text, expected", [
    ("Canberra", "canberra"),
    ("  The  Eiffel-Tower! ", "eiffeltower"),  # punctuation goes before the articles, without a space
    ("An apple a day", "apple day"),
    ("the theory of the a", "theory of"),  # \b: "theory" keeps its "the"
    ("Guido van Rossum.", "guido van rossum"),
    ("Café—Ü", "café—ü"),  # only ASCII punctuation is dropped
    ("A", ""),
])
def test_normalize_answer(text: str, expected: str) -> None:
    assert normalize_answer(text) == expected


def test_em_check() -> None:
    assert em_check("  Canberra. ", ["Sydney", "canberra"]) == 1
    assert em_check("the Canberra", "Canberra") == 1  # a str is one golden answer
    assert em_check("Canberra city", ["Canberra"]) == 0  # exact, not substring
    assert em_check("", ["a"]) == 1  # both normalise to ""
    assert em_check("x", []) == 0


def test_extract_solution_needs_two_answers() -> None:
    assert extract_solution("no answer here") is None
    assert extract_solution(EXAMPLE) is None  # only the prompt's example
    assert extract_solution(EXAMPLE + "<answer>  Canberra\n</answer>") == "Canberra"
    assert extract_solution(EXAMPLE + "<answer>Sydney</answer> then <answer>\nCanberra </answer>") == "Canberra"
    assert extract_solution(EXAMPLE + "<answer>unclosed") is None


@pytest.mark.parametrize("label, expected", [
    ("Canberra", ["Canberra"]),
    ('["Canberra", "ACT"]', ["Canberra", "ACT"]),
    ('{"target": ["Canberra"]}', ["Canberra"]),
    ({"target": "Canberra"}, ["Canberra"]),
    (["a", "b"], ["a", "b"]),
    ("42", ["42"]),  # JSON of a number is still the answer text
    ("[not json", ["[not json"]),
])
def test_golden_answers(label: object, expected: list[str]) -> None:
    assert golden_answers(label) == expected


@pytest.mark.parametrize("label", ["[1, 2]", '{"answers": ["x"]}', None, 3])
def test_golden_answers_rejects_other_shapes(label: object) -> None:
    with pytest.raises(ValueError):
        golden_answers(label)


def test_compute_score_em() -> None:
    right = EXAMPLE + "<search> x </search>\n\n<information>Doc 1</information>\n\n<answer> canberra </answer>"
    wrong = EXAMPLE + "<answer>Sydney</answer>"
    assert compute_score_em(right, '["Canberra", "ACT"]') == 1.0
    assert compute_score_em(wrong, '["Canberra"]') == 0.0
    assert compute_score_em(wrong, "Canberra", format_score=0.2) == 0.2
    assert compute_score_em(right, {"target": ["Canberra"]}, score=2.0) == 2.0
    assert compute_score_em(EXAMPLE, "Beijing", format_score=0.2) == 0.0  # no answer of the model's at all
