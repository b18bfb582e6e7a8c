"""verl's built-in rule scores, chosen per prompt by its data_source (verl's `default_compute_score`), written
here from verl's behaviour (verl/utils/reward_score/: gsm8k.py, math_reward.py, search_r1_like_qa_em.py) and
checked against cases with known verdicts (tests/rewards/test_rules.py).

`solution_str` is the response alone, decoded without special tokens, as verl's NaiveRewardManager passes it.
- GSM8K (`openai/gsm8k`): the last `#### <number>` in the response's last 300 characters, commas removed, must
  equal the ground truth as text: 1.0, else 0.0 (verl's format score is 0 by default).
- MATH (`lighteval/MATH`, `DigitalLearningGmbH/MATH-lighteval`, `HuggingFaceH4/MATH-500`): the last `\boxed{}`
  (or `\boxed ...`, or `\fbox{}`) equals the ground truth after Hendrycks' MATH normalisation: 1.0, else 0.0.
- QA exact match (`searchR1_nq`, ... as verl names them; `nq`, `hotpotqa`, ... as Search-R1's own data does):
  the last `<answer>...</answer>` equals one of `ground_truth["target"]` after SQuAD normalisation: 1.0 (0.25 for
  verl's names when the response has more than 10 answer tags), else 0.0. Search-R1's own scorer needs a second
  answer because it scores prompt + response; on the response alone one is enough.
"""

from __future__ import annotations

import json
import re
import string
from collections.abc import Callable
from typing import Any

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


# ---- MATH (Hendrycks' normalisation) -------------------------------------------------------------------------


def last_boxed(text: str) -> str | None:
    """The last `\\boxed{...}` (braces balanced), `\\boxed ...` (up to a `$`; it wins when present) or `\\fbox{...}`."""
    if "\\boxed " in text:
        return "\\boxed " + text.split("\\boxed ")[-1].split("$")[0]
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
        if start < 0:
            return None
    depth = 0
    for end in range(start, len(text)):
        if text[end] == "{":
            depth += 1
        elif text[end] == "}":
            depth -= 1
            if depth == 0:
                return text[start : end + 1]
    return None


def unboxed(boxed: str) -> str:
    """The content of `\\boxed{X}` or `\\boxed X`; ValueError for anything else (`\\fbox{}` included, as in verl)."""
    if boxed.startswith("\\boxed "):
        return boxed[len("\\boxed ") :]
    if not (boxed.startswith("\\boxed{") and boxed.endswith("}")):
        raise ValueError(f"not a \\boxed{{}} answer: {boxed[:40]!r}")
    return boxed[len("\\boxed{") : -1]


def _fix_fracs(text: str) -> str:
    """`\\frac12` -> `\\frac{1}{2}`, `\\frac1{72}` -> `\\frac{1}{72}` (braces added to one-character arguments)."""
    head, *rest = text.split("\\frac")
    out = head
    for part in rest:
        out += "\\frac"
        if part[0] == "{":  # an empty argument raises IndexError: the caller compares raw text then
            out += part
            continue
        if len(part) < 2:
            return text
        num, den, tail = part[0], part[1], part[2:]
        out += "{" + num + "}" + (den + tail if den == "{" else "{" + den + "}" + tail)
    return out


def _fix_a_slash_b(text: str) -> str:
    """`3/4` -> `\\frac{3}{4}` when both sides are plain integers."""
    parts = text.split("/")
    if len(parts) != 2:
        return text
    try:
        num, den = int(parts[0]), int(parts[1])
    except ValueError:
        return text
    return f"\\frac{{{num}}}{{{den}}}" if text == f"{num}/{den}" else text


def _remove_right_units(text: str) -> str:
    """What precedes `\\text{ ` (a unit); more than one unit is an error (the caller compares raw text then)."""
    if "\\text{ " not in text:
        return text
    parts = text.split("\\text{ ")
    if len(parts) != 2:
        raise ValueError("more than one unit")
    return parts[0]


def _fix_sqrt(text: str) -> str:
    """`\\sqrt3` -> `\\sqrt{3}` (the first character only)."""
    head, *rest = text.split("\\sqrt")
    out = head
    for part in rest:
        if part[0] != "{":  # an empty argument raises IndexError: the caller compares raw text then
            out += "\\sqrt{" + part[0] + "}" + part[1:]
        else:
            out += "\\sqrt" + part
    return out


def normalize_math(text: str) -> str:
    """Hendrycks' MATH answer normalisation (verl's strip_string), in its order."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _remove_right_units(text)
    text = text.replace("\\%", "")
    text = text.replace(" .", " 0.").replace("{.", "{0.")
    if not text:
        return text
    if text[0] == ".":
        text = "0" + text
    sides = text.split("=")
    if len(sides) == 2 and len(sides[0]) <= 2:  # "k = 5" -> "5"
        text = sides[1]
    text = _fix_sqrt(text)
    text = text.replace(" ", "")
    text = _fix_fracs(text)
    if text == "0.5":
        text = "\\frac{1}{2}"
    return _fix_a_slash_b(text)


def math_equivalent(a: str | None, b: str | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    try:
        return normalize_math(a) == normalize_math(b)
    except Exception:  # noqa: BLE001 - a form the normalisation cannot take: the raw texts decide (as verl)
        return a == b


def math_score(solution: str, ground_truth: Any) -> float:
    boxed = last_boxed(solution)
    if boxed is None:
        return 0.0
    try:
        answer = unboxed(boxed)
    except ValueError:
        return 0.0
    return 1.0 if math_equivalent(answer, str(ground_truth)) else 0.0


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

Scorer = Callable[[str, Any], float]

_QA = ("nq", "triviaqa", "popqa", "hotpotqa", "2wikimultihopqa", "musique", "bamboogle")
SCORERS: dict[str, Scorer] = {
    "openai/gsm8k": gsm8k_score,
    **{name: math_score for name in ("lighteval/MATH", "DigitalLearningGmbH/MATH-lighteval", "HuggingFaceH4/MATH-500")},
    **{f"searchR1_{name}": (lambda s, g: qa_score(s, g, tag_penalty=True)) for name in _QA},
    **{name: (lambda s, g: qa_score(s, g, tag_penalty=False)) for name in _QA},
}


def scorer_for(data_source: str | None) -> Scorer | None:
    return SCORERS.get(data_source or "")


def default_compute_score(
    data_source: str | None, solution_str: str, ground_truth: Any, extra_info: dict[str, Any] | None = None
) -> float:
    """verl's default_compute_score for the data sources above; ValueError naming any other."""
    scorer = scorer_for(data_source)
    if scorer is None:
        raise ValueError(
            f"no built-in rule score for data_source {data_source!r}; built in: {sorted(SCORERS)}. "
            "Pass --compute_score FILE.py (verl's custom_reward_function.path) for other data"
        )
    return scorer(solution_str, ground_truth)
