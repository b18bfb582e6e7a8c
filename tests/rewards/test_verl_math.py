"""rlrun's versions of verl's math rule scores (rlrun.rewards.verl_math, dispatched by rlrun.rewards.rules) on cases
whose verdicts verl's own files give: verl 1dda039's default_compute_score with math_dapo.py, prime_math/ and geo3k.py
(mathruler 0.1.0's grader) run on every case here, plus the MATH percent steps of math_reward.py. Includes the corners
where a reimplementation easily differs: the boxed fallback, prime_math's broken symbolic_equal, the two PRM800K
copies' differences."""

from __future__ import annotations

import dataclasses
import signal
import threading
import time

import pytest

from peer_data import write_parquet
from rlrun.cli.parser import parse_args
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.data.prompts import prompt_spec
from rlrun.plan.preflight import ppo_prompts
from rlrun.rewards import verl_math
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.rules import UnknownDataSource, default_compute_score, scorer_for
from rlrun.rewards.verl_math import normalize_math
from rlrun.runtime.errors import MissingExtraError, RewardError


def _dapo(score: float, pred: str | None) -> dict:
    return {"score": score, "acc": score == 1.0, "pred": pred}


FILLER = " filler." * 40  # 320 characters: pushes an answer line out of the last 300

# ---- the spec's table (research/verl_scorers.md section 4), each verdict verl's --------------------------------------

DAPO_CASES = [
    ("D1", "math_dapo", "The total is 34.\nAnswer: 34", "34", _dapo(1.0, "34")),
    ("D2", "math_dapo", "So the result is \\boxed{34}.", "34", _dapo(1.0, "34")),  # 1dda039's boxed fallback
    ("D3", "math_dapo", "Answer: 35", "34", _dapo(-1.0, "35")),
    ("D4", "math_dapo", "Answer: 12 inches", "12", _dapo(1.0, "12")),
    ("D5", "math_dapo", "Answer: $\\frac{1}{2}$", "\\frac{1}{2}", _dapo(1.0, "\\frac{1}{2}")),
    ("D6", "math_dapo", "Answer: \\dfrac12", "\\frac{1}{2}", _dapo(-1.0, "\\dfrac{1}{2}")),  # no dfrac -> frac
    ("D7", "math_dapo", "Answer: \\frac12", "\\frac{1}{2}", _dapo(1.0, "\\frac{1}{2}")),
    ("D8", "math_dapo", "answer : x = 1,000", "1000", _dapo(1.0, "1000")),
    ("D9", "math_dapo", "Answer: 42" + FILLER, "42", _dapo(-1.0, "[INVALID]")),
    ("D10", "math_dapo", "Answer: \\boxed{34}", "34", _dapo(1.0, "34")),
    ("D11", "math_dapo", "Answer: 50\\%", "50", _dapo(-1.0, "50\\%")),  # math_dapo keeps \%
    ("D12", "math_dapo", "Answer: 90^\\circ", "90", _dapo(1.0, "90")),
    ("A1", "aime_2024", "Answer: 033", "33", _dapo(-1.0, "033")),  # leading zeros stay
    ("A2", "aime25", "First Answer: 3\nfinal Answer: 204", "204", _dapo(1.0, "204")),  # the last line
    ("A3", "aime", "\\boxed{\\frac{1}{2}}", "\\frac{1}{2}", _dapo(1.0, "\\frac{1}{2}")),
]
NUMINA_CASES = [
    ("N1", "numina_olympiads", "The answer is 5.", "5", 1.0),
    ("N2", "numina_cn_k12", "so \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("N3", "numina_synthetic_math", "\\boxed{2/4}", "1/2", 0.0),  # verl's symbolic_equal never says equal
    ("N4", "numina_amc_aime", "Answer: 50\\%", "50", 1.0),
    ("N5", "numina_aops_forum", "\\boxed{7}", "8", 0.0),
    ("N6", "numina_synthetic_amc", "\\boxed{0.5}", "50", 1.0),  # 0.5 is 50/100
]
MATH_CASES = [
    ("M1", "lighteval/MATH", "\\boxed{50\\%}", "50", 1.0),
    ("M2", "lighteval/MATH", "\\boxed{50\\\\%}", "50", 1.0),
    ("M3", "lighteval/MATH", "\\boxed{50%}", "50", 0.0),  # a bare % stays
    ("M4", "lighteval/MATH", "\\boxed{50\\\\\\%}", "50", 1.0),  # verl's "\\\\%" step
    ("M5", "HuggingFaceH4/MATH-500", "\\boxed{\\dfrac{1}{2}}", "0.5", 1.0),
    ("M6", "DigitalLearningGmbH/MATH-lighteval", "so \\boxed 5", "5", 1.0),
    ("M7", "lighteval/MATH", "\\boxed{10\\text{ inches}}", "10", 1.0),
]
OTHER_CASES = [
    ("G1", "openai/gsm8k", "so #### 1,234", "1234", 1.0),
    ("S1", "searchR1_nq", "<answer>The Eiffel Tower!</answer>", {"target": ["Eiffel Tower"]}, 1.0),
]
SPEC_CASES = DAPO_CASES + NUMINA_CASES + MATH_CASES + OTHER_CASES


@pytest.mark.parametrize("case, source, solution, truth, expected", SPEC_CASES, ids=[c[0] for c in SPEC_CASES])
def test_the_specs_cases_score_as_verl(case, source, solution, truth, expected):
    assert default_compute_score(source, solution, truth) == expected


def test_gsm8k_with_an_int_truth_is_read_as_its_text():
    """G2, a deliberate difference: verl compares the extracted "1234" with the truth as it is, so an int truth never
    matches (verl's own preprocessing writes text); rlrun compares with str(truth), as a jsonl label 1234 reads."""
    assert default_compute_score("openai/gsm8k", "so #### 1,234", 1234) == 1.0
    assert default_compute_score("openai/gsm8k", "so #### 1,234", "1234") == 1.0


def test_an_upper_case_aime_is_unknown_as_in_verl():
    """E1: verl's startswith("aime") is case-sensitive; verl raises NotImplementedError, rlrun a ValueError that is
    also one."""
    with pytest.raises(NotImplementedError, match=r"no built-in rule score for data_source 'AIME_2024'"):
        default_compute_score("AIME_2024", "Answer: 1", "1")
    with pytest.raises(UnknownDataSource):
        default_compute_score("AIME_2024", "Answer: 1", "1")
    assert scorer_for("aime_2025_ii") is verl_math.math_dapo_score and scorer_for("math") is verl_math.math_dapo_score
    assert scorer_for("xaime") is None


@pytest.mark.parametrize("answer, normalised", [
    ("a banana", "banana"),
    ("issue 4", "is4"),  # "sue" goes, and "a " ate nothing: substring edits
    ("5 cm", "5"),
    ("\\text{5 km}", "5"),
    ("x=3, y=4", "4"),  # after the last "="
    ("$5$ dollars", "5"),
    ("1,000,000", "1000000"),
    ("3.", "3."),
    ("\\$5", "5"),
])
def test_normalize_final_answer_as_verl(answer, normalised):
    assert verl_math.normalize_final_answer(answer) == normalised


@pytest.mark.parametrize("solution, truth, expected", [
    ("Answer: 35\n\\boxed{34}", "34", _dapo(-1.0, "35")),  # a wrong answer line is not rescued by a box
    ("so \\boxed{ 34 }", "34", _dapo(-1.0, " 34 ")),  # the box is compared raw
    ("\\boxed{34}" + "x" * 100, "34", _dapo(-1.0, "[INVALID]")),  # the box must be in the last 100 characters
    ("\\boxed{\\frac{1}{2}", "\\frac{1}{2}", _dapo(-1.0, "[INVALID]")),  # unbalanced
    ("\\fbox{34}", "34", _dapo(-1.0, "[INVALID]")),
    ("Answer:\n34", "34", _dapo(1.0, "34")),  # \s* after the colon crosses the line end
])
def test_math_dapo_corners_as_verl(solution, truth, expected):
    assert default_compute_score("math_dapo", solution, truth) == expected


def test_math_dapo_strict_box_mode():
    assert verl_math.math_dapo_score("Answer: 34", "34", strict_box_verify=True) == _dapo(-1.0, None)
    assert verl_math.math_dapo_score("Answer: 3 \\boxed{34}", "34", strict_box_verify=True) == _dapo(1.0, "34")


# ---- numina_* (prime_math): verdicts of verl's prime_math.compute_score ----------------------------------------------


@pytest.mark.parametrize("solution, truth, score", [
    ("\\boxed{3 liters}", "3", 1.0),  # "liter" is a unit in verl's copy (not mathruler's)
    ("\\boxed{2\\sqrt{3}}", "2 \\sqrt { 3 }", 1.0),
    ("\\boxed{\\sqrt{2}}", "\\sqrt 2", 1.0),  # pylatexenc reads both
    ("so we get \\boxed{2\\pi}", "6.28", 1.0),  # pi = 3.14 is tried too
    ("\\boxed{\\frac{\\pi}{2}}", "1.5708", 0.0),
    ("\\boxed{x^2+1}", "1+x^2", 1.0),  # sympy
    ("\\boxed{(1, 2)}", "(1,2)", 1.0),
    ("\\boxed{[1, 2)}", "(1,2)", 0.0),  # the brackets must match
    ("\\boxed{101_2}", "101", 1.0),  # a base subscript is dropped
    ("\\boxed{x_1}", "5", 0.0),
    ("\\boxed{Interval.Ropen(0, 1)}", "[0, 1)", 1.0),
    ("\\boxed{\\$5}", "5", 1.0),
    ("The answer is 1,000,000.", "1000000", 1.0),
    ("\\boxed{1.00005}", "1", 1.0),  # within 1e-4
    ("\\boxed{1.0002}", "1", 0.0),
    ("\\boxed{\\frac{\\sqrt{2}}{2}}", "\\frac{1}{\\sqrt{2}}", 1.0),
    ("\\boxed{Matrix([[1], [2]])}", "\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", 1.0),
    ("\\boxed{[[1,2],[3,4]]}", "\\begin{pmatrix} 1 & 2 \\\\ 3 & 4 \\end{pmatrix}", 0.0),
    ("\\boxed{Point(1, 2)}", "(1, 2)", 0.0),
    ("\\boxed{7 3/4}", "\\frac{31}{4}", 1.0),  # a mixed number
    ("\\boxed{2 million}", "2000000", 0.0),
])
def test_numina_as_verl(solution, truth, score):
    assert default_compute_score("numina_olympiads", solution, truth) == score


def test_math_equal_leaves_out_verls_broken_symbolic_step():
    """N3: sympy says 2/4 - 1/2 is 0, but verl's symbolic_equal never runs its checks (a `with` on a decorator)."""
    assert verl_math.math_equal("2/4", "1/2") is False
    assert verl_math.math_equal("0.5", "50") and verl_math.math_equal("50", "0.5")  # x100 and /100
    assert not verl_math.math_equal("0.5", "50", include_percentage=False)
    assert verl_math.match_answer("We see that the answer is $x = 12$. Done") == "12$"


def test_literal_arithmetic_is_evals_value_without_names():
    for text in ["2*3.141592653589793", "(1, 2*3.14)", "{1*3.14}", "[[1, 2], [3, 4]]", " 1 < 2", "-2**2", "7 ^ 2"]:
        assert verl_math.literal_arithmetic(text) == eval(text.lstrip())
    for text in ["__import__('os')", "x + 1", "abs(-1)", "[1][0]", "'a' * 3", "9**9**9"]:
        with pytest.raises(verl_math.NotArithmetic):
            verl_math.literal_arithmetic(text)
    with pytest.raises(SyntaxError):
        verl_math.literal_arithmetic("\\frac{1*3.14}{2}")


# ---- geometry3k (mathruler): verdicts of verl's geo3k.compute_score with mathruler 0.1.0 -----------------------------


@pytest.mark.parametrize("solution, truth, score", [
    ("<think>The angle is 30 degrees.</think> \\boxed{30}", "30", 1.0),
    ("<think>x</think> \\boxed{31}", "30", 0.1),  # the format alone
    ("The answer is \\boxed{30}", "30", 0.9),  # no think tags
    ("<think>x</think> the answer is 30", "30", 0.0),  # no box: the answer is "None"
    ("<think>x</think> \\boxed{\\frac{1}{2}}", "0.5", 1.0),
    ("<think>x</think> \\boxed{2\\sqrt{3}}", "2 \\sqrt { 3 }", 1.0),
    ("<think>x</think> \\boxed{50\\%}", "50", 1.0),
    ("\\boxed{50%}", "50", 0.9),
    ("<think>x</think> \\boxed{3 liters}", "3", 0.1),  # no "liter" in mathruler's units
    ("\\boxed{\\frac{2}{4}}", "\\frac{1}{2}", 0.0),  # an unreduced fraction
    ("<think>a</think>\\boxed{x^2+1}", "1+x^2", 1.0),
    ("\\boxed{5", "5", 0.0),
    ("<think>a</think>\\boxed{None}", "None", 1.0),  # mathruler's "no box" is itself an answer
])
def test_geometry3k_as_verl(solution, truth, score):
    assert default_compute_score("hiyouga/geometry3k", solution, truth) == score


def test_one_prm800k_grader_two_settings():
    """verl's prime_math and mathruler carry copies of PRM800K's grader that differ in the unit list, a final squeeze
    of spaces and braces, the mathd percent steps and the sympy bound; rlrun has one grader with those as fields."""
    prime, ruler = verl_math.PRIME_GRADER, verl_math.MATHRULER_GRADER
    assert prime.normalize("3 liters") == "3" and ruler.normalize("3 liters") == "3liters"
    assert prime.normalize("{x} + 1") == "{x} + 1" and ruler.normalize("{x} + 1") == "x+1"
    assert verl_math.mathd_normalize("50%", prime.mathd_percents) == "50%"
    assert verl_math.mathd_normalize("50%", ruler.mathd_percents) == "50"
    assert normalize_math("50\\\\%") == "50" and normalize_math("50%") == "50%"  # verl's strip_string (M2, M3)
    assert prime.sympy_timeout_s == 10.0 and ruler.sympy_timeout_s is None
    assert verl_math.split_tuple("(1,000, 2)") == ["1000", "2"]


# ---- the sympy bound -------------------------------------------------------------------------------------------------


def test_bounded_gives_the_timeout_value_and_restores_the_alarm():
    def mine(signum, frame):
        raise AssertionError("the earlier handler ran")

    earlier = signal.signal(signal.SIGALRM, mine)
    try:
        signal.setitimer(signal.ITIMER_REAL, 30.0)
        began = time.monotonic()
        assert verl_math.bounded(0.2, lambda: time.sleep(5) or "done", "timeout") == "timeout"
        assert time.monotonic() - began < 2
        assert signal.getsignal(signal.SIGALRM) is mine
        assert 25 < signal.getitimer(signal.ITIMER_REAL)[0] <= 30  # the earlier timer runs on
        assert verl_math.bounded(5.0, lambda: "done", "timeout") == "done"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, earlier)


def test_bounded_off_the_main_thread_runs_unbounded():
    seen = []
    worker = threading.Thread(target=lambda: seen.append(verl_math.bounded(0.01, lambda: time.sleep(0.1) or 1, 0)))
    worker.start()
    worker.join()
    assert seen == [1]


def test_a_sympy_comparison_past_its_bound_is_wrong():
    assert verl_math.PRIME_GRADER.grade("x^2+1", "1+x^2")
    instant = dataclasses.replace(verl_math.PRIME_GRADER, sympy_timeout_s=1e-6)
    assert not instant.grade("x^2+1", "1+x^2")


# ---- pylatexenc is optional ------------------------------------------------------------------------------------------


def test_a_missing_pylatexenc_fails_clearly(monkeypatch):
    monkeypatch.setattr(verl_math, "_latex_converter", [None])  # as after a failed import
    assert default_compute_score("numina_olympiads", "The answer is 5.", "5") == 1.0  # no LaTeX to read: no need
    with pytest.raises(MissingExtraError, match=r"^numina_\* / geometry3k scoring needs pylatexenc: pip install "):
        default_compute_score("numina_olympiads", "\\boxed{\\sqrt{2}}", "\\sqrt 2")
    fn = load_compute_score_function("builtin")
    with pytest.raises(RewardError, match=r"raised MathExtraMissing: .*pip install 'rlrun\[math\]'.* on sample 0"):
        fn(["q\\boxed{\\sqrt{2}}"], ["q"], ["\\sqrt 2"], responses=["\\boxed{\\sqrt{2}}"],
           data_sources=["hiyouga/geometry3k"], extra_infos=[None])


# ---- a DAPO-Math-17k record through rlrun's prompt reader and --compute_score builtin --------------------------------

DAPO_PROMPT = ("Solve the following math problem step by step. The last line of your response should be of the form "
               "Answer: $Answer (without quotes) where $Answer is the answer to the problem.\n\n{}\n\nRemember to put "
               'your answer on its own line after "Answer:".')


def test_a_dapo_math_record_is_read_and_scored_as_verl(tmp_path):
    """DAPO-Math-17k's parquet layout (verl's recipe/dapo data): data_source math_dapo, a message list, a rule ground
    truth; AIME 2024 in the same layout. Read by rlrun's prompt reader from verl's command line, scored per record."""
    rows = [{"data_source": source, "prompt": [{"content": DAPO_PROMPT.format(question), "role": "user"}],
             "ability": "MATH", "reward_model": {"ground_truth": truth, "style": "rule"},
             "extra_info": {"index": index}}
            for source, question, truth, index in [("math_dapo", "What is 17 times 2?", "34", "9a9b6eb4"),
                                                   ("aime_2024", "Find 100 + 4.", "104", "aime-0")]]
    data = write_parquet(tmp_path / "dapo-math-17k.parquet", rows)
    cfg = parse_args([f"data.train_files={data}", "data.max_prompt_length=1024", "--save_path", str(tmp_path / "run"),
                      "--compute_score", "builtin"]).config
    prompts = ppo_prompts(cfg, build_byte_tokenizer(), prompt_spec(cfg.data, cfg.train.seed))
    assert prompts.labels == ["34", "104"] and "What is 17 times 2?" in prompts.texts[0]
    order = [0, 0, 0, 1]
    meta = prompts.meta(order)
    assert meta.data_sources == ["math_dapo"] * 3 + ["aime_2024"] and meta.extra_infos[0] == {"index": "9a9b6eb4"}
    responses = ["17 * 2 = 34.\nAnswer: 34", "Answer: 35", "so the product is \\boxed{34}", "Answer: $104$"]
    score = load_compute_score_function(cfg.reward.compute_score, cfg.reward.compute_score_name)
    result = score([prompts.texts[i] + r for i, r in zip(order, responses)], [prompts.texts[i] for i in order],
                   meta.labels, responses=responses, data_sources=meta.data_sources, extra_infos=meta.extra_infos)
    assert result.rewards.tolist() == [1.0, -1.0, 1.0, 1.0]
    assert result.extra_logs == {"acc": pytest.approx(0.75)}  # math_dapo's "acc" is logged; its "pred" text is not
