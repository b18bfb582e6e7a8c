"""Multi-turn agent rollouts: an environment answers each model turn; its tokens are masked from the loss.

The agent API users subclass (api, re-exported here), loading an agent file (loader, calls), running episodes
on an engine (episodes), and the built-in Search-R1 agent with its retriever client (search_r1; its exact-match
reward is rlrun.rewards.rules). May import engines/, rewards/, serving/, data/, config/ and runtime/.
"""

from rlrun.agents.api import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor"]
