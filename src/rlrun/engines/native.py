"""NativeEngine: rollout sampling with rlrun's own KV-cache decoder (rlrun.engines.decoder) on the engine's HF model.

Behind the same surface as HFEngine (generate / sample / load_weights, a `model` that weight sync writes into), and
like vLLM it reports the log-probability of every sampled token and drops finished rows from the batch instead of
decoding padding until the longest row ends. Same seed, same prompts, same weights: same samples (a generator of
its own, seeded per call; the global RNG is untouched).
"""

from __future__ import annotations

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.engines.base import Generation, TorchEngine, SamplingSettings
from rlrun.engines.decoder import Decoder, KVCache
from rlrun.engines.sampling import sample
from rlrun.engines.stops import cut_at_stop

# Finished rows stay in the batch until they are at least this fraction of it: dropping them copies the cache.
COMPACT_FRACTION = 0.125
# Steps between host reads of which rows finished (measured on an H200: reading every step cost 3 host syncs per
# token; with stop strings the host decodes text every step anyway).
SYNC_EVERY = 8
# Bytes of the longest stop string's UTF-8 text that a token can span at most (a byte-level token is >= 1 byte).
_STOP_TAIL_SLACK = 4


class NativeEngine(TorchEngine):
    """Sampling with rlrun's decoder: left-padded prompts, stop at EOS (and at stop strings when given)."""

    def __init__(self, model: nn.Module, sampling: SamplingSettings, device: torch.device,
                 tokenizer: PreTrainedTokenizerBase | None = None) -> None:
        super().__init__(model, sampling, device, tokenizer)
        self.decoder = Decoder(self.model)

    def load_weights(self) -> None:
        """Weight sync wrote into `model`: re-read the decoder's fused projections from it."""
        self.decoder.refresh()

    @torch.no_grad()
    def sample(self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None,
               stop: tuple[str, ...] = ()) -> Generation:
        if stop and self.tokenizer is None:
            raise ValueError("NativeEngine needs its tokenizer for stop strings")
        if any(len(p) == 0 for p in prompts):
            raise ValueError("NativeEngine got an empty prompt; every prompt needs at least one token")
        s = self.sampling
        new = s.max_new_tokens if max_new_tokens is None else max_new_tokens
        if not prompts or new <= 0:
            return Generation([[] for _ in prompts], [[] for _ in prompts])
        tokens, log_probs, lengths = self._decode(prompts, new, seed, stop)
        responses, lps = [], []
        for row, lp, n in zip(tokens.tolist(), log_probs.tolist(), lengths.tolist()):
            kept = row[:n]
            if stop:  # a row stops at the token that completes a stop string; cut exactly there
                kept = cut_at_stop(kept, stop, self.tokenizer)  # type: ignore[arg-type]
            responses.append(kept)
            lps.append(lp[:len(kept)])
        return Generation(responses, lps)

    def _decode(self, prompts: list[list[int]], new: int, seed: int,
                stop: tuple[str, ...]) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(tokens [B, new], log-probs [B, new], lengths [B]) on the CPU; row i's response is tokens[i, :lengths[i]]."""
        s, dev = self.sampling, self.device
        rows, width = len(prompts), max(len(p) for p in prompts)
        ids = torch.full((rows, width), s.pad_id, dtype=torch.long)
        valid = torch.zeros(rows, width + new, dtype=torch.bool)
        for i, p in enumerate(prompts):
            ids[i, width - len(p):] = torch.tensor(p)
            valid[i, width - len(p):width] = True
        ids, valid = ids.to(dev), valid.to(dev)
        cache: KVCache = self.decoder.new_cache(rows, width + new)
        logits = self.decoder.prefill(ids, valid[:, :width], cache)
        positions = torch.tensor([len(p) for p in prompts], device=dev)
        generator = torch.Generator(device=dev).manual_seed(seed)
        out = torch.full((rows, new), s.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(rows, new, dtype=torch.float32, device=dev)
        # rows still running at the end used every step; on the device, so a finished row costs no host sync
        lengths = torch.full((rows,), new, dtype=torch.long, device=dev)
        active = torch.arange(rows, device=dev)  # the original row of each batch row
        done = torch.zeros(rows, dtype=torch.bool, device=dev)  # finished, not yet dropped
        stop_bytes = max((len(x.encode()) for x in stop), default=0) + _STOP_TAIL_SLACK
        for t in range(new):
            token, lp = sample(logits, s.temperature, s.top_p, generator)
            out[active, t], out_lp[active, t] = token, lp
            finished = (token == s.eos_id) & ~done
            if stop:
                finished |= self._stop_hits(out, active, done, t, stop, stop_bytes)
            lengths[active] = torch.where(finished, t + 1, lengths[active])
            done |= finished
            if t == new - 1:
                break
            # Reading `done` on the host stalls the GPU's queue: look every SYNC_EVERY steps (finished rows meanwhile
            # decode a few tokens past their end, cut off by `lengths`).
            if stop or (t + 1) % SYNC_EVERY == 0:
                running = int((~done).sum())
                if running == 0:
                    break
                if len(active) - running >= max(1, int(COMPACT_FRACTION * len(active))):
                    keep = (~done).nonzero()[:, 0]
                    active, token, positions, valid = active[keep], token[keep], positions[keep], valid[keep]
                    done = done[keep]
                    cache.keep(keep)
            valid[:, width + t] = True
            logits = self.decoder.decode(token, positions, valid[:, :width + t + 1], cache)
            positions = positions + 1
        return out.cpu(), out_lp.cpu(), lengths.cpu()

    def _stop_hits(self, out: torch.Tensor, active: torch.Tensor, done: torch.Tensor, t: int,
                   stop: tuple[str, ...], tail_tokens: int) -> torch.Tensor:
        """[B] bool: the running rows whose last tokens (up to step t) now contain a stop string."""
        tail = out[active, max(0, t + 1 - tail_tokens):t + 1].tolist()
        running = (~done).tolist()
        hits = [running[i] and any(x in self.tokenizer.decode(row, skip_special_tokens=False) for x in stop)  # type: ignore[union-attr]
                for i, row in enumerate(tail)]
        return torch.tensor(hits, dtype=torch.bool, device=out.device)
