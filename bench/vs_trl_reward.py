"""The rlrun-vs-TRL benchmark's reward: the fraction of lowercase ASCII letters in the completion.

One scoring rule, two calling conventions, so both trainers score exactly the same way:
  reward_func(queries, prompts, labels)        rlrun's --remote_rm_url file (OpenRLHF's convention;
                                                queries[i] = prompts[i] + the decoded response)
  trl_reward(prompts, completions, **kwargs)   TRL's reward_funcs signature
Standard library only: it is imported by rlrun's venv and by the TRL venv alike.
"""

from __future__ import annotations

import string

LOWERCASE = frozenset(string.ascii_lowercase)


def lowercase_fraction(completion: str) -> float:
    """Share of characters of `completion` that are a-z; 0.0 for an empty completion."""
    if not completion:
        return 0.0
    return sum(char in LOWERCASE for char in completion) / len(completion)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> list[float]:
    """rlrun: score the response part of each query (the prompt is its prefix)."""
    rewards = []
    for index, (query, prompt) in enumerate(zip(queries, prompts, strict=True)):
        if not query.startswith(prompt):
            raise ValueError(f"queries[{index}] does not start with prompts[{index}] ({prompt[:40]!r})")
        rewards.append(lowercase_fraction(query[len(prompt):]))
    return rewards


def trl_reward(prompts: list[str], completions: list[str], **kwargs: object) -> list[float]:
    """TRL: completions arrive already split from the prompts (plain-text dataset)."""
    return [lowercase_fraction(completion) for completion in completions]
