"""Search-R1's exact-match reward (its verl/utils/reward_score/qa_em.py), with rlrun's label decoding.

Search-R1's agent scores the whole decoded sequence, prompt included, and Search-R1's prompt shows one
example answer (`<answer> Beijing </answer>`); so there a sequence with 0 or 1 `<answer>` blocks has no
answer of the model's, and with 2 or more the last one counts (`min_answers=2`, the default). Scoring the
response alone (verl's convention, rlrun.rewards.rules) one block is enough (`min_answers=1`).
"""

from __future__ import annotations

import json
import re
import string

_ANSWER = re.compile(r"<answer>(.*?)</answer>", re.DOTALL)
_ARTICLES = re.compile(r"\b(a|an|the)\b")
_PUNCTUATION = frozenset(string.punctuation)


def normalize_answer(text: str) -> str:
    """SQuAD normalisation, in Search-R1's order: lower case, drop ASCII punctuation, replace the
    articles a/an/the by a space, collapse white space."""
    text = "".join(ch for ch in text.lower() if ch not in _PUNCTUATION)
    return " ".join(_ARTICLES.sub(" ", text).split())


def em_check(prediction: str, golden_answers: str | list[str]) -> int:
    """1 when the normalised prediction equals any normalised golden answer, else 0."""
    if isinstance(golden_answers, str):
        golden_answers = [golden_answers]
    predicted = normalize_answer(prediction)
    return int(any(normalize_answer(golden) == predicted for golden in golden_answers))


def extract_solution(solution_str: str, min_answers: int = 2) -> str | None:
    """The last `<answer>...</answer>` content, stripped; None when there are fewer than `min_answers` (with
    the prompt in the text, its example answer is always one of them)."""
    matches = _ANSWER.findall(solution_str)
    if len(matches) < min_answers:
        return None
    return matches[-1].strip()


def golden_answers(label: object) -> list[str]:
    """The golden answers of a label: a str, a list of str, {"target": [...]} (Search-R1's ground_truth),
    or a JSON string of any of these (rlrun's data loader JSON-encodes list and dict labels).

    A plain string that is not JSON of a list/dict is itself the one answer."""
    if isinstance(label, str):
        try:
            decoded = json.loads(label)
        except json.JSONDecodeError:
            return [label]
        if not isinstance(decoded, (list, dict)):
            return [label]  # "42" or "true" are answers, not JSON structures
        label = decoded
    if isinstance(label, dict):
        if "target" not in label:
            raise ValueError(f"golden answers dict has keys {sorted(label)}; expected {{'target': [...]}}")
        label = label["target"]
    if isinstance(label, str):
        return [label]
    if isinstance(label, list) and all(isinstance(answer, str) for answer in label):
        return list(label)
    raise ValueError(f"golden answers must be a string or a list of strings, got {label!r:.200}")


def compute_score_em(solution_str: str, golden: object, format_score: float = 0.0, score: float = 1.0,
                     min_answers: int = 2) -> float:
    """Search-R1's compute_score_em: 0 without a (second) answer, `score` on an exact match, else
    `format_score`. `golden` is anything golden_answers() accepts."""
    answer = extract_solution(solution_str, min_answers)
    if answer is None:
        return 0.0
    return score if em_check(answer, golden_answers(golden)) else format_score
