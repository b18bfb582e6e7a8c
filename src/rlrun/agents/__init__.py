"""Multi-turn agent rollouts: an environment answers each model turn; its tokens are masked from the loss."""

from rlrun.agents.api import AgentExecutorBase, AgentInstanceBase, MultiTurnAgentExecutor

__all__ = ["AgentExecutorBase", "AgentInstanceBase", "MultiTurnAgentExecutor"]
