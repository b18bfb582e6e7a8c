"""verl's math rule scores that need no code sandbox, written here from verl's behaviour (verl 0.10,
verl/utils/reward_score/ at 1dda039: math_dapo.py, prime_math/, geo3k.py with mathruler 0.1.0's grader) and checked
against verdicts verl's own files give (tests/rewards/test_verl_math.py). rlrun.rewards.rules dispatches to them.

- math_dapo (`math_dapo`, `math`, `math_dapo_reasoning`, `aime*`): the last `Answer: ...` line of the response's
  last 300 characters, normalised (Minerva's normalize_final_answer), must equal the normalised ground truth; with no
  `Answer:` line at all, the last `\\boxed{}` of the last 100 characters must equal the raw ground truth (the fallback
  verl added in 1dda039). {"score": 1.0 or -1.0, "acc": bool, "pred": str}.
- prime_math (`numina_*`): PRIME's answer extraction, then the PRM800K grader (normalisation, tuples, sympy), then
  math_equal (numbers within 1e-4, also x100 and /100; intervals, tuples, matrices): 1.0 or 0.0.
- geo3k (`hiyouga/geometry3k`): 0.9 for the last `\\boxed{}` graded right by mathruler's copy of the PRM800K grader,
  plus 0.1 for the `<think>...</think> ... \\boxed{...}` format.

Both PRM800K graders are one implementation (Prm800kGrader) whose differences are its parameters. sympy is imported
on first use (it takes half a second); pylatexenc, which reads LaTeX answers, is the optional extra `rlrun[math]`.
"""

from __future__ import annotations

import ast
import math
import operator
import re
import signal
import threading
import time
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from rlrun.runtime.errors import MissingExtraError

T = TypeVar("T")

# ---- shared pieces -------------------------------------------------------------------------------------------------


def _brace_span(text: str, start: int) -> tuple[int, int] | None:
    """(first `{`, its matching `}`) counting braces from `start`, as verl's box readers count: a `}` before the first
    `{` already lowers the depth. None when the braces never close."""
    depth, first_open = 0, None
    for i in range(start, len(text)):
        if text[i] == "{":
            depth += 1
            if first_open is None:
                first_open = i
        elif text[i] == "}":
            depth -= 1
            if depth == 0 and first_open is not None:
                return first_open, i
    return None


def _text_truth(ground_truth: Any, scorer: str) -> str:
    """The ground truth as verl's scorer reads it: a string (verl fails on anything else, with an AttributeError)."""
    if not isinstance(ground_truth, str):
        raise TypeError(f"{scorer} needs a string ground_truth, got {type(ground_truth).__name__} {ground_truth!r:.80}")
    return ground_truth


# ---- bounding sympy ------------------------------------------------------------------------------------------------
# verl runs each sympy comparison in a forked process it kills after 10 s. rlrun bounds it with SIGALRM instead, which
# needs no process per comparison: rlrun's reward workers are processes whose main thread runs the scorer, and a
# scorer run in the trainer's own process also runs in its main thread, where rlrun's own bound on scoring is a timer
# thread (rlrun.runtime.phases.deadline), not a signal. Off the main thread a signal cannot be used, so there the
# comparison runs unbounded.


class _Expired(BaseException):
    """The bound passed. A BaseException, so the `except Exception` clauses inside sympy let it through."""


def _can_use_alarm() -> bool:
    return hasattr(signal, "setitimer") and threading.current_thread() is threading.main_thread()


def bounded(seconds: float | None, fn: Callable[[], T], on_timeout: T) -> T:
    """fn(), or `on_timeout` once `seconds` pass (a SIGALRM timer, in the main thread only; elsewhere unbounded).

    The previous SIGALRM handler is put back afterwards, and a timer someone else had set runs on with what was left
    of it (a signal it would have sent meanwhile comes at once)."""
    if seconds is None or not _can_use_alarm():
        return fn()
    armed = [True]

    def expire(signum: int, frame: object) -> None:
        if armed[0]:  # a signal delivered late, after fn() returned, changes nothing
            raise _Expired

    earlier_delay, earlier_interval = signal.getitimer(signal.ITIMER_REAL)
    previous = signal.signal(signal.SIGALRM, expire)
    began = time.monotonic()
    try:
        try:
            signal.setitimer(signal.ITIMER_REAL, seconds)  # inside: a bound shorter than this line still lands here
            return fn()
        finally:
            armed[0] = False
            signal.setitimer(signal.ITIMER_REAL, 0)
    except _Expired:
        return on_timeout
    finally:
        signal.signal(signal.SIGALRM, previous if previous is not None else signal.SIG_DFL)
        if earlier_delay > 0:
            left = earlier_delay - (time.monotonic() - began)
            signal.setitimer(signal.ITIMER_REAL, max(left, 1e-6), earlier_interval)


# ---- pylatexenc (optional) -----------------------------------------------------------------------------------------

MATH_EXTRA_MESSAGE = "numina_* / geometry3k scoring needs pylatexenc: pip install 'rlrun[math]'"


class MathExtraMissing(MissingExtraError):
    """pylatexenc is not installed; raised where the PRM800K grader would read LaTeX, outside the `suppress` that
    ignores reading errors, so a missing package fails the run instead of quietly scoring LaTeX answers 0."""

    def __init__(self) -> None:
        super(MissingExtraError, self).__init__(MATH_EXTRA_MESSAGE)  # this message, not MissingExtraError's wording
        self.package, self.extra = "pylatexenc", "math"


_latex_converter: list[Any] = []  # [the LatexNodes2Text class] once imported, [None] once known to be missing


def _latex_nodes_to_text() -> Any:
    """pylatexenc's LatexNodes2Text, imported on first need (one import attempt per process)."""
    if not _latex_converter:
        try:
            from pylatexenc.latex2text import LatexNodes2Text  # noqa: PLC0415 - optional: only LaTeX answers need it
        except ImportError:
            _latex_converter.append(None)
        else:
            _latex_converter.append(LatexNodes2Text)
    if _latex_converter[0] is None:
        raise MathExtraMissing()
    return _latex_converter[0]


# ---- math_dapo (Minerva's answer line, verl's boxed fallback) ------------------------------------------------------

DAPO_CLIP_CHARS = 300  # verl reads only the response's last 300 characters ("the longest MATH-500 answer has 159")
STRICT_BOX_CHARS = 100  # and of those, the box must lie in the last 100
INVALID = "[INVALID]"  # verl's prediction when there is no answer line

_ANSWER_LINE = re.compile(r"(?i)Answer\s*:\s*([^\n]+)")

# Minerva's normalisation tables (verl's SUBSTITUTIONS and REMOVED_EXPRESSIONS): plain substring edits, in this order,
# so "a " also eats the end of words ("a banana" -> "banana") and units vanish wherever they occur.
DAPO_SUBSTITUTIONS: tuple[tuple[str, str], ...] = (
    ("an ", ""),
    ("a ", ""),
    (".$", "$"),
    ("\\$", ""),
    ("\\ ", ""),
    (" ", ""),
    ("mbox", "text"),
    (",\\text{and}", ","),
    ("\\text{and}", ","),
    ("\\text{m}", "\\text{}"),
)
DAPO_REMOVED: tuple[str, ...] = (
    "square", "ways", "integers", "dollars", "mph", "inches", "hours", "km", "units", "\\ldots", "sue", "points",
    "feet", "minutes", "digits", "cents", "degrees", "cm", "gm", "pounds", "meters", "meals", "edges", "students",
    "childrentickets", "multiples", "\\text{s}", "\\text{.}", "\\text{\ns}", "\\text{}^2", "\\text{}^3", "\\text{\n}",
    "\\text{}", "\\mathrm{th}", "^\\circ", "^{\\circ}", "\\;", ",\\!", "{,}", '"', "\\dots",
)  # fmt: skip
# Then LaTeX unwrapping, each a regex over the whole text (`.` stops at line ends, as in verl), in this order:
_DAPO_REWRITES: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r".*?\$(.*?)\$.*"), r"$\1$"),  # only the first $...$ pair is kept
    (re.compile(r"\\text\{(.*?)\}"), r"\1"),
    (re.compile(r"\\textbf\{(.*?)\}"), r"\1"),
    (re.compile(r"\\overline\{(.*?)\}"), r"\1"),
    (re.compile(r"\\boxed\{(.*)\}"), r"\1"),  # greedy: up to the last `}`
    (re.compile(r"frac([^{])(.)"), r"frac{\1}{\2}"),  # \frac12 -> \frac{1}{2} (and \dfrac12 -> \dfrac{1}{2})
    (re.compile(r"sqrt([^{])"), r"sqrt{\1}"),  # one character only: \sqrt23 -> \sqrt{2}3
)


def normalize_final_answer(answer: str) -> str:
    """Minerva's answer normalisation as verl's math_dapo applies it: the text after the last `=`, the substitution and
    removal tables, LaTeX unwrapping, `$` dropped, commas dropped from a number. There is no `\\dfrac` -> `\\frac`, no
    `%` removal, and leading zeros stay ("033" is not "33")."""
    answer = answer.split("=")[-1]
    for before, after in DAPO_SUBSTITUTIONS:
        answer = answer.replace(before, after)
    for removed in DAPO_REMOVED:
        answer = answer.replace(removed, "")
    for pattern, replacement in _DAPO_REWRITES:
        answer = pattern.sub(replacement, answer)
    answer = answer.replace("$", "")
    if answer.replace(",", "").isdigit():
        answer = answer.replace(",", "")
    return answer.strip()


def answer_line(solution: str) -> str:
    """The rest of the last `Answer:` line (case-insensitive), or "[INVALID]"."""
    found = _ANSWER_LINE.findall(solution)
    return found[-1] if found else INVALID


def strict_box_answer(solution: str, pause_tokens_index: list[int] | None = None) -> str | None:
    """The content of the last `\\boxed{...}` within the last 100 characters (or within the 100 before the last pause
    token's index, as verl's pause_tokens_index); None without a balanced one. Only the brace form counts."""
    if pause_tokens_index is not None:
        if len(pause_tokens_index) != 4:
            raise ValueError(f"pause_tokens_index needs 4 indices, got {pause_tokens_index!r}")
        tail = solution[pause_tokens_index[-1] - STRICT_BOX_CHARS :]
    else:
        tail = solution[-STRICT_BOX_CHARS:]
    start = tail.rfind("\\boxed{")
    span = _brace_span(tail, start) if start >= 0 else None
    return None if span is None else tail[start + len("\\boxed{") : span[1]]


def math_dapo_verify(
    solution: str, ground_truth: str, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> tuple[bool, str | None]:
    """(correct, prediction) as verl 1dda039's math_dapo.verify: the `Answer:` line compared after normalising both
    sides; only when there is no such line, a box compared with the raw ground truth (a wrong answer line is never
    rescued by a box). strict_box_verify: the box alone."""
    if strict_box_verify:
        boxed = strict_box_answer(solution, pause_tokens_index)
        return boxed == ground_truth, boxed
    predicted = normalize_final_answer(answer_line(solution))
    correct = predicted == normalize_final_answer(ground_truth)
    if predicted != INVALID:
        return correct, predicted
    boxed = strict_box_answer(solution, pause_tokens_index)
    return (boxed == ground_truth, boxed) if boxed is not None else (correct, predicted)


def math_dapo_score(
    solution: str, ground_truth: Any, strict_box_verify: bool = False, pause_tokens_index: list[int] | None = None
) -> dict[str, Any]:
    """verl's math_dapo.compute_score: {"score": 1.0 or -1.0, "acc": bool, "pred": the normalised answer, the raw box
    content, or "[INVALID]"}. "acc" is logged beside the reward (reward/acc)."""
    truth = _text_truth(ground_truth, "math_dapo")
    correct, predicted = math_dapo_verify(solution[-DAPO_CLIP_CHARS:], truth, strict_box_verify, pause_tokens_index)
    return {"score": 1.0 if correct else -1.0, "acc": correct, "pred": predicted}


# ---- MATH (Hendrycks' normalisation; verl's math_reward.py) --------------------------------------------------------

# The percent spellings Hendrycks' normalisation removes, in order (normalize_math's `percents`):
VERL_PERCENTS = ("\\\\%", "\\%")  # verl (math_reward, prime_math): `\\%` (3 characters), then `\%`; a bare % stays
MATHRULER_PERCENTS = ("\\%", "%")  # mathruler's copy: `\%`, then a bare `%`


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


def normalize_math(text: str, percents: tuple[str, ...] = VERL_PERCENTS) -> str:
    """Hendrycks' MATH answer normalisation (verl's strip_string), in its order.

    `percents`: the percent spellings removed, in order. verl's: `\\\\%` (three characters, what the backslash
    halving above leaves of three or four backslashes before a `%`), then `\\%`, so a bare `%` stays; mathruler's
    copy: `\\%`, then `%`."""
    text = text.replace("\n", "").replace("\\!", "").replace("\\\\", "\\")
    text = text.replace("tfrac", "frac").replace("dfrac", "frac")
    text = text.replace("\\left", "").replace("\\right", "")
    text = text.replace("^{\\circ}", "").replace("^\\circ", "")
    text = text.replace("\\$", "")
    text = _remove_right_units(text)
    for percent in percents:
        text = text.replace(percent, "")
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


# ---- the mathd normalisation (Hendrycks' MATH) as the PRM800K graders call it --------------------------------------

_WHOLE_TEXT = re.compile(r"^\\text\{(?P<text>.+?)\}$")


def mathd_normalize(answer: str, percents: tuple[str, ...]) -> str:
    """PRM800K's math_normalize.normalize_answer: stripped, a whole `\\text{...}` unwrapped, then Hendrycks' MATH
    normalisation (with the copy's percent removals); the unwrapped text itself where that normalisation fails."""
    answer = answer.strip()
    whole = _WHOLE_TEXT.search(answer)
    if whole is not None:
        answer = whole.group("text").strip()
    try:
        return normalize_math(answer, percents)
    except Exception:  # noqa: BLE001 - a form the normalisation cannot take (an empty \frac, two units): raw text
        return answer


# ---- the PRM800K grader (prime_math's and mathruler's copies) ------------------------------------------------------

PRM800K_UNITS = (
    "degree", "cm", "centimeter", "meter", "mile", "second", "minute", "hour", "day", "week", "month", "year", "foot",
    "feet", "inch", "yard",
)  # fmt: skip
_NO_SYMPY_SUBSTRINGS = ("^{", "^(")  # sympy might hang on these: PRM800K does not try
_NO_SYMPY_PATTERNS = (re.compile(r"\^[0-9]+\^"), re.compile(r"\^[0-9][0-9]+"))
_TUPLE_CHARS = "()[]"
_FORMATTED_COMMA = re.compile(r"(\d)(,)(\d\d\d)($|\D)")
_MIXED_NUMBER = re.compile(r"([0-9]) +([0-9])")
_FRACTION = re.compile(r"^-?[0-9]+.?/0*[1-9][0-9]*.?$")
_LATEX_SYMBOLS = (("√", "sqrt"), ("π", "pi"), ("∞", "inf"), ("∪", "U"), ("·", "*"), ("×", "*"))


def _is_float(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _is_int(value: float) -> bool:
    try:
        return abs(value - int(round(value))) <= 1e-7
    except (OverflowError, ValueError):  # inf, nan
        return False


def _strip_formatted_commas(text: str) -> str:
    """`1,000,000` -> `1000000`, leaving the commas of tuples (`1,2`) alone."""
    while True:
        stripped = _FORMATTED_COMMA.sub(r"\1\3\4", text)
        if stripped == text:
            return text
        text = stripped


def _str_is_int(text: str) -> bool:
    try:
        return _is_int(float(_strip_formatted_commas(text)))
    except ValueError:
        return False


def _is_fraction(text: str) -> bool:
    return _FRACTION.search(text) is not None


def _latex_as_text(expr: str) -> str:
    """PRM800K's _parse_latex: LaTeX to plain text sympy can read (pylatexenc), with its symbols spelled out; the
    answer unchanged where pylatexenc cannot read it."""
    converter = _latex_nodes_to_text()  # outside the try: a missing pylatexenc must not count as unreadable LaTeX
    prepared = expr.replace("\\tfrac", "\\frac").replace("\\dfrac", "\\frac").replace("\\frac", " \\frac")
    try:
        text: str = converter().latex_to_text(prepared)
    except Exception:  # noqa: BLE001 - PRM800K suppresses every reading error
        return expr
    for symbol, spelled in _LATEX_SYMBOLS:
        text = text.replace(symbol, spelled)
    return text.strip()


def split_tuple(expr: str) -> list[str]:
    """The elements of `(a, b)` / `[a, b]` (brackets only at the ends), else [expr]; formatted commas first removed."""
    expr = _strip_formatted_commas(expr)
    if not expr:
        return []
    inner = expr[1:-1]
    if (
        len(expr) > 2
        and expr[0] in _TUPLE_CHARS
        and expr[-1] in _TUPLE_CHARS
        and not any(c in inner for c in _TUPLE_CHARS)
    ):
        return [element.strip() for element in inner.split(",")]
    return [expr]


def _sympy_allowed(expr: str) -> bool:
    """PRM800K's should_allow_eval: at most two distinct letters (sqrt and frac aside), no `^{`/`^(`, no stacked or
    multi-digit exponents."""
    letters = {c for c in expr.replace("sqrt", "").replace("frac", "") if c.isalpha()}
    if len(letters) > 2 or any(bad in expr for bad in _NO_SYMPY_SUBSTRINGS):
        return False
    return not any(pattern.search(expr) for pattern in _NO_SYMPY_PATTERNS)


def _sympy() -> tuple[Any, Any]:
    """sympy and its parser, imported on first use (before any bound starts: an import cut short would leave a broken
    module behind)."""
    import sympy  # noqa: PLC0415 - half a second to import; only these graders need it
    from sympy.parsing import sympy_parser  # noqa: PLC0415 - as sympy

    return sympy, sympy_parser


def _sympy_difference_is_zero(truth: str, given: str) -> bool:
    """sympy.simplify((truth) - (given)) == 0, parsed with `^` as power and implicit multiplication."""
    sympy, sympy_parser = _sympy()
    expr = f"({truth})-({given})"
    if not _sympy_allowed(expr):
        return False
    try:
        transformations = sympy_parser.standard_transformations + (sympy_parser.implicit_multiplication_application,)
        difference = sympy_parser.parse_expr(expr.replace("^", "**"), transformations=transformations)
        return bool(sympy.simplify(difference) == 0)
    except Exception:  # noqa: BLE001 - PRM800K: whatever sympy cannot parse or simplify is not equal
        return False


@dataclass(frozen=True)
class Prm800kGrader:
    """OpenAI's PRM800K answer grader, of which verl's prime_math and mathruler (geo3k) each carry a copy; the ways
    the copies differ are the fields."""

    units: tuple[str, ...]  # unit words removed (prime_math adds "liter")
    squeeze: bool  # mathruler: spaces and leftover braces dropped at the end of normalisation
    mathd_percents: tuple[str, ...]  # the percent removals of the mathd normalisation tried first
    sympy_timeout_s: float | None  # prime_math bounds each sympy comparison (False past it); mathruler does not

    def normalize(self, expr: str) -> str:
        """PRM800K's _normalize: `\\text{}`, `$` and `%` dropped, "or"/"and" as commas, million/billion/trillion as
        powers of ten, units and degrees removed, one outer `{}` stripped, integers in one spelling, LaTeX read as
        text, mixed numbers as sums (7 3/4 -> 7+3/4), lower case."""
        whole = _WHOLE_TEXT.search(expr)
        if whole is not None:
            expr = whole.group("text")
        expr = expr.replace("\\%", "%").replace("\\$", "$").replace("$", "").replace("%", "")
        expr = expr.replace(" or ", " , ").replace(" and ", " , ")
        expr = expr.replace("million", "*10^6").replace("billion", "*10^9").replace("trillion", "*10^12")
        for unit in self.units:
            expr = re.sub(f"{unit}(es)?(s)? *(\\^[0-9]+)?", "", expr)
        expr = re.sub(r"\^ *\\circ", "", expr)
        if expr[:1] == "{" and expr[-1:] == "}":
            expr = expr[1:-1]
        expr = re.sub(",\\\\! *", "", expr)
        if _is_float(expr) and _is_int(float(expr)):
            expr = str(int(round(float(expr))))
        if "\\" in expr:
            expr = _latex_as_text(expr)
        expr = re.sub("- *", "-", expr)
        expr = _MIXED_NUMBER.sub(r"\1+\2", expr)
        if self.squeeze:
            expr = expr.replace(" ", "").replace("{", "").replace("}", "")
        expr = expr.lower()
        if _str_is_int(expr):
            expr = str(int(float(expr.replace(",", ""))))
        return expr

    def _elements_equal(self, truth: str, given: str) -> bool:
        if _is_fraction(truth) and _is_fraction(given):
            return truth == given  # an unreduced fraction is wrong: no sympy here
        if _str_is_int(truth) != _str_is_int(given):
            return False  # an integer must match as written
        _sympy()  # imported before the bound starts
        return bounded(self.sympy_timeout_s, lambda: _sympy_difference_is_zero(truth, given), False)

    def grade(self, given: str | None, truth: str) -> bool:
        """PRM800K's grade_answer: equal after the mathd normalisation, or after its own normalisation, or (element by
        element of a tuple whose brackets and length match) equal under sympy."""
        if given is None:
            return False
        if mathd_normalize(truth, self.mathd_percents) == mathd_normalize(given, self.mathd_percents):
            return True
        truth_n, given_n = self.normalize(truth), self.normalize(given)
        if truth_n == given_n:
            return True
        if not given_n:
            return False
        truth_elements, given_elements = split_tuple(truth_n), split_tuple(given_n)
        if len(truth_elements) != len(given_elements):
            return False
        if len(truth_elements) > 1 and (truth_n[0] != given_n[0] or truth_n[-1] != given_n[-1]):
            return False
        return all(self._elements_equal(t, g) for t, g in zip(truth_elements, given_elements))


PRIME_GRADER = Prm800kGrader(
    units=(*PRM800K_UNITS, "liter"), squeeze=False, mathd_percents=VERL_PERCENTS, sympy_timeout_s=10.0
)
MATHRULER_GRADER = Prm800kGrader(
    units=PRM800K_UNITS, squeeze=True, mathd_percents=MATHRULER_PERCENTS, sympy_timeout_s=None
)


# ---- arithmetic that verl hands to eval() ---------------------------------------------------------------------------
# verl's math_equal calls eval() on the model's answer (after writing \pi as a number, and for a `[...]` answer to a
# matrix). rlrun evaluates the same texts' literal arithmetic only: numbers, operators, comparisons, and tuple / list
# / set displays give what eval gives; a name, call or subscript (verl's eval would see its module's globals) fails
# as an unknown name does in verl.


class NotArithmetic(ValueError):
    """The text is not literal arithmetic."""


_MAX_RESULT_BITS = 1 << 20  # 2**(2**30) would take verl's eval a very long time; past this, rlrun refuses
_BINARY: dict[type[ast.operator], Callable[[Any, Any], Any]] = {
    ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
    ast.FloorDiv: operator.floordiv, ast.Mod: operator.mod, ast.Pow: operator.pow, ast.LShift: operator.lshift,
    ast.RShift: operator.rshift, ast.BitOr: operator.or_, ast.BitXor: operator.xor, ast.BitAnd: operator.and_,
}  # fmt: skip
_UNARY: dict[type[ast.unaryop], Callable[[Any], Any]] = {
    ast.UAdd: operator.pos, ast.USub: operator.neg, ast.Invert: operator.invert, ast.Not: operator.not_,
}  # fmt: skip
_COMPARE: dict[type[ast.cmpop], Callable[[Any, Any], Any]] = {
    ast.Eq: operator.eq, ast.NotEq: operator.ne, ast.Lt: operator.lt, ast.LtE: operator.le, ast.Gt: operator.gt,
    ast.GtE: operator.ge,
}  # fmt: skip


def _number(value: Any) -> Any:
    if not isinstance(value, (int, float, complex)):
        raise NotArithmetic(f"arithmetic on {type(value).__name__}")
    return value


def _binary(op: ast.operator, left: Any, right: Any) -> Any:
    left, right = _number(left), _number(right)
    if isinstance(left, int) and isinstance(right, int):
        if (
            isinstance(op, ast.Pow)
            and right > 0
            and abs(left) > 1
            and abs(left).bit_length() * right > _MAX_RESULT_BITS
        ):
            raise NotArithmetic("power too large")
        if isinstance(op, ast.LShift) and right > _MAX_RESULT_BITS:
            raise NotArithmetic("shift too large")
    if type(op) not in _BINARY:
        raise NotArithmetic(f"operator {type(op).__name__}")
    return _BINARY[type(op)](left, right)


def _value(node: ast.AST) -> Any:
    if isinstance(node, ast.Constant) and isinstance(node.value, (int, float, complex)):
        return node.value
    if isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        return _UNARY[type(node.op)](_number(_value(node.operand)))
    if isinstance(node, ast.BinOp):
        return _binary(node.op, _value(node.left), _value(node.right))
    if isinstance(node, ast.Compare) and all(type(op) in _COMPARE for op in node.ops):
        left = _number(_value(node.left))
        for op, comparator in zip(node.ops, node.comparators):
            right = _number(_value(comparator))
            if not _COMPARE[type(op)](left, right):
                return False
            left = right
        return True
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and not any(isinstance(e, ast.Starred) for e in node.elts):
        values = [_value(element) for element in node.elts]
        return tuple(values) if isinstance(node, ast.Tuple) else (values if isinstance(node, ast.List) else set(values))
    raise NotArithmetic(f"{type(node).__name__} is not literal arithmetic")


def literal_arithmetic(text: str) -> Any:
    """What eval(text) gives for literal arithmetic (leading spaces and tabs ignored, as eval does); SyntaxError or
    NotArithmetic otherwise; ZeroDivisionError, OverflowError, TypeError as eval raises them."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SyntaxWarning)  # "invalid decimal literal" for `2x`: an answer, not code
        tree = ast.parse(text.lstrip(" \t"), mode="eval")
    return _value(tree.body)


# ---- prime_math: PRIME's extraction, the PRM800K grader, then math_equal -------------------------------------------

NUMINA_SOURCES = (
    "numina_aops_forum", "numina_synthetic_math", "numina_amc_aime", "numina_synthetic_amc", "numina_cn_k12",
    "numina_olympiads",
)  # fmt: skip
_AFTER_MARKERS = ("answer:", "answer is", "answers are")
_BEFORE_MARKERS = ("is answer", "is the answer", "are answers", "are the answers")
_LAST_MARKERS = ("be ", "is ", "are ", "=", ": ", "get ", "be\n", "is\n", "are\n", ":\n", "get\n")


def _after_last(text: str, marker: str) -> str:
    """The text after the last (case-insensitive) `marker`, stripped; the text itself without one."""
    found = text.lower().rfind(marker)  # an index into the lower-cased text, applied to the original (as PRIME)
    return text if found < 0 else text[found + len(marker) :].strip()


def prime_boxed(text: str) -> str | None:
    """PRIME's last box: the braces after the last `\\boxed` (or, with none, `\\fbox`), content stripped."""
    start = text.rfind("\\boxed")
    if start < 0:
        start = text.rfind("\\fbox")
    span = _brace_span(text, start) if start >= 0 else None
    return None if span is None else text[span[0] + 1 : span[1]].strip()


def match_answer(response: str) -> str:
    """PRIME's answer extraction: after the last "answer:"/"answer is"/"answers are", before "is the answer" and the
    like, then the last box's content, then before the last ". ", then after the last "is "/"="/": "/... ."""
    for marker in _AFTER_MARKERS:
        response = _after_last(response, marker)
    for marker in _BEFORE_MARKERS:
        found = response.lower().rfind(marker)
        if found >= 0:
            response = response[:found].strip()
    boxed = prime_boxed(response)
    if boxed:
        response = boxed
    if ". " in response:
        response = response[: response.lower().rfind(". ")].strip()
    for marker in _LAST_MARKERS:
        response = _after_last(response, marker)
    return response


_DOLLAR_NUMBER = re.compile(r"\$\d+(\.\d+)?")
_PERCENT_NUMBER = (re.compile(r"^\d+(\.\d+)?%$"), re.compile(r"^\d+(\.\d+)?\\%$"))
_INTERVALS = (
    (re.compile(r"^Interval\((.*)\)$"), "[", "]"),
    (re.compile(r"^Interval\.Ropen\((.*)\)$"), "[", ")"),
    (re.compile(r"^Interval\.Lopen\((.*)\)$"), "(", "]"),
    (re.compile(r"^Interval\.open\((.*)\)$"), "(", ")"),
)
_PMATRIX = "\\begin{pmatrix}"
_NUMERIC_MATRIX = re.compile(r"Matrix\(\[[0-9\s.,+\-*/\[\]()]*\]\)")


def _pi_as_number(text: str, pi: float) -> Any:
    """`\\pi` written as `*pi` (after a digit) or `1*pi`, then evaluated; the rewritten text where that fails."""
    found = text.find("\\pi")
    while found != -1:
        factor = "*" if found > 0 and text[found - 1].isdigit() else "1*"
        text = text[:found] + f"{factor}{pi}" + text[found + 3 :]
        found = text.find("\\pi", found + 1)
    try:
        return literal_arithmetic(text)
    except Exception:  # noqa: BLE001 - verl suppresses every eval() failure here
        return text


def _numina_normalize(answer: Any, pi: float) -> Any:
    """math_equal's normalize: `$5` -> `5`, `50%` / `50\\%` -> `50`, a base subscript dropped (`101_2` is the int 101;
    a non-number before `_` raises, as verl's float() does), `\\pi` evaluated."""
    if isinstance(answer, str):
        if _DOLLAR_NUMBER.match(answer):
            return answer[1:]
        if any(pattern.match(answer) for pattern in _PERCENT_NUMBER):
            return answer.replace("\\%", "").replace("%", "")
        if "_" in answer:
            return int(float(answer.split("_")[0]))
        if "\\pi" in answer:
            return _pi_as_number(answer, pi)
    return answer


def _as_number(value: Any) -> float | None:
    """math_equal's is_digit: float(value) with `{,}` (else `,`) removed; None when it is no number."""
    text = str(value)
    try:
        return float(text.replace("{,}", "") if "{,}" in text else text.replace(",", ""))
    except ValueError:
        return None


def _numbers_equal(prediction: float, reference: float, include_percentage: bool, tolerance: float) -> bool:
    candidates = [reference / 100, reference, reference * 100] if include_percentage else [reference]
    return any(math.isclose(candidate, prediction, rel_tol=tolerance) for candidate in candidates)


def _interval_as_brackets(prediction: str) -> str:
    """sympy's `Interval.Ropen(a, b)` and the like written as `[a, b)`."""
    for pattern, left, right in _INTERVALS:
        found = pattern.match(prediction)
        if found:
            return f"{left}{found.group(1)}{right}"
    return prediction


def _all_equal(pairs: list[tuple[Any, Any]], include_percentage: bool, tolerance: float) -> bool:
    """Every (prediction, reference) pair math_equal, each one compared (verl builds the whole list, so an error in any
    pair is an error of the whole)."""
    verdicts = [math_equal(p, r, include_percentage, tolerance) for p, r in pairs]
    return all(verdicts)


def _matrix_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """A `Matrix([[...]])` or `[[...]]` answer to a `\\begin{pmatrix}` reference, element by element.

    verl hands a `Matrix(...)` answer to sympy's parse_expr and a `[...]` one to eval(); rlrun parses only numeric
    `Matrix` texts, and evaluates `[...]` as literal arithmetic (which raises where verl's eval raises, on names)."""
    if _PMATRIX not in reference:
        return False
    if prediction.startswith("Matrix"):
        if not _NUMERIC_MATRIX.fullmatch(prediction):
            return False
        try:
            matrix = _sympy()[1].parse_expr(prediction)
            items = reference.split()[1:-1:2]
            return len(matrix) == len(items) and _all_equal(list(zip(matrix, items)), include_percentage, tolerance)
        except Exception:  # noqa: BLE001 - verl: a matrix it cannot compare is not equal
            return False
    if prediction.startswith("[") and prediction.endswith("]") and isinstance(literal_arithmetic(prediction), list):
        try:
            rows_value = literal_arithmetic(prediction)
            body = reference.removeprefix("\\\\begin{pmatrix}").removeprefix(_PMATRIX)
            body = body.removesuffix("\\\\end{pmatrix}").removesuffix("\\end{pmatrix}")
            rows = [row.split("&") if "&" in row else row for row in body.split("\\")]
            return len(rows_value) == len(rows) and _all_equal(
                list(zip(rows_value, rows)), include_percentage, tolerance
            )
        except Exception:  # noqa: BLE001 - as above
            return False
    return False


def _structure_equal(prediction: str, reference: str, include_percentage: bool, tolerance: float) -> bool:
    """math_equal's text cases: brackets ignored where the kinds are compatible, intervals and tuples element by
    element, comma lists, sympy Points, matrices."""
    prediction = _interval_as_brackets(prediction)
    pred_bare, ref_bare = prediction, reference
    if (prediction.startswith("[") and prediction.endswith("]") and not reference.startswith("(")) or (
        prediction.startswith("(") and prediction.endswith(")") and not reference.startswith("[")
    ):
        pred_bare, ref_bare = pred_bare.strip("[]()"), ref_bare.strip("[]()")
    for bracket in "{}()":
        pred_bare, ref_bare = pred_bare.replace(bracket, ""), ref_bare.replace(bracket, "")
    if pred_bare == ref_bare:
        return True
    if (
        prediction
        and reference
        and prediction[0] in "(["
        and prediction[-1] in ")]"
        and prediction[0] == reference[0]
        and prediction[-1] == reference[-1]
    ):
        pred_parts, ref_parts = prediction[1:-1].split(","), reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            list(zip(pred_parts, ref_parts)), include_percentage, tolerance
        ):
            return True
    if "," in prediction and "," in reference:
        pred_parts = [part.strip() for part in prediction.split(",")]
        ref_parts = [part.strip() for part in reference.split(",")]
        if len(pred_parts) == len(ref_parts):
            return _all_equal(list(zip(pred_parts, ref_parts)), include_percentage, tolerance)
    if prediction.startswith("Point") and reference[0] == "(" and reference[-1] == ")":
        pred_parts = prediction[prediction.find("(") + 1 : -1].split(",")
        ref_parts = reference[1:-1].split(",")
        if len(pred_parts) == len(ref_parts) and _all_equal(
            list(zip(pred_parts, ref_parts)), include_percentage, tolerance
        ):
            return True
    # verl goes on to symbolic_equal here, which always answers False (see math_equal): nothing more to try.
    return _matrix_equal(prediction, reference, include_percentage, tolerance)


def math_equal(
    prediction: Any, reference: Any, include_percentage: bool = True, tolerance: float = 1e-4, pi: float = math.pi
) -> bool:
    """prime_math's grader.math_equal, as verl actually scores: equal text, equal numbers (within `tolerance`, also
    against reference x100 and /100), then the bracket, interval, tuple and matrix cases.

    verl's last step, symbolic_equal, never says equal: it enters `with timeout_limit(...)`, a decorator rather than a
    context manager, and swallows the TypeError, so neither its parse nor its simplify runs (verl-project/verl#7437
    would fix it). rlrun leaves that step out, which is the same verdict: `\\boxed{2/4}` against `1/2` scores 0."""
    prediction, reference = _numina_normalize(prediction, pi), _numina_normalize(reference, pi)
    if isinstance(prediction, str) and len(prediction) > 1000:
        prediction = prediction[:1000]
    if isinstance(prediction, str) and isinstance(reference, str):
        if prediction.strip().lower() == reference.strip().lower():
            return True
        if prediction.replace(" ", "") == reference.replace(" ", ""):
            return True
    pred_number, ref_number = _as_number(prediction), _as_number(reference)
    if pred_number is not None and ref_number is not None:
        return _numbers_equal(pred_number, ref_number, include_percentage, tolerance)
    if not prediction and prediction not in [0, False]:
        return False
    return _structure_equal(str(prediction).strip(), str(reference).strip(), include_percentage, tolerance)


def prime_math_score(solution: str, ground_truth: Any) -> float:
    """verl's prime_math.compute_score for the numina_* sources, as its dispatcher returns it: 1.0 when the extracted
    answer passes the PRM800K grader or math_equal (answers or truths with `\\pi` also try pi = 3.14), else 0.0.

    Any error inside math_equal counts as wrong, as in verl; errors of the grader (a missing pylatexenc) propagate."""
    response, truth = str(solution), str(ground_truth)
    answer = match_answer(response)
    if PRIME_GRADER.grade(answer, truth):
        return 1.0
    try:
        if "\\pi" in answer or "\\pi" in truth:
            # both run, as in verl: an error in either makes the answer wrong
            verdicts = [math_equal(answer, truth, pi=pi) for pi in (math.pi, 3.14)]
            correct = any(verdicts)
        else:
            correct = math_equal(answer, truth)
    except Exception:  # noqa: BLE001 - verl: an answer math_equal cannot take is wrong
        correct = False
    return 1.0 if correct else 0.0


# ---- geo3k (mathruler) ---------------------------------------------------------------------------------------------

GEO3K_FORMAT_WEIGHT = 0.1
_GEO3K_FORMAT = re.compile(r"<think>.*</think>.*\\boxed\{.*\}.*", re.DOTALL)


def extract_boxed_content(text: str) -> str:
    """mathruler's extract_boxed_content: the last `\\boxed{...}`'s content, stripped; the string "None" without a
    balanced one, which is then graded like any answer (it matches a ground truth "None")."""
    start = text.rfind("\\boxed{")
    span = _brace_span(text, start) if start >= 0 else None
    return "None" if span is None else text[start + len("\\boxed{") : span[1]].strip()


def geo3k_score(solution: str, ground_truth: Any, format_weight: float = GEO3K_FORMAT_WEIGHT) -> float:
    """verl's geo3k.compute_score: 0.9 x (the boxed answer graded right by mathruler) + 0.1 x (the response is
    `<think>...</think>...\\boxed{...}...`), so one of 0, 0.1, 0.9, 1.0."""
    truth = _text_truth(ground_truth, "geometry3k")
    accuracy = 1.0 if MATHRULER_GRADER.grade(extract_boxed_content(solution), truth) else 0.0
    formatted = 1.0 if _GEO3K_FORMAT.fullmatch(solution) else 0.0
    return (1.0 - format_weight) * accuracy + format_weight * formatted
