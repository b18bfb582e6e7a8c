"""Rule reward for the built-in demo task, in OpenRLHF's remote_rm_url python-file convention.

The task (see rlrun.models.tiny.BUILTIN_PROMPTS): label "digits" asks for digits, label "letters"
for lowercase ASCII letters. The reward is the fraction of response characters in the
label's target set, so every response gets a graded score and the signal is dense.

Random baseline: a random-init byte model samples tokens almost uniformly, so about 10/256
of its bytes are digits and 26/256 lowercase letters (bytes >= 0x80 mostly decode to
U+FFFD, one character per invalid byte, which keeps the per-character rate close to the
per-byte rate). Expected reward ~0.04 for "digits", ~0.10 for "letters", ~0.07 averaged
over the balanced built-in set; tests/models/test_tiny.py measures it on the real tiny model.
"""

from __future__ import annotations

import string

import torch

from rlrun.runtime.errors import RewardError

TARGET_CHARS: dict[str, frozenset[str]] = {
    "digits": frozenset(string.digits),
    "letters": frozenset(string.ascii_lowercase),
}
# Queries may be decoded with skip_special_tokens=False; special-token text is framing,
# not something the policy wrote, so it neither helps nor hurts the score.
_SPECIAL_STRINGS: tuple[str, ...] = ("<|pad|>", "<|bos|>", "<|eos|>")


def _strip_specials(text: str) -> str:
    for special in _SPECIAL_STRINGS:
        text = text.replace(special, "")
    return text


def _response_of(query: str, prompt: str, index: int) -> str:
    query, prompt = _strip_specials(query), _strip_specials(prompt)
    if not query.startswith(prompt):
        raise RewardError(
            f"queries[{index}] does not start with prompts[{index}] ({prompt[:60]!r}); "
            "pass the full prompt+response text as the query and the exact prompt text as the prompt."
        )
    return query[len(prompt) :]


def target_fraction(response: str, label: str) -> float:
    """Fraction of characters of `response` in the target set of `label`; 0.0 when empty."""
    if label not in TARGET_CHARS:
        raise RewardError(f"Unknown demo label {label!r}; expected one of {sorted(TARGET_CHARS)}.")
    if not response:
        return 0.0
    targets = TARGET_CHARS[label]
    return sum(char in targets for char in response) / len(response)


def reward_func(queries: list[str], prompts: list[str], labels: list[str]) -> dict:
    """Score each query (prompt + response text) in [0, 1] by its label's rule."""
    if not len(queries) == len(prompts) == len(labels):
        raise RewardError(
            f"reward_func got {len(queries)} queries, {len(prompts)} prompts and {len(labels)} labels; "
            "they must have the same length (one prompt and label per query)."
        )
    responses = [_response_of(q, p, i) for i, (q, p) in enumerate(zip(queries, prompts))]
    rewards = torch.tensor([target_fraction(r, label) for r, label in zip(responses, labels)], dtype=torch.float32)
    return {
        "rewards": rewards,
        "scores": rewards,
        "extra_logs": {
            "response_chars": torch.tensor([len(r) for r in responses], dtype=torch.float32),
            "empty_response": torch.tensor([float(not r) for r in responses]),
        },
    }
