"""verl's built-in rule scores, chosen per prompt by its data_source (verl's `default_compute_score`), written
here from verl's behaviour (verl/utils/reward_score/: gsm8k.py, math_reward.py, search_r1_like_qa_em.py; the math
scores of math_dapo.py, prime_math/ and geo3k.py in rlrun.rewards.verl_math) and checked against cases with known
verdicts (tests/rewards/test_rules.py, tests/rewards/test_verl_math.py).

`solution_str` is the response alone, decoded without special tokens, as verl's NaiveRewardManager passes it.
- GSM8K (`openai/gsm8k`): the last `#### <number>` in the response's last 300 characters, commas removed, must
  equal the ground truth as text: 1.0, else 0.0 (verl's format score is 0 by default).
- MATH (`lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`): the last `\boxed{}`
  (or `\boxed ...`, or `\fbox{}`) equals the ground truth after Hendrycks' MATH normalisation: 1.0, else 0.0.
- QA exact match (`searchR1_nq`, ... as verl names them; `nq`, `hotpotqa`, ... as Search-R1's own data does):
  the last `<answer>...</answer>` equals one of `ground_truth["target"]` after SQuAD normalisation: 1.0 (0.25 for
  verl's names when the response has more than 10 answer tags), else 0.0. Search-R1's own scorer needs a second
  answer because it scores prompt + response; on the response alone one is enough.
- DAPO (`math_dapo`, `math`, `math_dapo_reasoning`, and every name starting `aime`, case-sensitive as verl): the
  `Answer:` line (or, with none, a box) against the truth: {"score": 1.0 or -1.0, "acc", "pred"}. Plain `math` is
  DAPO's, not MATH's, as in verl.
- NuminaMath (`numina_aops_forum`, `numina_synthetic_math`, `numina_amc_aime`, `numina_synthetic_amc`,
  `numina_cn_k12`, `numina_olympiads`): PRIME's grader: 1.0 or 0.0. Geometry3K (`hiyouga/geometry3k`): mathruler's
  grader, 0.9 for the answer plus 0.1 for the format. Both read LaTeX with pylatexenc (`pip install 'rlrun[math]'`).

verl's code data (codecontests, apps, codeforces, taco) is scored by running the model's code, which needs a
sandbox; rlrun has no built-in scorer for it (a --compute_score file can call one).
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from typing import Any

from rlrun.rewards.verl_math import NUMINA_SOURCES, geo3k_score, math_dapo_score, math_score, prime_math_score

# ---- Search-R1's exact match -------------------------------------------------------------------------------------
# Search-R1's exact-match reward (its verl/utils/reward_score/qa_em.py), with rlrun's label decoding.
#
# Search-R1's agent scores the whole decoded sequence, prompt included, and Search-R1's prompt shows one
# example answer (`<answer> Beijing </answer>`); so there a sequence with 0 or 1 `<answer>` blocks has no
# answer of the model's, and with 2 or more the last one counts (`min_answers=2`, the default). Scoring the
# response alone (verl's convention, rlrun.rewards.rules) one block is enough (`min_answers=1`).

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


def compute_score_em(
    solution_str: str, golden: object, format_score: float = 0.0, score: float = 1.0, min_answers: int = 2
) -> float:
    """Search-R1's compute_score_em: 0 without a (second) answer, `score` on an exact match, else
    `format_score`. `golden` is anything golden_answers() accepts."""
    answer = extract_solution(solution_str, min_answers)
    if answer is None:
        return 0.0
    return score if em_check(answer, golden_answers(golden)) else format_score


_GSM8K_ANSWER = re.compile(r"#### (\-?[0-9\.\,]+)")
GSM8K_CLIP_CHARS = 300


def gsm8k_answer(solution: str) -> str | None:
    """The last `#### N` of the response's last 300 characters, commas removed (None: there is none)."""
    found = _GSM8K_ANSWER.findall(solution[-GSM8K_CLIP_CHARS:])
    return found[-1].replace(",", "").replace("$", "") if found else None


def gsm8k_score(solution: str, ground_truth: Any) -> float:
    answer = gsm8k_answer(solution)
    return 1.0 if answer is not None and answer == str(ground_truth) else 0.0


# ---- QA exact match (Search-R1) ---------------------------------------------------------------------------------

MAX_ANSWER_TAGS = 10  # verl's search_r1_like_qa_em: more tags than this earn a quarter of the score


def qa_score(solution: str, ground_truth: Any, *, tag_penalty: bool) -> float:
    answer = extract_solution(solution, min_answers=1)
    if answer is None:
        return 0.0
    target = ground_truth.get("target") if isinstance(ground_truth, dict) else ground_truth
    if not em_check(answer, golden_answers(target)):
        return 0.0
    spammed = solution.count("<answer>") > MAX_ANSWER_TAGS or solution.count("</answer>") > MAX_ANSWER_TAGS
    return 0.25 if tag_penalty and spammed else 1.0


# ---- dispatch ---------------------------------------------------------------------------------------------------

Scorer = Callable[[str, Any], "float | dict[str, Any]"]

_QA = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k_score,
    **{name: math_score for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")},
    **{f"searchR1_{name}": (lambda s, g: qa_score(s, g, tag_penalty=True)) for name in _QA},
    **{name: (lambda s, g: qa_score(s, g, tag_penalty=False)) for name in _QA},
    **{name: math_dapo_score for name in ("math_dapo", "math", "math_dapo_reasoning")},
    **{name: prime_math_score for name in NUMINA_SOURCES},
    "hiyouga/geometry3k": geo3k_score,
}
# Names matched by how they start (verl: data_source.startswith("aime"), so "aime_2024" and "aime25", not "AIME_2024").
PREFIX_SCORERS: dict[str, Scorer] = {"aime": math_dapo_score}
# verl scores these by running the model's code (SandboxFusion, or prime_code's unsandboxed exec): not built in.
CODE_SOURCES = ("codecontests", "apps", "codeforces", "taco")


class UnknownDataSource(ValueError, NotImplementedError):
    """No built-in rule score for a data_source: a ValueError as rlrun reports it, a NotImplementedError as verl's
    default_compute_score raises it (so code written against verl's catches it too)."""


def scorer_for(data_source: str | None) -> Scorer | None:
    """The rule score for `data_source`: an exact name first, then a name's prefix (verl's order gives the same)."""
    name = data_source or ""
    if name in SCORERS:
        return SCORERS[name]
    return next((scorer for prefix, scorer in PREFIX_SCORERS.items() if name.startswith(prefix)), None)


def default_compute_score(
    data_source: str | None, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float | dict[str, Any]:
    """verl's default_compute_score for the data sources above (a float, or math_dapo's dict); ValueError naming any
    other (UnknownDataSource). extra_info is ignored, as verl's scorers ignore it."""
    scorer = scorer_for(data_source)
    if scorer is None:
        prefixes = ", ".join(f"{prefix}*" for prefix in PREFIX_SCORERS)
        raise UnknownDataSource(
            f"no built-in rule score for data_source {data_source!r}; built in: {sorted(SCORERS)} and {prefixes}. "
            f"Code data ({', '.join(CODE_SOURCES)}) is scored by running the model's code, which needs a sandbox "
            "rlrun does not build in. Pass --compute_score FILE.py (verl's custom_reward_function.path) for it and "
            "for other data"
        )
    return scorer(solution_str, ground_truth)
