"""OpenRLHF's agent classes under their own names, so an OpenRLHF agent file runs unchanged.

An agent file defines `AgentInstance(AgentInstanceBase)` (one instance per episode) and, as in
OpenRLHF, usually `AgentExecutor(MultiTurnAgentExecutor)` binding it. rlrun drives the turns itself
(rlrun.agents.episodes): it uses the instance class and never calls an executor's `execute`.

The contract (OpenRLHF 0.11, openrlhf/utils/agent.py):

* ``await instance.reset({"observation": prompt_text, "label": label})`` returns a dict whose
  "observation" is the text the first turn continues (usually the prompt unchanged).
* ``await instance.step(states)`` after every model turn, with states = {"observation_text": all
  text so far before this turn, "action_text": this turn's generated text, "label": label,
  "sampling_params": the turn's sampling settings} plus rlrun's "turn" (0-based) and "last_turn"
  (no further turn will be generated). It returns {"rewards": number or 0-d tensor, "scores":
  optional, "environment_feedback": text appended after the action (masked from the loss),
  "done": bool, "extra_logs": optional {name: number}}.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any


class AgentInstanceBase(ABC):
    @abstractmethod
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass

    async def reset(self, states: dict, **kwargs: Any) -> dict:
        return states

    @abstractmethod
    async def step(self, states: dict, **kwargs: Any) -> dict:
        raise NotImplementedError


class AgentExecutorBase(ABC):  # noqa: B024 - OpenRLHF's name and base; nothing to implement
    """OpenRLHF's executor base. rlrun accepts only executors that bind an instance class
    (MultiTurnAgentExecutor); a custom `execute` that drives the engine itself is not supported."""


class MultiTurnAgentExecutor(AgentExecutorBase):
    def __init__(self, agent_instance_cls: type[AgentInstanceBase]) -> None:
        self.agent_instance_cls = agent_instance_cls
