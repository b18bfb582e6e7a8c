"""verl's compute_score convention (rlrun.rewards.compute_score): what reaches the function, what comes back, and
every way it can go wrong, in this process and in a spawned pool of worker processes."""

from __future__ import annotations

import textwrap
from pathlib import Path

import pytest

from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.runtime.errors import RewardError

SCORER = '''
def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    if ground_truth == "boom":
        raise ValueError("cannot score")
    if ground_truth == "dict":
        return {"score": 0.5, "acc": 1.0, "note": "text is not logged"}
    if ground_truth == "none":
        return None
    return float(solution_str.strip() == str(ground_truth)) + (0.25 if extra_info and extra_info.get("bonus") else 0.0)

def other(data_source, solution_str, ground_truth, extra_info=None):
    return True
'''


@pytest.fixture
def scorer(tmp_path) -> Path:
    path = tmp_path / "score.py"
    path.write_text(SCORER)
    return path


def _call(fn, responses, labels, extras=None):
    prompts = ["Q:"] * len(responses)
    return fn([p + r for p, r in zip(prompts, responses)], prompts, labels, responses=responses,
              data_sources=["src"] * len(responses), extra_infos=extras or [None] * len(responses))


@pytest.mark.parametrize("workers", [1, 2])
def test_results_and_extras(scorer, workers):
    fn = load_compute_score_function(str(scorer), workers=workers)
    out = _call(fn, [" 7", "8", "x"], ["7", "7", "dict"], [None, {"bonus": True}, None])
    assert out.rewards.tolist() == [1.0, 0.25, 0.5]
    assert out.extra_logs == {"acc": 1.0}  # numeric extras only, averaged over the samples that have them
    assert fn.source == f"{scorer}:compute_score"
    other = load_compute_score_function(f"file://{scorer}", "other", workers=workers)  # verl's file:// prefix
    assert _call(other, ["a"], ["b"]).rewards.tolist() == [1.0]  # a bool counts, as in verl


@pytest.mark.parametrize("workers", [1, 2])
def test_failures_name_the_sample(scorer, workers):
    fn = load_compute_score_function(str(scorer), workers=workers)
    with pytest.raises(RewardError, match=r"raised ValueError: cannot score on sample 1 \(data_source 'src', "
                                          r"ground_truth 'boom'\)"):
        _call(fn, ["a", "b"], ["7", "boom"])
    with pytest.raises(RewardError, match=r"returned 'None' \(NoneType\) for sample 0; return a number or a dict"):
        _call(fn, ["a"], ["none"])


def test_loading_errors_are_one_line(tmp_path, scorer):
    with pytest.raises(RewardError, match="compute_score file .*nope.py does not exist"):
        load_compute_score_function(str(tmp_path / "nope.py"))
    with pytest.raises(RewardError, match=r"missing_fn is missing; define def missing_fn\(data_source, solution_str"):
        load_compute_score_function(str(scorer), "missing_fn")
    assert load_compute_score_function("builtin").source.startswith("built-in rule scores")


def test_a_hung_sample_is_named_in_the_pool(tmp_path):
    """In worker processes the bound is per batch, and the sample still running when it passes is named."""
    path = tmp_path / "slow.py"
    path.write_text(textwrap.dedent('''
        import time
        def compute_score(data_source, solution_str, ground_truth, extra_info=None):
            if ground_truth == "slow":
                time.sleep(60)
            return 1.0
    '''))
    fn = load_compute_score_function(str(path), workers=2, call_timeout_s=2.0)
    with pytest.raises(RewardError, match=r"did not return within --reward_timeout 2 s on sample 1 of 2"):
        _call(fn, ["a", "b"], ["fast", "slow"])
