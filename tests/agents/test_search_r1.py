"""The Search-R1 agent step by step against a live rlrun.retriever_server over the example corpus.

The model is the only stand-in: each step() gets the action text a model would have generated.
Expected texts are written out by hand from Search-R1's generation.py.
"""

from __future__ import annotations

import asyncio
import json

import pytest
from helpers import refusing_port
from retriever_process import EXAMPLE_TRAIN, RetrieverProcess, start_retriever, stop_retriever

from rlrun.agents.api import AgentInstanceBase
from rlrun.agents.search_r1 import RetrieverClient
from rlrun.agents.search_r1 import (INVALID_ACTION_FEEDBACK, SEARCH_R1_STOP, SearchR1Agent, cut_action,
                                    parse_action, passages_to_string, search_r1_agent_factory, search_r1_prompt)

pytestmark = pytest.mark.timeout(60)

PROMPT = (
    "Answer the given question. You must conduct reasoning inside <think> and </think> first every time you get "
    "new information. After reasoning, if you find you lack some knowledge, you can call a search engine by "
    "<search> query </search> and it will return the top searched results between <information> and "
    "</information>. You can search as many times as your want. If you find no further external knowledge "
    "needed, you can directly provide the answer inside <answer> and </answer>, without detailed illustrations. "
    "For example, <answer> Beijing </answer>. Question: what is the capital of australia?\n"
)
INVALID = ("\nMy previous action is invalid. If I want to search, I should put the query between <search> and "
           "</search>. If I want to give the final answer, I should put the answer between <answer> and </answer>. "
           "Let me try again.\n")
CANBERRA_INFO = (
    '\n\n<information>Doc 1(Title: "Canberra") Canberra is the capital city of Australia. It was chosen as the site '
    'of the capital in 1908.\nDoc 2(Title: "Tokyo") Tokyo is the capital of Japan and one of the most populous '
    "cities in the world.</information>\n\n"
)  # Doc 2: Tokyo and Ottawa share only "capital" with the query; BM25 prefers the shorter Tokyo document.
LABEL = json.dumps(["Canberra"])


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    srv = start_retriever(tmp_path_factory.mktemp("retriever"))
    try:
        yield srv
    finally:
        stop_retriever(srv.proc)


def dead_client() -> RetrieverClient:
    """A client whose every search fails: proves that a step made no search."""
    return RetrieverClient(f"http://127.0.0.1:{refusing_port()}/retrieve", topk=2, retries=1, timeout_s=2)


def step(agent: SearchR1Agent, observation_text: str, action_text: str, turn: int, last_turn: bool = False,
         label: str = LABEL) -> dict:
    return asyncio.run(agent.step({"observation_text": observation_text, "action_text": action_text, "label": label,
                                   "sampling_params": None, "turn": turn, "last_turn": last_turn}))


def logs(searches: int, valid: int, invalid: int, answered: int, em: int) -> dict[str, float]:
    return {"searches": searches, "valid_actions": valid, "invalid_actions": invalid, "answered": answered,
            "exact_match": em}


def test_prompt_template_and_stop_strings() -> None:
    assert search_r1_prompt("  what is the capital of australia ") == PROMPT
    assert search_r1_prompt("what is the capital of australia?") == PROMPT
    assert SEARCH_R1_STOP == ("</search>", "</answer>")
    assert INVALID_ACTION_FEEDBACK == INVALID
    first = json.loads(EXAMPLE_TRAIN.read_text().splitlines()[4])
    assert first == {"prompt": PROMPT, "question": "what is the capital of australia?", "golden_answers": ["Canberra"]}


@pytest.mark.parametrize("text, expected", [
    ("<search> a </search> tail", "<search> a </search>"),
    ("<answer>x</answer>\n\nmore", "<answer>x</answer>"),
    ("<answer>x</answer> then <search>y</search>!", "<answer>x</answer> then <search>y</search>"),  # </search> wins
    ("no tag at all", "no tag at all"),
])
def test_cut_action(text: str, expected: str) -> None:
    assert cut_action(text) == expected


@pytest.mark.parametrize("text, expected", [
    ("<think>hm</think>\n<search>  capital of\naustralia </search>", ("search", "capital of\naustralia")),
    ("<answer> Canberra </answer><search>x</search>", ("answer", "Canberra")),
    ("<search>mismatched</answer>", (None, "")),
    ("<think>only thinking</think>", (None, "")),
])
def test_parse_action(text: str, expected: tuple) -> None:
    assert parse_action(text) == expected


def test_passages_to_string() -> None:
    hits = [{"document": {"contents": '"T1"\nline one\nline two'}, "score": 2.0},
            {"document": {"contents": '"T2"'}, "score": 1.0}]
    assert passages_to_string(hits) == 'Doc 1(Title: "T1") line one\nline two\nDoc 2(Title: "T2") \n'
    assert passages_to_string([]) == ""


def test_search_then_right_answer(server: RetrieverProcess) -> None:
    agent = SearchR1Agent(RetrieverClient(server.url, topk=2))
    assert isinstance(agent, AgentInstanceBase)
    assert asyncio.run(agent.reset({"observation": PROMPT, "label": LABEL})) == {"observation": PROMPT}
    action0 = "<think>I should look it up.</think>\n<search> capital of australia </search>\n\nignored"
    out = step(agent, PROMPT, action0, turn=0)
    assert out == {"rewards": 0.0, "scores": 0.0, "environment_feedback": CANBERRA_INFO, "done": False,
                   "extra_logs": logs(1, 1, 0, 0, 0)}
    # The runner's next observation_text: everything so far.
    text = PROMPT + action0 + CANBERRA_INFO
    out = step(agent, text, "<think>It is Canberra.</think>\n<answer> Canberra </answer>", turn=1)
    assert out == {"rewards": 1.0, "scores": 1.0, "environment_feedback": "", "done": True,
                   "extra_logs": logs(1, 2, 0, 1, 1)}


def test_wrong_answer_and_invalid_action(server: RetrieverProcess) -> None:
    agent = SearchR1Agent(RetrieverClient(server.url, topk=2))
    out = step(agent, PROMPT, "<think>I will just say it</think> Sydney", turn=0)
    assert out == {"rewards": 0.0, "scores": 0.0, "environment_feedback": INVALID, "done": False,
                   "extra_logs": logs(0, 0, 1, 0, 0)}
    text = PROMPT + "<think>I will just say it</think> Sydney" + INVALID
    out = step(agent, text, "<answer>Sydney</answer>", turn=1)
    assert out == {"rewards": 0.0, "scores": 0.0, "environment_feedback": "", "done": True,
                   "extra_logs": logs(0, 1, 1, 1, 0)}


def test_answer_without_the_prompt_example_scores_zero() -> None:
    # Search-R1 scores prompt + response and needs 2 <answer> blocks: the prompt's example is one of them.
    out = step(SearchR1Agent(dead_client()), "Question: capital of australia?\n", "<answer>Canberra</answer>", turn=0)
    assert out["done"] is True and out["rewards"] == 0.0 and out["extra_logs"]["answered"] == 1


@pytest.mark.parametrize("action, expected_logs", [
    ("<search> capital of australia </search>", logs(1, 1, 0, 0, 0)),
    ("I am still thinking", logs(0, 0, 1, 0, 0)),
])
def test_last_turn_runs_no_search_and_ends(action: str, expected_logs: dict) -> None:
    out = step(SearchR1Agent(dead_client()), PROMPT, action, turn=3, last_turn=True)
    assert out == {"rewards": 0.0, "scores": 0.0, "environment_feedback": "", "done": True,
                   "extra_logs": expected_logs}


def test_last_turn_answer_is_scored() -> None:
    out = step(SearchR1Agent(dead_client()), PROMPT + "<search>x</search>" + CANBERRA_INFO,
               "<answer>canberra.</answer>", turn=1, last_turn=True, label='{"target": ["Canberra"]}')
    assert out["rewards"] == 1.0 and out["done"] is True and out["extra_logs"] == logs(0, 1, 0, 1, 1)


def test_search_on_a_dead_retriever_raises_the_retriever_error() -> None:
    from rlrun.agents.search_r1 import RetrieverError

    with pytest.raises(RetrieverError, match="failed after 1 attempts"):
        step(SearchR1Agent(dead_client()), PROMPT, "<search>x</search>", turn=0)


def test_reset_needs_golden_answers() -> None:
    agent = SearchR1Agent(dead_client())
    with pytest.raises(ValueError, match="--label_key"):
        asyncio.run(agent.reset({"observation": PROMPT, "label": None}))
    with pytest.raises(ValueError, match="'target'"):
        asyncio.run(agent.reset({"observation": PROMPT, "label": '{"answers": ["x"]}'}))


def test_factory_shares_one_client_and_a_turn_is_one_post(server: RetrieverProcess) -> None:
    make = search_r1_agent_factory(server.url, 2, 10.0, 2)
    agents = [make() for _ in range(4)]
    assert len({id(a.retriever) for a in agents}) == 1 and agents[0] is not agents[1]
    questions = ["capital of australia", "mona lisa painter", "largest planet", "first person on the moon"]
    before = server.wait_log_lines("POST /retrieve -> 200 batch=4 ", 0)

    async def turn() -> list[dict]:
        return list(await asyncio.gather(*(
            a.step({"observation_text": PROMPT, "action_text": f"<search>{q}</search>", "label": LABEL,
                    "sampling_params": None, "turn": 0, "last_turn": False}) for a, q in zip(agents, questions))))

    outs = asyncio.run(turn())
    assert outs[0]["environment_feedback"] == CANBERRA_INFO
    assert [o["environment_feedback"].split("(Title: ")[1].split(")")[0] for o in outs] == [
        '"Canberra"', '"Mona Lisa"', '"Jupiter"', '"Apollo 11"']
    assert server.wait_log_lines("POST /retrieve -> 200 batch=4 ", before + 1) == before + 1


def test_episodes_through_the_runner(server: RetrieverProcess) -> None:
    """rlrun's episode runner + this agent + the live server; a scripted engine stands in for the model."""
    from rlrun.agents.calls import AgentCalls
    from rlrun.agents.episodes import EpisodeRunner, TurnLimits, mean_stats
    from rlrun.engines.protocol import Generation
    from rlrun.models.tiny import build_byte_tokenizer

    tok = build_byte_tokenizer()

    def ids(text: str) -> list[int]:
        return tok.encode(text, add_special_tokens=False)

    class ScriptedEngine:
        def __init__(self, turns: list[list[str]]) -> None:
            self.turns, self.stops = turns, []

        def sample(self, prompts, seed, *, max_new_tokens=None, stop=()):
            self.stops.append(stop)
            return Generation([ids(t) for t in self.turns[len(self.stops) - 1][:len(prompts)]], None)

    prompts = [search_r1_prompt("capital of australia"), search_r1_prompt("who wrote hamlet")]
    engine = ScriptedEngine([["<search>capital of australia</search>", "<search>hamlet</search>"],
                             ["<answer>Canberra</answer>", "hmm"],
                             ["<search>never executed</search>"]])
    runner = EpisodeRunner(search_r1_agent_factory(server.url, 1, 10.0, 2), tok,
                           TurnLimits(response_budget=2000, prompt_max_len=2000, max_turns=3, stop=SEARCH_R1_STOP),
                           AgentCalls(timeout_s=30, max_concurrency=8, source="search_r1"))
    before = server.wait_log_lines("POST /retrieve -> 200 batch=2 ", 0)
    posts = server.wait_log_lines("POST /retrieve", 0)
    eps = runner.run(engine, prompts, [ids(p) for p in prompts], [LABEL, '["William Shakespeare"]'], seed=1)
    assert engine.stops == [SEARCH_R1_STOP] * 3
    info0 = ('\n\n<information>Doc 1(Title: "Canberra") Canberra is the capital city of Australia. It was chosen as '
             "the site of the capital in 1908.</information>\n\n")
    info1 = ('\n\n<information>Doc 1(Title: "Hamlet") Hamlet is a tragedy written by William Shakespeare around '
             "1600. Prince Hamlet seeks revenge on his uncle Claudius.</information>\n\n")
    assert eps.responses[0] == ids("<search>capital of australia</search>" + info0 + "<answer>Canberra</answer>")
    assert eps.action_masks[0] == [1] * 37 + [0] * len(ids(info0)) + [1] * 25
    assert eps.responses[1] == ids("<search>hamlet</search>" + info1 + "hmm" + INVALID + "<search>never executed</search>")
    assert eps.action_masks[1] == [1] * 23 + [0] * len(ids(info1)) + [1] * 3 + [0] * len(ids(INVALID)) + [1] * 31
    assert eps.rewards.tolist() == [1.0, 0.0]
    stats = mean_stats([eps.stats])
    assert (stats["agent/searches"], stats["agent/exact_match"], stats["agent/invalid_actions"]) == (1.5, 0.5, 0.5)
    # Turn 0's two searches were one POST; the last turn's search was never sent.
    assert server.wait_log_lines("POST /retrieve -> 200 batch=2 ", before + 1) == before + 1
    assert server.wait_log_lines("POST /retrieve", posts + 2, timeout=0.5) == posts + 1
