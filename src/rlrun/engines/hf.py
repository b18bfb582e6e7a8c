"""The `hf` backend: sampling with transformers' `generate`, for any model transformers runs (the fallback when the
native decoder cannot run the policy, and the vision-language policies' non-vLLM engine)."""

from __future__ import annotations

from contextlib import AbstractContextManager, nullcontext

import torch

from rlrun.data.vision_batch import RowVision
from rlrun.engines.protocol import Generation, TorchEngine, cut_at_stop
from rlrun.models.moe import engine_routing, recorded_calls
from rlrun.vision.inputs import generate_inputs


class HFEngine(TorchEngine):
    """Sampling with transformers `generate`: left-padded prompts, stop at EOS."""

    @torch.no_grad()
    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,  # generate draws from the global generator: batch-dependent, keys or not
    ) -> Generation:
        s = self.sampling
        stop_kwargs: dict = {}
        if stop:
            if self.tokenizer is None:
                raise ValueError("HFEngine needs its tokenizer for stop strings")
            stop_kwargs = {"stop_strings": list(stop), "tokenizer": self.tokenizer}
        width = max(len(p) for p in prompts)
        ids = torch.full((len(prompts), width), s.pad_id, dtype=torch.long)
        mask = torch.zeros_like(ids)
        for i, p in enumerate(prompts):
            ids[i, width - len(p) :] = torch.tensor(p)
            mask[i, width - len(p) :] = 1
        images = {} if vision is None else generate_inputs(self.model, ids.to(self.device), vision)
        # Sampling draws from the global RNG; a seed per (step, rank) makes rollouts reproducible
        # and resumable without saving generator state.
        record: AbstractContextManager[list[torch.Tensor]] = (
            recorded_calls(self.model) if self.record_routing else nullcontext([])
        )
        with record as calls, torch.random.fork_rng(devices=[self.device] if self.device.type == "cuda" else []):
            torch.manual_seed(seed)
            out = self.model.generate(  # type: ignore[operator]  # an HF model's method
                input_ids=ids.to(self.device),
                attention_mask=mask.to(self.device),
                do_sample=True,
                temperature=s.temperature,
                top_p=s.top_p,
                top_k=0,
                max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
                pad_token_id=s.pad_id,
                eos_token_id=list(s.end_ids),
                **stop_kwargs,
                **images,
            )
        responses = []
        for row in out[:, width:].tolist():
            end = next((i for i, token in enumerate(row) if token in s.end_ids), None)
            if end is not None:
                row = row[: end + 1]
            if stop:  # generate stops a row after its stop string but pads it; cut exactly there
                row = cut_at_stop(row, stop, self.tokenizer)  # type: ignore[arg-type]
            responses.append(row)
        if not self.record_routing:
            return Generation(responses)
        lens = [len(p) for p in prompts], [len(r) for r in responses]
        return Generation(responses, routing=engine_routing(calls, len(prompts), *lens))
