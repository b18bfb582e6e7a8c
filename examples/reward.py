"""Example reward function (OpenRLHF's `--remote_rm_url file.py` convention).

1.0 when the response contains the label (the correct sum), plus a small bonus for answering
with digits at all, so a tiny model gets a learning signal before it is ever right.
"""

import torch


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    rewards = []
    for query, prompt, label in zip(queries, prompts, labels):
        response = query[len(prompt):]
        digits = sum(ch.isdigit() for ch in response) / max(len(response), 1)
        rewards.append((1.0 if label in response else 0.0) + 0.1 * digits)
    values = torch.tensor(rewards)
    return {"rewards": values, "scores": values, "extra_logs": {"correct": (values >= 1.0).float()}}
