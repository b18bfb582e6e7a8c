"""Sampling for the SDK's sample calls on the engine every rank holds beside its share of the trained model: the rows
of a call are dealt to the ranks in contiguous shares, each rank samples its share in one engine call, and rank 0
gathers them. Each row's draws are a function of (seed, its key) (the native engine's), so the same request samples
the same tokens on 1 rank or many."""

from __future__ import annotations

from dataclasses import replace

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.engines.protocol import Engine, SamplingSettings
from rlrun.launch.transfer import gather_json
from rlrun.tinker.calls import Sample, SampleParams
from rlrun.tinker.policy import share
from rlrun.tinker.wire import Sampled


class Sampler:
    """This rank's engine, the settings it was built with, and the group the rows are dealt over. Collective."""

    def __init__(
        self,
        engine: Engine,
        tokenizer: PreTrainedTokenizerBase,
        group: torch.distributed.ProcessGroup,
        comm_device: torch.device,
        seed: int,
    ) -> None:
        self.engine, self.tokenizer, self.seed = engine, tokenizer, seed
        self.settings: SamplingSettings = engine.sampling
        self.group, self.comm_device = group, comm_device
        self.rank, self.world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)

    def sample(self, call: Sample) -> list[Sampled] | None:
        """Every row's sequence, in the call's order, on rank 0 (None elsewhere)."""
        p = call.params
        end_ids = self.settings.end_ids if p.stop_tokens is None else p.stop_tokens
        mine = share(len(call.prompts), self.world, self.rank)
        rows: list[dict[str, object]] = []
        if len(mine):
            self.engine.sampling = replace(
                self.settings, temperature=p.temperature, top_p=p.top_p, max_new_tokens=p.max_tokens, end_ids=end_ids
            )
            try:
                out = self.engine.sample(
                    [call.prompts[i] for i in mine],
                    self.seed,
                    max_new_tokens=p.max_tokens,
                    stop=p.stop_strings,
                    keys=[call.keys[i] for i in mine],
                )
            finally:
                self.engine.sampling = self.settings
            for k, tokens in enumerate(out.responses):
                log_probs = out.log_probs[k] if out.log_probs is not None else []
                rows.append({"tokens": tokens, "log_probs": log_probs, "stopped": self._stopped(tokens, p, end_ids)})
        gathered = gather_json(rows, self.group, self.comm_device)
        if gathered is None:
            return None
        return [Sampled(r["tokens"], r["log_probs"], r["stopped"]) for part in gathered for r in part]

    def _stopped(self, tokens: list[int], p: SampleParams, end_ids: tuple[int, ...]) -> bool:
        """Whether a row ended at a stop (an end id, or a stop string completed by its last token) rather than at
        max_tokens."""
        if len(tokens) < p.max_tokens or (tokens and tokens[-1] in end_ids):
            return True
        text = self.tokenizer.decode(tokens, skip_special_tokens=False) if p.stop_strings else ""
        return any(s in text for s in p.stop_strings)
