"""A two-turn environment the embedded tiny model can learn on CPU, written as an OpenRLHF agent file.

The file is what an OpenRLHF user writes (same import, same classes); rlrun runs it unchanged:

    python -m rlrun.ppo --config configs/multiturn_demo.yaml   # uses --agent_func_path examples/multiturn_agent.py

Turn 1 answers the prompt ("Write some digits:" asks for digits). The environment then replies with an
instruction for turn 2 that asks for the OTHER kind ("\\nNow letters:"), so turn 2 is only rewarded when
the model follows the observation rather than the prompt. Each turn earns half of its fraction of
characters of the right kind; the episode's reward is the sum (0..1).
"""

import string
from typing import Any, Dict

import torch
from openrlhf.utils.agent import AgentInstanceBase, MultiTurnAgentExecutor

KINDS = {"digits": set(string.digits), "letters": set(string.ascii_lowercase)}
OTHER = {"digits": "letters", "letters": "digits"}


def fraction(text: str, kind: str) -> float:
    chars = [c for c in text if not c.isspace()]
    return sum(c in KINDS[kind] for c in chars) / len(chars) if chars else 0.0


class AgentInstance(AgentInstanceBase):
    def __init__(self, *args, **kwargs):
        self.turn = 0
        self.turn_rewards = {}

    async def reset(self, states: dict, **kwargs):
        return {"observation": states["observation"]}

    async def step(self, states: dict, **kwargs) -> Dict[str, Any]:
        kind = states["label"] if self.turn == 0 else OTHER[states["label"]]
        reward = 0.5 * fraction(states["action_text"], kind)
        self.turn += 1
        self.turn_rewards[f"turn{self.turn}_reward"] = reward
        done = self.turn == 2
        return {
            "rewards": torch.tensor(reward),
            "scores": torch.tensor(reward),
            "environment_feedback": "" if done else f"\nNow {OTHER[states['label']]}:",
            "done": done,
            "sampling_params": states.get("sampling_params", None),
            "extra_logs": dict(self.turn_rewards),
        }


class AgentExecutor(MultiTurnAgentExecutor):
    def __init__(self):
        super().__init__(AgentInstance)
