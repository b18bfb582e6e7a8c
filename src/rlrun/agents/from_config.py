"""The run's episode runner from its config: an OpenRLHF agent file, or the built-in Search-R1 agent."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase

from rlrun.agents.calls import AgentCalls
from rlrun.agents.episodes import EpisodeRunner, TurnLimits
from rlrun.agents.loader import load_agent_file
from rlrun.config.schema import Config


def build_episode_runner(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> EpisodeRunner:
    a = cfg.agent
    if a.agent_func_path is not None:
        # OpenRLHF's turns end at EOS or the token cap; an agent file has no stop strings.
        factory, stop, source = load_agent_file(a.agent_func_path), (), a.agent_func_path
    else:
        from rlrun.agents.search_r1 import SEARCH_R1_STOP, search_r1_agent_factory  # noqa: PLC0415

        assert a.retriever_url is not None
        factory = search_r1_agent_factory(a.retriever_url, a.retriever_topk, a.retriever_timeout,
                                          cfg.model.remote_rm_retries)
        stop, source = SEARCH_R1_STOP, "search_r1"
    limits = TurnLimits(response_budget=cfg.generation.generate_max_len, prompt_max_len=cfg.generation.prompt_max_len,
                        max_turns=a.max_turns, max_tokens_per_turn=a.max_tokens_per_turn, max_obs_len=a.max_obs_len,
                        state_masking=a.state_masking, stop=stop)
    calls = AgentCalls(timeout_s=a.agent_timeout, max_concurrency=a.agent_max_concurrency, source=source)
    return EpisodeRunner(factory, tokenizer, limits, calls)
