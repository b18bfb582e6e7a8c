"""Where a turn ends: the first token that completes a stop string (that token kept)."""

from __future__ import annotations

from transformers import PreTrainedTokenizerBase


def cut_at_stop(tokens: list[int], stop: tuple[str, ...], tokenizer: PreTrainedTokenizerBase) -> list[int]:
    """tokens[:k] for the smallest k whose text contains a stop string; all of tokens when none does.

    Token-level, never re-tokenised: the kept ids are exactly the sampled ones, so the actor's log-probs
    stay those of the engine's samples. (Search-R1 cuts the decoded text and re-tokenises it, which can
    change the ids; rlrun does not.) Binary search: containing a stop string is monotone in k."""
    if not stop or not tokens:
        return tokens

    def contains(k: int) -> bool:
        text = tokenizer.decode(tokens[:k], skip_special_tokens=False)
        return any(s in text for s in stop)

    if not contains(len(tokens)):
        return tokens
    lo, hi = 1, len(tokens)  # invariant: contains(hi)
    while lo < hi:
        mid = (lo + hi) // 2
        if contains(mid):
            hi = mid
        else:
            lo = mid + 1
    return tokens[:hi]
