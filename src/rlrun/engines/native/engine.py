"""NativeEngine: rollout sampling with rlrun's own KV-cache decoder (rlrun.engines.native.decoder) on the engine's HF
model.

Behind the same surface as HFEngine (generate / sample / load_weights, a `model` that weight sync writes into), and
like vLLM it reports the log-probability of every sampled token and drops finished rows from the batch instead of
decoding padding until the longest row ends. Same seed, same prompts, same weights: same samples, whatever the
KV-cache budget (each row's draws are its own, rlrun.engines.native.draws; the global RNG is untouched).

Memory: the KV cache of a call's rows must fit a budget (`kv_cache_bytes`; by default on GPU what the memory free at
the call allows, on CPU unbounded). When it cannot hold every row at once, it holds as many as it can at the longest
prompt's width, and each row that finishes frees its place for the next prompt, prefilled there at the next look
(continuous batching, as vLLM and nano-vllm schedule; the cache is a ring of columns instead of pages, see _decode).
Only when MoE routing is recorded (R3) are the rows decoded in batches one after another, longest prompts first. The
results come back in the prompts' order.

CUDA graphs (`cuda_graph`, --native_cuda_graph): on a GPU each decode step can be captured once as a CUDA graph and
replayed per token, instead of launching its few hundred kernels one by one from Python (at small models and
batches a step is bound by those launches, not by the GPU). A graph needs static shapes, so that step writes its
keys/values at a position held in a device tensor, runs on a zeroed cache, and attends over a fixed span of the
cache under the mask rather than over the positions filled so far. The span is the filled length rounded up to a
multiple of `decode_bucket` positions (at most the capacity), with one graph captured per span as the rows grow, as
vLLM and nano-vllm capture one per batch-size bucket: a step then reads at most `decode_bucket` positions more
than it needs, instead of the whole capacity that the longest response will fill. Dropping finished rows changes
the batch, so it happens less often (GRAPH_COMPACT_FRACTION) and the spans are captured again after it. Sampling
stays outside the graph. The captured step gives the same logits, bit for bit, as that static step run without
capture (what `step_mode = "static"` runs, on any device); against the default step (attention over the filled
positions) its sums run over more (masked, zero) terms, so its logits may differ in the last bits.
"""

from __future__ import annotations

import itertools
import sys
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.data.vision_batch import RowVision
from rlrun.engines.native.decoder import Adapters, Decoder, KVCache
from rlrun.engines.native.draws import draw_tokens, uniform
from rlrun.engines.protocol import Generation, SamplingSettings, TorchEngine, cut_at_stop, refuse_images
from rlrun.engines.receivers import KeptAdapters
from rlrun.models.moe import NO_ROUTE
from rlrun.runtime.errors import ConfigError, NonFiniteError
from rlrun.runtime.log import get_logger

# ---- sampling ----------------------------------------------------------------------------------------------------
# Token sampling with the log-probability of each sampled token: HF's temperature and top-p warpers, then each row's
# own draw (rlrun.engines.native.draws: reproducible from a seed, whatever the batch, without the global RNG).


def processed_log_probs(logits: torch.Tensor, temperature: float, top_p: float) -> torch.Tensor:
    """logits [B, V] -> log-probabilities [B, V] of the sampling distribution: logits / temperature, then (top_p < 1)
    only the smallest set of tokens whose probability reaches top_p (HF's TopPLogitsWarper: sorted ascending, drop
    tokens whose cumulative probability is <= 1 - top_p, always keep the most likely one), renormalised.
    vLLM calls these the processed log-probs."""
    scores = logits.float() / temperature
    if top_p < 1.0:
        sorted_scores, order = torch.sort(scores, descending=False, dim=-1)
        cumulative = sorted_scores.softmax(dim=-1).cumsum(dim=-1)
        drop_sorted = cumulative <= (1 - top_p)
        drop_sorted[:, -1] = False
        drop = drop_sorted.scatter(1, order, drop_sorted)
        scores = scores.masked_fill(drop, float("-inf"))
    return torch.log_softmax(scores, dim=-1)


def sample(
    logits: torch.Tensor, temperature: float, top_p: float, draws: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [B, V], draws [B] in [0, 1) -> (tokens [B] long, their log-probabilities [B] fp32 under the processed
    distribution). Non-finite logits give a non-finite log-prob (see check_finite)."""
    log_probs = processed_log_probs(logits, temperature, top_p)
    tokens = draw_tokens(log_probs.exp(), draws)
    return tokens, log_probs.gather(1, tokens[:, None])[:, 0]


def check_finite(broken: torch.Tensor) -> None:
    """broken: a 0-d bool tensor, some sampled token's log-prob was not finite. Read on the host where the decode
    loop reads anyway (every SYNC_EVERY steps and at its end), so the check costs no extra sync."""
    if bool(broken):
        raise NonFiniteError(
            "the policy's next-token probabilities are NaN/inf: its weights are no longer finite "
            "(the run diverged; lower the learning rate, and resume from the last checkpoint)"
        )


# Finished rows stay in the batch until they are at least this fraction of it: dropping them copies the cache.
COMPACT_FRACTION = 0.125
# With a captured decode step dropping finished rows also means capturing the step again (a warm-up step and a
# capture, a few steps' time): only once at least half the rows finished, so at most log2(rows) captures a batch.
GRAPH_COMPACT_FRACTION = 0.5
# Steps between host reads of which rows finished (measured on an H200: reading every step cost 3 host syncs per
# token; with stop strings the host decodes text every step anyway).
SYNC_EVERY = 8
# Cache positions per span of the captured decode step (see the module docstring). Each span costs one capture, a
# warm-up step and a graph; 256 keeps that to 8 captures for a 2,048-token response, and a step attends over at most
# 255 positions more than it needs: at 256-token responses that is the whole response, at 2,048 an eighth of it.
DECODE_BUCKET = 256
# Bytes of the longest stop string's UTF-8 text that a token can span at most (a byte-level token is >= 1 byte).
_STOP_TAIL_SLACK = 4
# GPU default budget: the share of the memory free at a call that its batches may plan to fill (KV cache plus the
# activations that `peak_row_bytes` estimates). The other 10% is for what the estimate leaves out: the caching
# allocator's fragmentation (dropping finished rows frees cache blocks that later requests may not fit), workspaces
# that cuBLAS and attention kernels allocate on a shape's first use, and other processes on the GPU allocating
# meanwhile (a second engine, NCCL buffers).
GPU_FREE_FRACTION = 0.9
# Dropping finished rows (KVCache.keep) builds the kept keys of every layer before the old ones go: at most half the
# cache again while it copies.
_KEEP_EXTRA = 0.5
# fp32 [B, V] tensors a decode step holds at once: the logits, and sampling's temperature-scaled copy, top-p's
# sorted values, order (int64: two), probabilities, cumulative sums and mask, the log-softmax and its exp.
_LOGIT_COPIES = 10


class NativeEngine(TorchEngine):
    """Sampling with rlrun's decoder: left-padded prompts, stop at EOS (and at stop strings when given)."""

    def __init__(
        self,
        model: nn.Module,
        sampling: SamplingSettings,
        device: torch.device,
        tokenizer: PreTrainedTokenizerBase | None = None,
        *,
        kv_cache_bytes: int | None = None,
        cuda_graph: bool = False,
        decode_bucket: int = DECODE_BUCKET,
    ) -> None:
        """kv_cache_bytes: the KV cache budget of one call (--native_kv_cache_mb); None: on GPU derived at each call
        from the memory free then (GPU_FREE_FRACTION of it, less each row's activations), on CPU unbounded.
        cuda_graph: replay each decode step as a captured CUDA graph (--native_cuda_graph); on a device other than
        CUDA it says so once and decodes as without it. decode_bucket: cache positions per span of the captured
        step (the module docstring)."""
        super().__init__(model, sampling, device, tokenizer)
        if kv_cache_bytes is not None and kv_cache_bytes <= 0:
            raise ConfigError(f"NativeEngine: the KV cache budget must be > 0 bytes, got {kv_cache_bytes}")
        if decode_bucket <= 0:
            raise ConfigError(f"NativeEngine: decode_bucket must be > 0 cache positions, got {decode_bucket}")
        self.decode_bucket = decode_bucket
        self.decoder = Decoder(self.model)
        self.kv_cache_bytes = kv_cache_bytes
        # "eager": the default step (attention over the filled positions); "graph": the static-shape step captured
        # as a CUDA graph; "static": that same static step run without capture (the graph's reference; any device)
        self.step_mode = "eager"
        # HF's dynamic and longrope rotary embeddings read the positions on the host each forward: no capture
        rope = str(getattr(self.decoder.body.rotary_emb, "rope_type", "default"))
        blocker = (
            f"CUDA graphs need a CUDA device, not {self.device.type}"
            if self.device.type != "cuda"
            else f"rope type {rope!r} reads positions on the host"
            if "dynamic" in rope or "longrope" in rope
            else "the policy's MoE layers pick their experts' tokens on the host (torch's grouped matmul, which "
            "does not, needs bf16 experts)"
            if not self.decoder.experts_capturable()
            else None
        )
        if cuda_graph and blocker is None:
            self.step_mode = "graph"
        elif cuda_graph:
            rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
            get_logger(rank).info_once(f"--native_cuda_graph: {blocker}; the native engine decodes without a graph")
        self.last_batches = 0  # batches the last sample() call decoded one after another (tests, metrics)
        self.last_admitted = 0  # rows of the last call that started in a finished row's place (continuous batching)
        self.last_steps_built = 0  # static/graph mode: decode steps the last call built, one per batch+drop
        self.last_spans_built = 0  # static/graph mode: spans those steps ran (captured), one graph each

    def run_adapters(self, scaling: float) -> None:
        """A LoRA policy: keep the base weights this engine loaded and run the actor's adapters beside them (each
        weight sync then sends the adapters alone; rlrun.engines.receivers.KeptAdapters)."""

        def adopt(shapes: list[tuple[str, list[int]]]) -> nn.Module:
            self.decoder.adapters = Adapters(shapes, scaling, self.decoder.dtype, self.decoder.device)
            return self.decoder.adapters.module

        self.weights = KeptAdapters(adopt)

    @torch.no_grad()
    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,
    ) -> Generation:
        refuse_images(vision, "native")
        if stop and self.tokenizer is None:
            raise ValueError("NativeEngine needs its tokenizer for stop strings")
        _check_prompts(prompts)
        s = self.sampling
        new = s.max_new_tokens if max_new_tokens is None else max_new_tokens
        responses: list[list[int]] = [[] for _ in prompts]
        lps: list[list[float]] = [[] for _ in prompts]
        self.last_batches = self.last_steps_built = self.last_spans_built = self.last_admitted = 0
        if not prompts or new <= 0:
            return Generation(responses, lps)
        # Recording routing follows each batch row's tokens in order (R3): batches one after another. Else one decode
        # of every row, as many at once as the budget holds, a queued prompt taking each finished row's place.
        plan = (
            [(batch, None) for batch in self._batches(prompts, new)]
            if self.record_routing
            else [(list(range(len(prompts))), self._slots(prompts, new))]
        )
        self.last_batches = len(plan)
        routing: list[torch.Tensor] | None = [torch.empty(0)] * len(prompts) if self.record_routing else None
        with self._weights():
            for batch, slots in plan:
                routes: list[tuple[torch.Tensor, torch.Tensor]] | None = [] if routing is not None else None
                tokens, log_probs, lengths, _ = self._decode(
                    [prompts[i] for i in batch],
                    new,
                    seed,
                    stop,
                    slots=slots,
                    routes=routes,
                    indices=batch if keys is None else [keys[i] for i in batch],
                )
                for j, (i, row, lp, n) in enumerate(zip(batch, tokens.tolist(), log_probs.tolist(), lengths.tolist())):
                    kept = row[:n]
                    if stop:  # a row stops at the token that completes a stop string; cut exactly there
                        kept = cut_at_stop(kept, stop, self.tokenizer)  # type: ignore[arg-type]
                    responses[i], lps[i] = kept, lp[: len(kept)]
                    if routing is not None and routes:
                        prompt_routes, response_routes = routes[0]
                        width = prompt_routes.shape[1]
                        routing[i] = torch.cat(
                            [prompt_routes[j, width - len(prompts[i]) :], response_routes[j, : len(kept)]]
                        )
        return Generation(responses, lps, routing)

    @contextmanager
    def _weights(self) -> Iterator[None]:
        """The decoder's joined projections for one call (weight sync may have written or moved the weights since the
        last); says once when some had to be copied, a copy of most of the model's weights for the call."""
        with self.decoder.weights() as copied:
            if copied:
                rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
                get_logger(rank).info_once(
                    f"native engine: {copied} q/k/v or gate/up parameter groups do not lie back to back in memory; "
                    "each call joins them into a copy (weight sync lays them out back to back: see fused_groups)"
                )
            yield

    @torch.no_grad()
    def sample_until(
        self, prompts: list[list[int]], seed: int, limits: list[int], groups: list[int], need: int
    ) -> tuple[Generation, list[bool]]:
        """Decode rows of several groups (groups[i]: row i's group) until `need` groups have every row finished (EOS,
        or limits[i] new tokens), then stop: (the responses so far, which rows finished). --partial_rollout takes the
        finished groups and continues the others later, so a step does not wait for its longest response. Rows the
        KV budget cannot hold at once wait for a finished row's place; those that never started come back empty."""
        _check_prompts(prompts)
        new = max(limits)
        group_ids = torch.tensor(groups)
        size = torch.bincount(group_ids)

        def enough(finished: torch.Tensor) -> bool:
            complete = torch.bincount(group_ids, weights=finished.cpu().double(), minlength=len(size)) == size
            return int(complete.sum()) >= need

        self.last_admitted = 0
        with self._weights():
            tokens, log_probs, lengths, finished = self._decode(
                prompts, new, seed, (), slots=self._slots(prompts, new), limits=torch.tensor(limits), until=enough
            )
        ns = lengths.tolist()
        responses = [row[:n] for row, n in zip(tokens.tolist(), ns)]
        return Generation(responses, [lp[:n] for lp, n in zip(log_probs.tolist(), ns)]), finished.tolist()

    def kv_row_bytes(self, width: int, new: int) -> int:
        """KV-cache bytes of one row of a batch whose longest prompt has `width` tokens, with `new` new tokens: keys
        and values [K, width + new, D] in every layer (all that Decoder.new_cache allocates per row)."""
        d = self.decoder
        return len(d.blocks) * 2 * d.kv_heads * d.head_dim * d.dtype.itemsize * (width + new)

    def peak_row_bytes(self, width: int, new: int) -> int:
        """Estimated peak device bytes of one such row: its KV cache plus the larger of the prefill's activations and
        a decode step's (logits, sampling, one layer's fp32 attention scores and probabilities, their cast and the
        fp32 copy of its keys, and the copy that dropping finished rows makes).
        Prefill, per position: the residual, norm output and block output (3E), the MLP's gate/up and its two
        products (4I), the fused q/k/v and rotated q/k still referenced during the MLP (2 (H + 2K) D), the
        attention's output and its reshaped copy (2 H D), in the model's dtype; the fp32 rotary products (8 (H + K) D
        bytes); the row's [W, W] mask as bool plus SDPA's bias copy of it (3 W bytes). Measured on an H200
        (bench/gpu prefill_memory, Qwen2.5-0.5B bf16 at [16, 2048]): 51 KB a position outside the cache; this
        formula gives 67 KB."""
        d = self.decoder
        vocab, hidden = d.body.embed_tokens.weight.shape
        H, K, D, size = d.heads, d.kv_heads, d.head_dim, d.dtype.itemsize
        kv = self.kv_row_bytes(width, new)
        position = (
            size * (3 * hidden + 4 * d.intermediate + 2 * (H + 2 * K) * D + 2 * H * D) + 8 * (H + K) * D + 3 * width
        )
        step = 4 * _LOGIT_COPIES * vocab + ((8 + size) * H + 4 * K * D) * (width + new)
        return max(kv + width * position, int((1 + _KEEP_EXTRA) * kv) + step)

    def _rows_that_fit(self, new: int) -> tuple[Callable[[int], int], int | None]:
        """(rows the budget holds at a given longest-prompt width, the GPU memory the default budget takes, None when
        a --native_kv_cache_mb budget or the CPU's no budget applies)."""
        free = None
        if self.kv_cache_bytes is None and self.device.type == "cuda":
            free, _ = torch.cuda.mem_get_info(self.device)
            # blocks this process's caching allocator holds unused count as used for the driver, yet are ours to use
            free += torch.cuda.memory_reserved(self.device) - torch.cuda.memory_allocated(self.device)
            free = int(free * GPU_FREE_FRACTION)

        def rows_that_fit(width: int) -> int:
            if self.kv_cache_bytes is not None:
                return self.kv_cache_bytes // self.kv_row_bytes(width, new)
            return sys.maxsize if free is None else free // self.peak_row_bytes(width, new)

        return rows_that_fit, free

    def _slots(self, prompts: list[list[int]], new: int) -> int:
        """Rows decoded at once: as many as the budget holds at the longest prompt's width (every row when it holds
        them all, always on CPU without a budget)."""
        rows_that_fit, free = self._rows_that_fit(new)
        width = max(map(len, prompts))
        rows = rows_that_fit(width)
        if rows < 1:
            raise ConfigError(self._too_long(width, new, free))
        return min(rows, len(prompts))

    def _batches(self, prompts: list[list[int]], new: int) -> list[list[int]]:
        """Indices into `prompts`, one list per batch to decode one after another (recording routing: see sample).
        Every row in one batch, in the prompts' order, when the budget holds them all at the longest prompt's width;
        else longest prompts first (similar widths share a batch: less padding), each batch as many rows as the
        budget holds at the width of its own longest prompt."""
        rows_that_fit, free = self._rows_that_fit(new)
        if rows_that_fit(max(map(len, prompts))) >= len(prompts):
            return [list(range(len(prompts)))]
        order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))  # stable: ties keep the prompts' order
        batches: list[list[int]] = []
        while len(order) > 0:
            width = len(prompts[order[0]])
            rows = rows_that_fit(width)
            if rows < 1:
                raise ConfigError(self._too_long(width, new, free))
            batches.append(order[:rows])
            order = order[rows:]
        return batches

    def _too_long(self, width: int, new: int, free: int | None) -> str:
        """The message for a prompt of `width` tokens whose row alone does not fit the budget."""
        mib = 2**20
        kv = self.kv_row_bytes(width, new)
        row = (
            f"one row of a {width}-token prompt and {new} new tokens needs {kv} bytes ({kv / mib:.1f} MiB) of KV cache"
        )
        shorter = "or lower --prompt_max_len / --generate_max_len"
        if free is None:
            budget = self.kv_cache_bytes
            assert budget is not None  # without a budget free is None only on CPU, where every row fits
            return (
                f"NativeEngine: {row}, over the budget of {budget} bytes ({budget / mib:.1f} MiB, "
                f"--native_kv_cache_mb); raise --native_kv_cache_mb {shorter}"
            )
        peak = self.peak_row_bytes(width, new)
        return (
            f"NativeEngine: {row} and about {peak} bytes ({peak / mib:.1f} MiB) of GPU memory with its "
            f"activations, over the {free} bytes ({free / mib:.1f} MiB) the budget takes from the GPU memory free "
            f"now ({GPU_FREE_FRACTION:.0%} of it, no --native_kv_cache_mb given); free GPU memory (offload or "
            f"sleep the training models), set --native_kv_cache_mb, {shorter}"
        )

    def _decode(
        self,
        prompts: list[list[int]],
        new: int,
        seed: int,
        stop: tuple[str, ...],
        *,
        slots: int | None = None,
        limits: torch.Tensor | None = None,
        until: Callable[[torch.Tensor], bool] | None = None,
        routes: list[tuple[torch.Tensor, torch.Tensor]] | None = None,
        indices: list[int] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """The rows of `prompts`: (tokens [P, new], log-probs [P, new], lengths [P], finished [P] bool) on the CPU; row
        i's response is tokens[i, :lengths[i]]. Row i's k-th token is drawn from uniform(seed, indices[i], k)
        (indices: the prompts' places in the call, default 0..P-1), so no row's tokens depend on its neighbours.
        slots: rows decoded at once (None: all); the other prompts wait, and at each look at the finished rows (every
        SYNC_EVERY steps) the next ones are prefilled into the cache rows of finished ones, which they then continue
        beside the others (continuous batching). The cache is then a ring: every row writes the same column each
        step, a column that no live token of any row holds, since no row spans more than the capacity (its prompt
        plus `new`); keys are cached rotated, so attention does not care where in the ring they lie. limits [P]: each
        row's own cap on new tokens (at most `new`); until: called with the finished flags [P] where the loop looks at
        them, True stops the decode early (the running rows keep what they have, not finished; waiting ones come back
        empty). routes (slots None only): a list, to which the call appends the MoE routing it ran (the prompts'
        [P, W, layers, k] and the sampled tokens' [P, new, layers, k] uint8 on the CPU; rlrun.models.moe.NO_ROUTE for
        a token never fed back, the last of a row)."""
        s, dev = self.sampling, self.device
        total = len(prompts)
        slots = total if slots is None else min(slots, total)
        queue = deque(range(slots, total))
        width = max(len(p) for p in prompts)  # over every prompt: any of them may start in a finished row's place
        capacity = width + new
        ids, prompt_valid = _left_padded(prompts[:slots], width, s.pad_id, dev)
        valid = torch.zeros(slots, capacity, dtype=torch.bool, device=dev)
        valid[:, :width] = prompt_valid
        # recording routing reads each step's expert ids, which a captured (or static) step does not keep: eager; the
        # ring writes its column through the static step's slot
        static = (self.step_mode != "eager" and routes is None) or bool(queue)
        cache: KVCache = self.decoder.new_cache(slots, capacity, zeroed=static)
        self.decoder.routes = None if routes is None else []
        logits = self.decoder.prefill(ids, prompt_valid, cache)
        if routes is not None:
            prompt_routes = self.decoder.take_routes()
            response_routes = torch.full(
                (total, new, *prompt_routes.shape[2:]), NO_ROUTE, dtype=torch.uint8, device=dev
            )
        positions = torch.tensor([len(p) for p in prompts[:slots]], device=dev)
        # column `new`: where a finished row writes until it is dropped or replaced (its response is cut by `lengths`)
        out = torch.full((total, new + 1), s.pad_id, dtype=torch.long, device=dev)
        out_lp = torch.zeros(total, new + 1, dtype=torch.float32, device=dev)
        # rows that never started (until stopped first) have none; on the device, so a finished row costs no host sync
        lengths = torch.zeros((total,), dtype=torch.long, device=dev)
        active = torch.arange(slots, device=dev)  # the prompt of each batch row
        age = torch.zeros(slots, dtype=torch.long, device=dev)  # tokens each batch row has sampled
        done = torch.zeros(slots, dtype=torch.bool, device=dev)  # finished, not yet dropped or replaced
        ended = torch.zeros(total, dtype=torch.bool, device=dev)  # finished, by prompt
        caps = torch.full((total,), new, device=dev) if limits is None else limits.to(dev)
        places = torch.tensor(range(total) if indices is None else indices, device=dev)  # each prompt's draw key
        broken = torch.zeros((), dtype=torch.bool, device=dev)  # a non-finite log-prob sampled (check_finite)
        stop_bytes = max((len(x.encode()) for x in stop), default=0) + _STOP_TAIL_SLACK
        end_ids = torch.tensor(s.end_ids, device=dev)
        step: _StaticStep | None = None  # static mode: the step over this cache and these rows (None: build it)
        compact = GRAPH_COMPACT_FRACTION if static else COMPACT_FRACTION
        column, last_start = width, 0  # the next cache column (mod capacity); the step the latest rows started at
        for t in itertools.count():
            token, lp = sample(logits, s.temperature, s.top_p, uniform(seed, places[active], age))
            broken |= ~torch.isfinite(lp).all()
            at = torch.where(done, new, age)
            out[active, at], out_lp[active, at] = token, lp
            finished = torch.isin(token, end_ids) & ~done
            if stop:
                finished |= self._stop_hits(out, active, age, done, stop, stop_bytes)
            finished |= (caps[active] <= age + 1) & ~done
            lengths[active] = torch.where(done, lengths[active], age + 1)
            done |= finished
            ended[active] |= finished  # not ended[active[finished]]: a boolean index is a host sync every token
            if not queue and t >= last_start + new - 1:
                break  # every row reached its cap
            admit: list[int] = []
            # Reading `done` on the host stalls the GPU's queue: look every SYNC_EVERY steps (finished rows meanwhile
            # decode a few tokens past their end, cut off by `lengths`).
            if stop or (t + 1) % SYNC_EVERY == 0:  # `until` looks here too: the same draws as sample() until it stops
                check_finite(broken)
                running = int((~done).sum())
                if running == 0 and not queue:
                    break
                if until is not None and until(ended):
                    break
                if queue and running < len(active):
                    admit = done.nonzero()[:, 0].tolist()[: len(queue)]
                elif not queue and len(active) - running >= max(1, int(compact * len(active))):
                    keep = (~done).nonzero()[:, 0]
                    active, token, positions, valid = active[keep], token[keep], positions[keep], valid[keep]
                    done, age = done[keep], age[keep]
                    cache.keep(keep)
                    step = None  # new cache and mask tensors: a captured step would read the old ones
            slot = column % capacity
            valid[:, slot] = True
            if not static:
                logits = self.decoder.decode(token, positions, valid[:, : column + 1], cache)
                if routes is not None:  # a finished row's last token is fed on until the loop drops the row
                    fed = self.decoder.take_routes()[:, 0]
                    response_routes[active, t] = torch.where(done[:, None, None], NO_ROUTE, fed)
            else:
                if step is None:
                    step = _StaticStep(
                        self.decoder, cache, valid, capture=self.step_mode == "graph", bucket=self.decode_bucket
                    )
                    self.last_steps_built += 1
                spans = len(step.spans)
                logits = step(token, positions, slot, filled=min(capacity, column + 1))
                self.last_spans_built += len(step.spans) - spans
            positions, age, column = positions + 1, age + (~done).long(), column + 1
            if admit:
                starting = [queue.popleft() for _ in admit]
                self._admit(cache, valid, logits, [prompts[i] for i in starting], admit, column % capacity)
                where = torch.tensor(admit, device=dev)
                active[where] = torch.tensor(starting, device=dev)
                positions[where] = torch.tensor([len(prompts[i]) for i in starting], device=dev)
                age[where], done[where] = 0, False
                last_start = t + 1
                self.last_admitted += len(admit)
        check_finite(broken)
        if routes is not None:
            routes.append((prompt_routes.cpu(), response_routes.cpu()))
            self.decoder.routes = None
        return out[:, :new].cpu(), out_lp[:, :new].cpu(), lengths.cpu(), ended.cpu()

    def _admit(
        self,
        cache: KVCache,
        valid: torch.Tensor,
        logits: torch.Tensor,
        prompts: list[list[int]],
        rows: list[int],
        column: int,
    ) -> None:
        """Prefill `prompts` into cache rows `rows` (finished ones), each ending just before ring column `column`
        (the next one written): their keys/values, their mask, and their last-position logits in place of the
        finished rows' (the next draw samples their first tokens). Their prefill has a cache of its own, of the
        prompts' width: within the share of each row's estimate (peak_row_bytes) that dropping finished rows would
        take, as no row is dropped while prompts wait, when prompts are no longer than responses."""
        width = max(map(len, prompts))
        ids, prompt_valid = _left_padded(prompts, width, self.sampling.pad_id, valid.device)
        scratch = self.decoder.new_cache(len(prompts), width)
        first = self.decoder.prefill(ids, prompt_valid, scratch)
        where = torch.tensor(rows, device=valid.device)[:, None]
        columns = (torch.arange(column - width, column, device=valid.device) % valid.shape[1])[None, :]
        for keys, values, new_keys, new_values in zip(cache.keys, cache.values, scratch.keys, scratch.values):
            keys[where, :, columns] = new_keys.transpose(1, 2)  # [rows, width, K, D]: indexed dimensions go first
            values[where, :, columns] = new_values.transpose(1, 2)
        valid[where[:, 0]] = False
        valid[where, columns] = prompt_valid
        logits[where[:, 0]] = first

    def _stop_hits(
        self,
        out: torch.Tensor,
        active: torch.Tensor,
        age: torch.Tensor,
        done: torch.Tensor,
        stop: tuple[str, ...],
        tail_tokens: int,
    ) -> torch.Tensor:
        """[B] bool: the running rows whose last tokens (up to each row's `age`) now contain a stop string."""
        back = torch.arange(tail_tokens - 1, -1, -1, device=out.device)
        tails = out[active[:, None], (age[:, None] - back).clamp(min=0)].tolist()  # [B, tail], oldest first
        running, ages = (~done).tolist(), age.tolist()
        tokenizer = self.tokenizer
        assert tokenizer is not None  # sample() refuses stop strings without one

        def hit(i: int, row: list[int]) -> bool:  # the row's last min(tail, age + 1) tokens
            text = tokenizer.decode(row[max(0, tail_tokens - ages[i] - 1) :], skip_special_tokens=False)
            return any(x in text for x in stop)

        hits = [running[i] and hit(i, row) for i, row in enumerate(tails)]
        return torch.tensor(hits, dtype=torch.bool, device=out.device)


def _left_padded(
    prompts: list[list[int]], width: int, pad_id: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """(ids [B, width] long, valid [B, width] bool): the prompts right-aligned, pad_id before them."""
    ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
    valid = torch.zeros(len(prompts), width, dtype=torch.bool)
    for i, p in enumerate(prompts):
        ids[i, width - len(p) :] = torch.tensor(p)
        valid[i, width - len(p) :] = True
    return ids.to(device), valid.to(device)


def _check_prompts(prompts: list[list[int]]) -> None:
    if any(len(p) == 0 for p in prompts):
        raise ValueError("NativeEngine got an empty prompt; every prompt needs at least one token")


class _StaticStep:
    """One decode step of fixed shapes over a zeroed cache and its [B, C] mask `valid` (both the caller's, updated
    in place between steps): the token and position of each row and the cache position to write are copied into
    buffers of its own, so the step reads the same addresses every time. It attends over the first `span` cache
    positions, the written ones rounded up to a multiple of `bucket` (at most C), one graph per span reached.
    capture: each span is captured as a CUDA graph on its first call (after a warm-up run of the same step: its
    writes are the ones the replay repeats) and replayed after; else each call runs it eagerly (the same kernels:
    the graph's reference)."""

    def __init__(self, decoder: Decoder, cache: KVCache, valid: torch.Tensor, *, capture: bool, bucket: int) -> None:
        rows, device = valid.shape[0], valid.device
        self.decoder, self.cache, self.valid, self.capture, self.bucket = decoder, cache, valid, capture, bucket
        self.tokens = torch.zeros(rows, dtype=torch.long, device=device)
        self.positions = torch.zeros(rows, dtype=torch.long, device=device)
        self.slot = torch.zeros(1, dtype=torch.long, device=device)
        self.spans: dict[int, torch.cuda.CUDAGraph | None] = {}  # span -> its graph (None: run eagerly)
        # Every span's graph writes its logits here, so that the graphs share one memory pool and no span keeps an
        # output of its own ([B, V] fp32 each: 155 MB at 256 rows and Qwen's 151,936-token vocabulary).
        self.logits: torch.Tensor | None = None
        self.pool = torch.cuda.graph_pool_handle() if capture else None

    def _run(self, span: int) -> torch.Tensor:
        """The step attending over cache positions [0, span): valid[:, :span] is a view, so in-place updates of the
        caller's mask reach a captured graph."""
        return self.decoder.decode(self.tokens, self.positions, self.valid[:, :span], self.cache, slot=self.slot)

    def __call__(self, tokens: torch.Tensor, positions: torch.Tensor, slot: int, filled: int) -> torch.Tensor:
        """logits [B, V] of the step that writes cache position `slot` (valid[:, slot] must already be True), with
        the first `filled` positions written (slot + 1 until a ring wraps, then all). The returned tensor is
        rewritten by the next call."""
        self.tokens.copy_(tokens)
        self.positions.copy_(positions)
        self.slot.fill_(slot)
        span = min(self.valid.shape[1], -(-filled // self.bucket) * self.bucket)
        if not self.capture:
            self.spans.setdefault(span, None)
            return self._run(span)
        graph = self.spans.get(span)
        if graph is None:
            device = self.valid.device
            side = torch.cuda.Stream(device)
            side.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(side):
                warm = self._run(span)  # warm-up outside capture (lazy cuBLAS state); the replay repeats its writes
            torch.cuda.current_stream(device).wait_stream(side)
            if self.logits is None:
                self.logits = torch.empty_like(warm)
            del warm
            graph = torch.cuda.CUDAGraph()
            # spans only grow until the step is rebuilt, so the graphs replay in the order they were captured and
            # never at once: sharing one pool is safe, and each graph's scratch is the pool's, not its own
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):  # other threads use CUDA
                self.logits.copy_(self._run(span))
            self.spans[span] = graph
        graph.replay()
        return self.logits  # type: ignore[return-value]
