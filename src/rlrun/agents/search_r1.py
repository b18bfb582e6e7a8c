"""The Search-R1 agent (PeterGriffinJin/Search-R1, search_r1/llm_agent/generation.py) as an rlrun agent.

Each model turn ends at `</search>` or `</answer>` (SEARCH_R1_STOP, cut by the episode runner) or
at EOS / the token cap. The step then does what Search-R1's `execute_predictions` does for one row:

* `<answer>...</answer>`: the episode is done, no feedback;
* `<search>query</search>`: the retriever's top-k passages come back as
  `\\n\\n<information>Doc 1(Title: ...) ...</information>\\n\\n` (masked from the loss by the runner);
* anything else: Search-R1's "My previous action is invalid ..." message, and the episode goes on.

On the last turn no search is run (Search-R1's final `do_search=False` generation) and the episode
ends. The reward is 0 on every step but the final one, which scores Search-R1's exact match over
the whole text (prompt, actions, observations): the episode's summed reward is the EM.
"""

from __future__ import annotations

import re
from collections.abc import Callable

from rlrun.agents.api import AgentInstanceBase
from rlrun.agents.retriever_client import RetrieverClient
from rlrun.rewards.exact_match import compute_score_em, golden_answers

SEARCH_R1_STOP = ("</search>", "</answer>")

# Search-R1's wording, verbatim (its source joins the three sentences with line continuations).
INVALID_ACTION_FEEDBACK = (
    "\nMy previous action is invalid. "
    "If I want to search, I should put the query between <search> and </search>. "
    "If I want to give the final answer, I should put the answer between <answer> and </answer>. "
    "Let me try again.\n"
)

_ACTION = re.compile(r"<(search|answer)>(.*?)</\1>", re.DOTALL)


def search_r1_prompt(question: str) -> str:
    """Search-R1's training prompt (scripts/data_process/nq_search.py, template "base"), with its question
    clean-up: stripped, and a "?" appended when missing."""
    question = question.strip()
    if not question.endswith("?"):
        question += "?"
    return ("Answer the given question. "
            "You must conduct reasoning inside <think> and </think> first every time you get new information. "
            "After reasoning, if you find you lack some knowledge, you can call a search engine by <search> query "
            "</search> and it will return the top searched results between <information> and </information>. "
            "You can search as many times as your want. "
            "If you find no further external knowledge needed, you can directly provide the answer inside <answer> "
            "and </answer>, without detailed illustrations. For example, <answer> Beijing </answer>. "
            f"Question: {question}\n")


def cut_action(text: str) -> str:
    """Search-R1's `_postprocess_responses`: keep text up to the first `</search>` if there is one,
    else up to the first `</answer>`, else all of it."""
    for stop in SEARCH_R1_STOP:
        if stop in text:
            return text.split(stop)[0] + stop
    return text


def parse_action(text: str) -> tuple[str | None, str]:
    """Search-R1's `postprocess_predictions`: ("search" | "answer", stripped content) of the first tag pair,
    or (None, "")."""
    match = _ACTION.search(text)
    if match is None:
        return None, ""
    return match.group(1), match.group(2).strip()


def passages_to_string(hits: list[dict]) -> str:
    """Search-R1's `_passages2string`: `Doc i(Title: <first line>) <other lines>` and a newline, per hit."""
    out = ""
    for index, hit in enumerate(hits):
        lines = hit["document"]["contents"].split("\n")
        out += f"Doc {index + 1}(Title: {lines[0]}) " + "\n".join(lines[1:]) + "\n"
    return out


def information_block(hits: list[dict]) -> str:
    return f"\n\n<information>{passages_to_string(hits).strip()}</information>\n\n"


class SearchR1Agent(AgentInstanceBase):
    """One episode of Search-R1: search with `retriever`, answer, exact-match reward on the final step.

    extra_logs (every step, cumulative for the episode, as Search-R1's meta_info counters):
    searches (search actions, the last turn's unexecuted one included, = valid_search_stats),
    valid_actions, invalid_actions, answered (0/1), exact_match (0/1, set on the final step)."""

    def __init__(self, retriever: RetrieverClient) -> None:
        self.retriever = retriever
        self.counts = {"searches": 0.0, "valid_actions": 0.0, "invalid_actions": 0.0, "answered": 0.0,
                       "exact_match": 0.0}

    async def reset(self, states: dict, **kwargs: object) -> dict:
        label = states.get("label")
        if label is None:
            raise ValueError("the Search-R1 agent needs each prompt's golden answers as its label; set "
                             "--label_key to the field holding them (a string or a list of strings)")
        golden_answers(label)  # a malformed label fails here, before any generation is spent on it
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs: object) -> dict:
        action_text = cut_action(states["action_text"])
        last_turn = bool(states.get("last_turn", False))
        action, content = parse_action(action_text)
        feedback, done = "", False
        if action == "answer":
            self.counts["answered"] = 1.0
            done = True
        elif action == "search":
            self.counts["searches"] += 1
            if not last_turn:
                feedback = information_block(await self.retriever.search(content))
        else:
            feedback = INVALID_ACTION_FEEDBACK
        self.counts["valid_actions" if action else "invalid_actions"] += 1
        reward = 0.0
        if done or last_turn:
            done = True
            feedback = ""  # nothing follows the final turn
            reward = compute_score_em(states["observation_text"] + action_text, states["label"])
            self.counts["exact_match"] = float(reward == 1.0)
        return {"rewards": reward, "scores": reward, "environment_feedback": feedback, "done": done,
                "extra_logs": dict(self.counts)}


def search_r1_agent_factory(url: str, topk: int, timeout_s: float, retries: int) -> Callable[[], SearchR1Agent]:
    """Makes one SearchR1Agent per episode, all sharing one RetrieverClient (so one turn's searches
    go out as one POST). Bad settings raise ConfigError here, before any rollout."""
    client = RetrieverClient(url, topk, timeout_s=timeout_s, retries=retries)

    def make() -> SearchR1Agent:
        return SearchR1Agent(client)

    return make
