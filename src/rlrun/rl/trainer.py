"""The RL step, top to bottom: generate -> score -> advantages -> update -> sync -> metrics.

Every rank runs this same code; what it does in each phase depends on the roles it holds (rlrun.rl.assembly built
them). Each phase is one `with self.phase(Phase.X, step):` block: it names the phase for the failure line, bounds it
with the watchdog, moves the models it needs onto the device (--sleep, rlrun.rl.sleep) and times
it. Tensors cross ranks only through rlrun.launch.transfer. The run skeleton (rlrun.run.skeleton) calls
`train_step` once per step and, between steps, `evaluate` and the checkpointer; the trainer is a torch `Stateful`
the checkpointer saves. `--async_train` runs the same phases in another order (rlrun.rl.async_loop).
"""

from __future__ import annotations

import time
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import torch

from rlrun.algo.algorithms import (
    AdaptiveKLController,
    RunningMoments,
    compute_advantages,
    compute_approx_kl,
    distilled_advantages,
    dynamic_filter_keep,
    make_kl_controller,
    masked_mean,
    overlong_penalty,
    sequence_mean_kl,
    stop_properly_penalty,
    truncated_rows,
)
from rlrun.algo.rollout_correction import OFF, RolloutCorrection, correct
from rlrun.config.algorithm import AlgorithmConfig
from rlrun.config.distill import DistillConfig
from rlrun.config.training import TrainConfig
from rlrun.data.batching import RowLengths, derive_seed, minibatch_order, seed_everything
from rlrun.data.rollout import RolloutBatch, engine_logprob_diff
from rlrun.engines.protocol import Engine
from rlrun.launch.context import RankContext
from rlrun.launch.layout import Role
from rlrun.models.moe import RoutingShape
from rlrun.reporting.live import PerfBasis, perf_numbers
from rlrun.rl.dynamic_batch import Budgets
from rlrun.rl.evaluation import Evaluator
from rlrun.rl.exchange import Exchange, Score, Scored, ScoringJob
from rlrun.rl.rollouts import RolloutSource, StepOutputs
from rlrun.rl.sampling import Rewarding
from rlrun.rl.sleep import SleepSchedule
from rlrun.roles.actor import Actor, PolicyData, Reference
from rlrun.roles.critic import Critic, RewardModel, ValueData
from rlrun.runtime.errors import RlrunError
from rlrun.runtime.log import get_logger
from rlrun.runtime.memory import report_memory
from rlrun.runtime.phases import Phase
from rlrun.strategies.base import Strategy
from rlrun.weight_sync.sync import WeightSync


@dataclass(frozen=True)
class StepSettings:
    """What the loop reads of the run's settings: two sections whole, and what rlrun.rl.assembly derived."""

    algo: AlgorithmConfig
    train: TrainConfig
    generate_max_len: int
    end_ids: tuple[int, ...]  # the ids ending a response: --stop_properly_penalty_coef finds those cut off without one
    ref_by_actor: bool  # LoRA with a KL term: the actor's adapters-off forward scores the reference log-probs
    correction: RolloutCorrection = OFF  # the engine/actor mismatch correction (rlrun.algo.rollout_correction)
    # The update is exactly on-policy and nothing needs the old log-probs before it
    # (rlrun.rl.assembly.skips_old_log_probs): the scoring pass leaves them out and the update's own stand in.
    on_policy: bool = False
    distill: DistillConfig = field(default_factory=DistillConfig)  # on-policy distillation (a teacher, when on)
    # --router_replay R2: the MoE policy's routing, which the actor's scoring pass records for its training passes
    recorded_routing: RoutingShape | None = None
    perf: PerfBasis | None = None  # what perf/throughput and perf/mfu/actor are computed from (rank 0)


@dataclass
class RankRoles:
    """The roles this rank plays (None where it plays none), built by rlrun.rl.assembly."""

    actor: Actor | None = None
    critic: Critic | None = None
    reference: Reference | None = None
    teacher: Reference | None = None  # --teacher_pretrain's frozen model (on-policy distillation)
    reward_model: RewardModel | None = None
    rewarding: Rewarding = field(default_factory=Rewarding)  # how rollouts get their rewards (an engine rank's)
    engine: Engine | None = None
    weight_sync: WeightSync | None = None
    strategies: dict[Role, Strategy] = field(default_factory=dict)  # of the roles above that hold a model
    sleep: SleepSchedule | None = None  # --sleep: when this rank's models move on and off the device


@dataclass(frozen=True)
class Advantages:
    """What the advantage estimation makes of a scored batch ([B, R] each), and what its reward shaping did."""

    kl: torch.Tensor  # the per-token KL to the reference (zeros without one)
    advantages: torch.Tensor
    returns: torch.Tensor
    action_mask: torch.Tensor  # the response mask without the prompt groups --dynamic_filtering left out
    shaping: dict[str, float]  # kept fraction, penalised fractions


@dataclass
class Learned:
    """What one update leaves for the step's metrics."""

    batch: RolloutBatch  # as trained: its response mask without the tokens correction and filtering left out
    scored: Scored  # old log-probs always filled in (on-policy: the update's)
    mean_kl: float
    advantages: torch.Tensor
    stats: dict[str, float]
    shaping: dict[str, float]  # what the reward shaping and the rollout correction did


class Trainer:
    """One rank's RL loop. Its state (steps done, the KL coefficient, the running reward statistics, the actor's
    update loop) is what `state_dict` gives the checkpointer; the models are checkpoint parts of their own."""

    def __init__(
        self,
        ctx: RankContext,
        settings: StepSettings,
        exchange: Exchange,
        roles: RankRoles,
        rollouts: RolloutSource,
        total_steps: int,
        evaluator: Evaluator | None = None,
    ) -> None:
        self.s = settings
        self.layout, self.exchange, self.roles, self.rollouts = ctx.layout, exchange, roles, rollouts
        self.sampler, self.phase, self.rank = rollouts.sampler, ctx.phase, ctx.rank
        self.budgets: Budgets = exchange.budgets
        self.total_steps, self.evaluator = total_steps, evaluator
        self.step = 0  # steps done
        a = settings.algo
        self.kl = make_kl_controller(a.init_kl_coef, a.kl_target, a.kl_horizon)
        self.moments = RunningMoments()  # --running_reward_norm's statistics over every score so far

    # ---- the step ---------------------------------------------------------------------------------------------

    def train_step(self, step: int) -> dict[str, float]:
        """One synchronous step: the engines generate, every rank learns from the batch, the engines take the
        actor's new weights. Returns the step's metrics (rank 0 logs them)."""
        # Every random draw of this step derives from (seed, step, rank): exact resume needs no RNG state.
        seed_everything(derive_seed(self.s.train.seed, "step", step, self.rank))
        started = time.perf_counter()
        self.phase.took()
        with self.phase(Phase.GENERATE, step):
            out = self.rollouts.generate(step)
        learned = self.learn(step, out)
        with self.phase(Phase.SYNC, step):
            self.sync_weights()
        self.step = step + 1
        times = {f"time/{name}": seconds for name, seconds in self.phase.took().items()}
        return self.metrics(step, out, learned, times, time.perf_counter() - started)

    def learn(self, step: int, out: StepOutputs) -> Learned:
        """Score, advantages and the update of one batch (every rank; with --async_train every rank but the
        engines)."""
        with self.phase(Phase.SCORE, step):
            scored = self.score(out)
            weights, kept, corrected = self.correct_rollouts(out.batch, scored)
            adv = self.advantages(out.batch, scored, kept)
        # The batch as trained: its mask without what correction and filtering left out, R2's routing to replay.
        batch = replace(out.batch, action_mask=adv.action_mask, routing=_first(scored.routing, out.batch.routing))
        minibatches = self.minibatches(step, batch.sequences.shape[0])
        lengths = RowLengths.of(batch) if self.budgets.on else None
        bypass = self.s.correction.bypass
        kl, stats = adv.kl, dict[str, float]()
        with self.phase(Phase.TRAIN, step):
            seen = None
            if (actor := self.roles.actor) is not None:
                budget = self.budgets.train.get(Role.ACTOR)
                old = batch.engine_log_probs if bypass else scored.old_log_probs
                teacher = scored.teacher_log_probs if self.s.distill.teacher_kl_loss else None
                data = PolicyData(batch, old, adv.advantages, scored.ref_log_probs, weights, teacher)
                loss = actor.loss(data, self.kl.value, budget, len(minibatches))
                done = actor.updater.run(minibatches, batch.action_mask, loss, budget, lengths)
                stats |= _prefixed("actor/", self.exchange.whole_losses(Role.ACTOR, done))
                seen = loss.seen() if old is None else None
            if self.s.on_policy:  # the scoring pass skipped the old log-probs: the update's stand in, and the KL
                old = batch.engine_log_probs if bypass else self.exchange.on_policy_log_probs(batch, seen)
                scored = replace(scored, old_log_probs=old)
                if old is not None and scored.ref_log_probs is not None:
                    kl = compute_approx_kl(old, scored.ref_log_probs, self.s.algo.kl_estimator, batch.action_mask)
        with self.phase(Phase.TRAIN_CRITIC, step):
            if (critic := self.roles.critic) is not None:
                budget = self.budgets.train.get(Role.CRITIC)
                assert scored.values is not None  # the critic's ranks scored them
                values = critic.loss(ValueData(batch, scored.values, adv.returns), budget)
                done = critic.updater.run(minibatches, batch.action_mask, values, budget, lengths)
                stats |= _prefixed("critic/", self.exchange.whole_losses(Role.CRITIC, done))
            stats |= self.exchange.critic_stats_on_rank0(stats)
        # OpenRLHF's "kl": the mean over sequences of each one's token-mean KL; it also drives the
        # adaptive controller, with n_steps = rollout_batch_size * n_samples_per_prompt rows.
        mean_kl = sequence_mean_kl(kl, batch.action_mask)
        self.kl.update(mean_kl, self.s.train.rollouts_per_step)
        return Learned(batch, scored, mean_kl, adv.advantages, stats, adv.shaping | corrected)

    def sync_weights(self) -> None:
        """Actor -> engines (collective over the actor and engine ranks), then the engine takes the new weights
        up (vLLM: one reload in its child), once per sync rather than once per generate call."""
        self.roles.weight_sync.sync()  # type: ignore[union-attr]
        if self.roles.engine is not None:
            self.roles.engine.load_weights()

    # ---- score --------------------------------------------------------------------------------------------------

    def score(self, out: StepOutputs) -> Scored:
        """Each role scores its shard of the batch at the same time as the others; one all-gather returns all
        (rlrun.rl.exchange). The rollouts' own rewards stand where no reward model scores them."""
        r = self.roles
        jobs = [
            ScoringJob(
                Score.REF_LOG_PROBS,
                Role.ACTOR if self.s.ref_by_actor else Role.REF,
                r.reference.log_probs if r.reference else None,
            ),
            ScoringJob(Score.TEACHER_LOG_PROBS, Role.TEACHER, r.teacher.log_probs if r.teacher else None),
            ScoringJob(Score.VALUES, Role.CRITIC, r.critic.values if r.critic else None),
            ScoringJob(Score.SCORES, Role.REWARD, r.reward_model.score if r.reward_model else None),
        ]
        if not self.s.on_policy:  # the update's own log-probs stand in for these on the on-policy branch
            jobs.insert(0, ScoringJob(Score.OLD_LOG_PROBS, Role.ACTOR, r.actor.log_probs if r.actor else None))
        scored = self.exchange.score(out.batch, jobs, rewards=out.scores)
        if (shape := self.s.recorded_routing) is not None:  # R2: the actor's scoring pass recorded its routing
            mine = r.actor.recorded_routing if r.actor is not None else None
            scored = replace(scored, routing=self.exchange.recorded_routing(out.batch, shape, mine))
        return scored

    # ---- rollout correction ---------------------------------------------------------------------------------------

    def correct_rollouts(
        self, batch: RolloutBatch, scored: Scored
    ) -> tuple[torch.Tensor | None, torch.Tensor, dict[str, float]]:
        """The rollout correction of the batch, identical on every rank: the importance weights [B, R] of the actor's
        old log-probs against the engine's (None without them), the response mask [B, R] without the tokens
        rejection sampling leaves out (verl: before the advantages), and its metrics. With --rollout_bypass the loss
        does this per micro-batch (rlrun.roles.actor). Without a correction, where both log-probs exist, the metrics
        are verl's mismatch diagnostics alone (rollout_corr/*)."""
        c, old = self.s.correction, scored.old_log_probs
        if not c.needs_old_log_probs:
            if c.bypass or old is None or batch.engine_log_probs is None:
                return None, batch.action_mask, {}
            # No correction (verl's `disabled` preset is metrics-only): the mismatch diagnostics, as verl logs them
            return None, batch.action_mask, correct(old, batch.engine_log_probs, batch.action_mask, OFF).metrics
        assert old is not None  # a correction that needs them keeps the scoring pass
        if batch.engine_log_probs is None:
            raise RlrunError(
                "the rollout correction needs the engine's log-prob of every sampled token, and this batch has none "
                "(an agent's episodes without them, or an engine that does not report them): use "
                "--generation_backend native or vllm, or drop the correction"
            )
        fixed = correct(old, batch.engine_log_probs, batch.action_mask, c)
        kept = batch.action_mask * fixed.keep.to(batch.action_mask.dtype) if c.rejection else batch.action_mask
        return fixed.weights, kept, fixed.metrics

    # ---- advantages ---------------------------------------------------------------------------------------------

    def advantages(self, batch: RolloutBatch, scored: Scored, mask: torch.Tensor) -> Advantages:
        """Identical on every rank; `mask` [B, R]: the response tokens left after the rollout correction.

        Order as in OpenRLHF: dynamic filtering on the raw scores, then length penalties, then the estimator's group
        baseline and the reward clip. --dynamic_filtering leaves the filtered groups out of the returned mask, so they
        drop out of every loss and token count downstream. Only the running reward statistics change."""
        a, n = self.s.algo, self.s.train.n_samples_per_prompt
        scores = scored.scores.float()
        if (
            self.s.distill.on and not self.s.distill.distill_task_reward
        ):  # learn from the teacher alone; the reward is still logged
            scores = torch.zeros_like(scores)
        shaping: dict[str, float] = {}
        if a.dynamic_filtering:
            keep = dynamic_filter_keep(scores, n, a.dynamic_filtering_reward_range)
            mask = mask * keep.unsqueeze(1).to(mask.dtype)
            shaping["dynamic_filtering/kept_frac"] = float(keep.float().mean())
        old, ref = scored.old_log_probs, scored.ref_log_probs
        # On the on-policy branch the KL is not in the reward: learn() computes the logged one after the update.
        kl = compute_approx_kl(old, ref, a.kl_estimator, mask) if ref is not None and old is not None else None
        if kl is None:
            kl = torch.zeros_like(mask)
        if a.running_reward_norm:
            self.moments.update(scores)
            scores = self.moments.normalize(scores)
        R = self.s.generate_max_len
        if a.overlong_buffer_len is not None:
            penalty = overlong_penalty(batch.response_len, R, a.overlong_buffer_len, a.overlong_penalty_factor)
            scores = scores + penalty.to(scores.dtype)
            shaping["reward/overlong_frac"] = float((penalty < 0).float().mean())
        if a.stop_properly_penalty_coef is not None:
            cut = truncated_rows(batch.sequences[:, -batch.response_width :], batch.response_len, R, self.s.end_ids)
            scores = stop_properly_penalty(scores, cut, a.stop_properly_penalty_coef)
            shaping["reward/truncated_frac"] = float(cut.float().mean())
        in_reward = 0.0 if a.use_kl_loss else self.kl.value
        adv, ret = compute_advantages(
            a.advantage_estimator,
            scores,
            mask,
            n_samples_per_prompt=n,
            kl=kl,
            kl_coef=in_reward,
            values=scored.values,
            gamma=a.gamma,
            lambd=a.lambd,
            reward_clip_range=a.reward_clip_range,
            std_norm=not a.no_advantage_std_norm,
        )
        if scored.teacher_log_probs is not None:
            adv, distilled = self.distill(adv, scored.teacher_log_probs, old, mask)
            shaping |= distilled
        return Advantages(kl, adv, ret, mask, shaping)

    def distill(
        self, adv: torch.Tensor, teacher: torch.Tensor, student: torch.Tensor | None, mask: torch.Tensor
    ) -> tuple[torch.Tensor, dict[str, float]]:
        """On-policy distillation: the divergence of the policy's sampled tokens (`student`: the actor's log-probs
        before the update) from the teacher, its metrics, and (without --teacher_kl_loss) the advantages minus
        --teacher_kl_coef times it. [B, R] in and out."""
        a = self.s.distill
        m = mask.bool()
        metrics = {"distill/teacher_logprob": float(masked_mean(teacher, m))}
        if student is None:  # --teacher_kl_loss on an on-policy step: the update's log-probs, logged after it
            return adv, metrics
        raw = compute_approx_kl(student, teacher, a.teacher_kl_estimator, m)
        metrics["distill/teacher_kl"] = float(masked_mean(student - teacher, m))
        if m.any():
            metrics |= {
                "distill/divergence": float(masked_mean(raw, m)),
                "distill/divergence_max": float(raw[m].max()),
                "distill/divergence_min": float(raw[m].min()),
            }
        if a.teacher_kl_loss:
            return adv, metrics
        divergence = raw
        if a.teacher_kl_clamp is not None:
            divergence = raw.clamp(-a.teacher_kl_clamp, a.teacher_kl_clamp)
            metrics["distill/clamped_frac"] = float(masked_mean((divergence != raw).float(), m))
        return distilled_advantages(adv, divergence, m, a.teacher_kl_coef), metrics

    # ---- update -------------------------------------------------------------------------------------------------

    def minibatches(self, step: int, rows: int) -> list[torch.Tensor]:
        """The update's mini-batches of global rows: --max_epochs passes over the batch, each in an order drawn from
        (seed, step, epoch)."""
        t = self.s.train
        return [
            mb
            for epoch in range(t.max_epochs)
            for mb in minibatch_order(rows, t.train_batch_size, derive_seed(t.seed, "minibatch", step, epoch))
        ]

    # ---- metrics ------------------------------------------------------------------------------------------------

    def metrics(
        self, step: int, out: StepOutputs, learned: Learned, times: dict[str, float], step_time: float
    ) -> dict[str, float]:
        mask, scored = learned.batch.action_mask, learned.scored
        generated = float(out.batch.response_len.sum())
        tokens = generated + float(out.batch.prompt_len.sum())
        perf = perf_numbers(self.s.perf, tokens, step_time, times.get("time/train")) if self.s.perf else {}
        return {
            "step": step + 1,
            "episode": self.sampler.episode_of(step),
            "reward": float(scored.scores.float().mean()),
            "kl": learned.mean_kl,
            "kl_coef": self.kl.value,
            **learned.shaping,
            "response_length": float(out.batch.response_len.float().mean()),
            "tokens_per_s": generated / step_time,
            "advantage_mean": float(masked_mean(learned.advantages, mask)),
            **out.extra_logs,
            **(engine_logprob_diff(learned.batch, scored.old_log_probs) if scored.old_log_probs is not None else {}),
            **learned.stats,
            **times,
            "time/step": step_time,
            **perf,
        }

    # ---- around the steps (called by the run skeleton) ----------------------------------------------------------

    def begin(self) -> None:
        """Before the first step (after a resume): the engines start from the actor's (possibly restored) weights."""
        self.sync_weights()
        report_memory(get_logger(self.rank), "start-up")

    def evaluate(self, steps_done: int) -> dict[str, float] | None:
        """--eval_dataset's metrics when an evaluation is due after `steps_done` steps (0: before training), else
        None. Collective over the world."""
        e = self.evaluator
        if e is None or not (e.before_train if steps_done == 0 else e.due(steps_done)):
            return None
        with self.phase(Phase.EVAL, steps_done - 1):
            return e.run(steps_done)

    def finish(self) -> None:
        """After the last step: the engines' flags all arrived, every model awake again (the export reads them)."""
        self.rollouts.finish()
        if self.roles.sleep is not None:
            self.roles.sleep.wake_all()
        report_memory(get_logger(self.rank), "training")

    # ---- torch Stateful: what the checkpointer saves of the loop (trainer_state.json) ------------------------------

    def state_dict(self) -> dict[str, Any]:
        assert self.roles.actor is not None  # rank 0, the writer, always holds the actor
        return {
            "step": self.step,
            "kl_coef": self.kl.value,
            "reward_moments": asdict(self.moments),
            "actor": self.roles.actor.updater.state_dict(),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.step = int(state["step"])
        if isinstance(self.kl, AdaptiveKLController):  # a fixed coefficient is this run's --init_kl_coef
            self.kl.value = float(state["kl_coef"])
        self.moments = RunningMoments(**state["reward_moments"])
        if self.roles.actor is not None:
            self.roles.actor.updater.load_state_dict(state["actor"])


def _prefixed(prefix: str, stats: dict[str, float]) -> dict[str, float]:
    return {f"{prefix}{k}": v for k, v in stats.items()}


def _first(*values: torch.Tensor | None) -> torch.Tensor | None:
    return next((v for v in values if v is not None), None)
