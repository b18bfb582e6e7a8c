"""The critic section (rlrun.ppo, GAE): where the value model starts, how it learns, whether it is exported
(rlrun.roles.critic)."""

from __future__ import annotations

from dataclasses import dataclass

from rlrun.config.fields import non_negative, opt, positive


@dataclass
class CriticConfig:
    """The critic (value model)."""

    critic_pretrain: str | None = opt(None, "Critic initialisation. Unset: the reward model, else the policy.")
    critic_learning_rate: float = opt(9e-6, "Critic learning rate.")
    value_clip: float | None = opt(0.5, "Value clip range (unset: no clipping).")
    save_value_network: bool = opt(False, "Also save the critic in HF format.")

    def check(self) -> None:
        non_negative("critic_learning_rate", self.critic_learning_rate)
        positive("value_clip", self.value_clip, allow_none=True)
