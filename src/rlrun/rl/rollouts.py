"""Rollouts from the engine ranks to every rank: an engine rank produces its share of a step (sampling,
or agent episodes, and the reward function), then one exchange gathers the whole batch everywhere.

Split in two so that --async_train can produce step N+1 while the learners train on step N and exchange
it at the step boundary. Tensors cross ranks only through rlrun.launch.transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field, fields
from typing import cast

import torch

from rlrun.agents.episodes import mean_stats
from rlrun.config.generation import GenerationConfig
from rlrun.config.training import TrainConfig
from rlrun.data.batching import derive_seed, shard
from rlrun.data.prompts import Prompts, PromptSampler
from rlrun.data.rollout import RolloutBatch, pack_log_probs, pack_rows, unpack_rows
from rlrun.data.vision_batch import RowVision
from rlrun.engines.build import restarts_engines
from rlrun.engines.protocol import REPORTS_LOG_PROBS, Engine
from rlrun.launch.context import RankContext
from rlrun.launch.layout import Role
from rlrun.launch.transfer import EngineRowExchange, ReadyFlag, broadcast_json, gather_from, gather_vision
from rlrun.models.moe import RoutingShape, pack_routing
from rlrun.rl.partial_rollout import PoolSettings, SequencePool, alone
from rlrun.rl.sampling import Rewarding, reward_rows, sample_and_reward


@dataclass
class StepOutputs:
    batch: RolloutBatch
    scores: torch.Tensor  # [B] raw scores (before normalisation/clipping)
    extra_logs: dict[str, float]  # named metrics: reward/<reward function extra>, agent/<episode stat>

    def state(self) -> dict:
        """Tensors and numbers only (checkpoints load it with weights_only=True)."""
        batch = {f.name: getattr(self.batch, f.name) for f in fields(self.batch) if f.name != "vision"}
        if self.batch.vision is not None:
            batch["vision"] = self.batch.vision.state()
        return {"batch": batch, "scores": self.scores, "extra_logs": dict(self.extra_logs)}

    @classmethod
    def from_state(cls, state: dict) -> StepOutputs:
        batch = dict(state["batch"])
        if batch.get("vision") is not None:
            batch["vision"] = RowVision.from_state(batch["vision"])
        return cls(RolloutBatch(**batch), state["scores"], dict(state["extra_logs"]))


@dataclass
class LocalRollout:
    """One engine rank's share of a step before the gather: packed rows [b, P + R + 2], raw scores [b] (None
    when a reward model scores later), engine log-probs and action masks [b, R] (when the backend / agents
    give them), metrics, and the seconds it took."""

    packed: torch.Tensor | None = None
    scores: torch.Tensor | None = None
    log_probs: torch.Tensor | None = None
    masks: torch.Tensor | None = None
    agent_stats: dict[str, float] = field(default_factory=dict)
    extra: dict[str, float] = field(default_factory=dict)
    seconds: float = 0.0
    versions: torch.Tensor | None = None  # --partial_rollout: [b, 3] staleness, spans several versions, restarted
    vision: RowVision | None = None  # vision-language policies: the rows' prompt images
    routing: torch.Tensor | None = None  # --router_replay R3: [b, P + R, layers, k] uint8 (rlrun.models.moe)


class RolloutSource:
    """The generate phase. produce() on engine ranks only; exchange() and generate() on every rank."""

    def __init__(
        self,
        ctx: RankContext,
        train: TrainConfig,
        generation: GenerationConfig,
        prompts: Prompts,
        sampler: PromptSampler,
        engine: Engine | None,
        rewarding: Rewarding,
        routing: RoutingShape | None = None,
    ) -> None:
        """`engine`: an engine rank's (None elsewhere); `rewarding`: how its rollouts get their rewards; `routing`:
        the MoE policy's routing shape when the engines record it for --router_replay R3 (the same on every rank)."""
        self.routing = routing
        self.train, self.generation = train, generation
        self.engine, self.rewarding = engine, rewarding
        self.prompts, self.sampler = prompts, sampler
        groups, layout = ctx.groups, ctx.layout
        self.groups, self.tokenizer, self.comm_device = groups, ctx.tokenizer, ctx.device
        self.rank = groups.rank
        self.engine_ranks = layout.ranks_of(Role.ENGINE)
        self.asynchronous = layout.asynchronous
        self.partial = train.continues_rollouts  # on every rank
        self.pool: SequencePool | None = None
        if self.partial and engine is not None:
            t, engines = train, len(self.engine_ranks)
            settings = PoolSettings(
                t.n_samples_per_prompt,
                t.rollout_batch_size // engines,
                generation.generate_max_len,
                t.partial_rollout_tokens,
                t.max_staleness,
                engine.sampling.end_ids,
                t.seed,
            )
            index = layout.engine_index_of(self.rank)
            assert index is not None  # an engine rank's
            engine_group = groups.get(f"engine.{index}") if len(layout.engines[index]) > 1 else None
            vote = EngineRowExchange(engine_group, self.comm_device).any_rank if engine_group is not None else alone
            self.pool = SequencePool(
                engine, prompts.ids, sampler, self.engine_ranks.index(self.rank), engines, settings, vote
            )
        # the actor's first rank tells the engines when it has trained, so that they generate ahead until then
        ready = groups.get("ready")
        self.flag = ReadyFlag(ready) if ready is not None else None  # the group exists only for partial rollouts
        # a vision-language policy: the engine ranks read and preprocess the images, and send them with the rows
        self.vision = prompts.images is not None
        self.counts_restarts = restarts_engines(generation, layout)  # they report their count each step

    def generate(self, step: int) -> StepOutputs:
        """Engine ranks sample their share (single responses, or agent episodes); every rank receives the
        whole batch (and the function or agent scores)."""
        return self.exchange(step, self.produce(step, step) if self.engine is not None else None)

    def produce(self, step: int, version: int, overlapped: bool = False) -> LocalRollout:
        """An engine rank's share of step `step`'s rollouts, packed for the wire, sampled by the engine's weights,
        which are policy version `version`. Local work only (no collective but the actor's ready flag), so with
        --async_train it runs while the learners train (`overlapped`: then --partial_rollout's engines generate
        ahead until the actor has trained, signal_trained)."""
        assert self.engine is not None
        t0 = time.perf_counter()
        n = self.train.n_samples_per_prompt
        slot = self.engine_ranks.index(self.rank)
        out = LocalRollout()
        engine_lp: list[list[float]] | None  # None: the engine reports no log-probs
        if self.pool is not None:
            trained = None
            if overlapped and self.flag is not None:
                self.flag.arm()
                trained = self.flag.raised
            rows = self.pool.take(step, version, trained)
            mine, responses = [row.record for row in rows], [row.tokens for row in rows]
            prompt_ids, engine_lp = [row.prompt for row in rows], [row.log_probs for row in rows]
            out.versions = torch.tensor(
                [[row.staleness(step), len(set(row.versions)) > 1, row.restarted] for row in rows], dtype=torch.float32
            )
            out.scores, out.extra = reward_rows(self.rewarding, self.prompts, mine, responses, self.tokenizer)
            return self._pack(out, prompt_ids, responses, engine_lp, t0)
        records = [i for i in self.sampler.indices(step) for _ in range(n)]
        mine = records[shard(len(records), len(self.engine_ranks), slot)]
        prompt_ids = [self.prompts.ids[i] for i in mine]
        if self.vision:
            prompt_ids, out.vision = self.prompts.with_images(mine, self.generation.prompt_max_len)
        seed = derive_seed(self.train.seed, "generate", step, slot)
        sampled = sample_and_reward(
            self.engine, self.rewarding, self.prompts, mine, prompt_ids, seed, self.tokenizer, out.vision
        )
        out.scores, out.extra, out.agent_stats = sampled.rewards, sampled.extra, sampled.agent_stats
        if sampled.action_masks is not None:  # episodes: observation tokens are not actions
            out.masks = pack_log_probs(sampled.action_masks, self.generation.generate_max_len)
        if self.routing is not None:
            if sampled.routing is None:
                raise RuntimeError("--router_replay R3: the engine reported no routing")  # plan.checks refuses it
            P, R = self.generation.prompt_max_len, self.generation.generate_max_len
            out.routing = pack_routing(sampled.routing, [len(p) for p in sampled.prompts], P, R, self.routing)
        return self._pack(out, sampled.prompts, sampled.responses, sampled.log_probs, t0)

    def signal_trained(self) -> None:
        """On the actor's first rank, after each overlapped step's update: the engines may stop generating ahead."""
        if self.flag is not None and self.rank == self.flag.source:
            self.flag.raise_()

    def finish(self) -> None:
        """The ready flags of the run have all arrived (before the process groups are destroyed)."""
        if self.flag is not None:
            self.flag.finish()

    def _pack(
        self,
        out: LocalRollout,
        prompt_ids: list[list[int]],
        responses: list[list[int]],
        engine_lp: list[list[float]] | None,
        t0: float,
    ) -> LocalRollout:
        P, R = self.generation.prompt_max_len, self.generation.generate_max_len
        out.packed = pack_rows(prompt_ids, responses, P, R, int(self.tokenizer.pad_token_id))
        if engine_lp is not None:
            out.log_probs = pack_log_probs(engine_lp, R)
        out.seconds = time.perf_counter() - t0
        return out

    def exchange(self, step: int, local: LocalRollout | None) -> StepOutputs:
        """Collective over the world: every rank receives step `step`'s whole batch from the engine ranks."""
        world = self.groups.world
        share = self.train.rollouts_per_step // len(self.engine_ranks)
        P, R = self.generation.prompt_max_len, self.generation.generate_max_len
        mine = local or LocalRollout()
        gathered = gather_from(self.engine_ranks, mine.packed, (share, P + R + 2), torch.long, world, self.comm_device)
        batch = unpack_rows(gathered.cpu(), P)
        if self.vision:
            states = gather_vision(
                self.engine_ranks, None if mine.vision is None else mine.vision.state(), world, self.comm_device
            )
            batch.vision = RowVision.concat([RowVision.from_state(state) for state in states])
        extra = dict(mine.extra)
        if self.generation.generation_backend in REPORTS_LOG_PROBS:  # resolved at start: the same on every rank
            engine_lp = gather_from(
                self.engine_ranks, mine.log_probs, (share, R), torch.float32, world, self.comm_device
            )
            batch.engine_log_probs = engine_lp.cpu()[:, : batch.response_width]
        if self.routing is not None:
            shape = (share, P + R, self.routing.layers, self.routing.top_k)
            routing = gather_from(self.engine_ranks, mine.routing, shape, torch.uint8, world, self.comm_device)
            p = batch.sequences.shape[1] - batch.response_width  # unpack_rows kept the step's longest prompt
            batch.routing = routing.cpu()[:, P - p : P + batch.response_width]
        if self.rewarding.episodes:  # observation tokens are not actions: the agents' masks replace the lengths'
            all_masks = gather_from(self.engine_ranks, mine.masks, (share, R), torch.float32, world, self.comm_device)
            batch.action_mask = all_masks.cpu()[:, : batch.response_width]
            extra = mean_stats(
                cast(
                    "list[dict[str, float]]",
                    [
                        broadcast_json(mine.agent_stats if self.rank == src else None, src, world, self.comm_device)
                        for src in self.engine_ranks
                    ],
                )
            )
        if self.asynchronous:  # the learners did not see the engines generate: say how long it took
            first = self.engine_ranks[0]
            extra.update(
                cast(
                    "dict[str, float]",
                    broadcast_json(
                        {"time/engine_generate": mine.seconds} if self.rank == first else None,
                        first,
                        world,
                        self.comm_device,
                    ),
                )
            )
        if self.counts_restarts:
            restarts = torch.tensor([float(self.engine.restarts)]) if self.engine is not None else None
            counts = gather_from(self.engine_ranks, restarts, (1,), torch.float32, world, self.comm_device)
            extra["engine/restarts"] = float(counts.sum())  # over the run, every engine rank's
        if self.partial:  # every row's staleness (versions behind the policy trained on it)
            versions = gather_from(self.engine_ranks, mine.versions, (share, 3), torch.float32, world, self.comm_device)
            extra.update(staleness_logs(versions.cpu()))
        if self.rewarding.scored_later:
            return StepOutputs(batch, torch.empty(0), extra)
        all_scores = gather_from(self.engine_ranks, mine.scores, (share,), torch.float32, world, self.comm_device).cpu()
        return StepOutputs(batch, all_scores, extra)


def staleness_logs(versions: torch.Tensor) -> dict[str, float]:
    """[B, 3] per row (staleness, spans several versions, restarted) -> the step's async/* metrics."""
    return {
        "async/staleness_mean": float(versions[:, 0].mean()),
        "async/staleness_max": float(versions[:, 0].max()),
        "async/partial_frac": float(versions[:, 1].mean()),
        "async/restarted_frac": float(versions[:, 2].mean()),
    }
