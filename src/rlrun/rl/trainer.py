"""The RL loop: generate -> score -> advantages -> train -> sync weights -> log.

Every rank runs this same code; what it does at each phase depends on the roles it holds.
Tensors cross ranks only through rlrun.launch.transfer.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.algo.algorithms import compute_advantages, compute_approx_kl, make_kl_controller, masked_mean, sequence_mean_kl
from rlrun.algo.running import RunningMoments
from rlrun.config.schema import Config
from rlrun.data.batching import derive_seed, minibatch_order, shard
from rlrun.data.prompts import PromptSampler
from rlrun.data.results import SlotPlan, pack_slots, slot_plan, unpack_slots
from rlrun.data.rollout import RolloutBatch, engine_logprob_diff
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import all_gather_vectors, broadcast_json
from rlrun.reporting.metrics import MetricsSink
from rlrun.rewards.shaping import dynamic_filter_keep, overlong_penalty, stop_properly_penalty, truncated_rows
from rlrun.rl.build import Prompts, RankRoles
from rlrun.rl.dynamic_batch import role_budgets, scoring_order, unpermute
from rlrun.rl.evaluation import Evaluator
from rlrun.rl.rollout_source import RolloutSource, StepOutputs
from rlrun.rl.sleep import Phase, SleepSchedule
from rlrun.roles.actor import PolicyData
from rlrun.roles.critic import ValueData
from rlrun.runtime.faults import PhaseTracker
from rlrun.runtime.seeding import seed_everything


@dataclass
class TrainState:
    """Loop state an exact resume needs besides the models, optimizers and the KL controller."""

    step: int = 0
    reward_moments: RunningMoments = field(default_factory=RunningMoments)


@dataclass
class Learned:
    """What one update leaves for the step's metrics."""

    results: dict[str, torch.Tensor]
    mean_kl: float
    advantages: torch.Tensor
    stats: dict[str, float]


class Trainer:
    def __init__(self, cfg: Config, layout: Layout, groups: Groups, roles: RankRoles, prompts: Prompts,
                 sampler: PromptSampler, tokenizer: PreTrainedTokenizerBase, device: torch.device,
                 total_steps: int, phase: PhaseTracker) -> None:
        self.phase = phase
        self.cfg, self.layout, self.groups, self.roles = cfg, layout, groups, roles
        self.prompts, self.sampler, self.tokenizer, self.device = prompts, sampler, tokenizer, device
        self.total_steps = total_steps
        self.rank = groups.rank
        self.kl = make_kl_controller(cfg.algo.init_kl_coef, cfg.algo.kl_target, cfg.algo.kl_horizon)
        self.state = TrainState()  # the KL coefficient lives in self.kl
        self.engine_ranks = layout.ranks_of(Role.ENGINE)
        # NCCL needs device tensors; gloo takes them too (staged through host memory by its CUDA collectives: ran on
        # an H200 with --dist_backend gloo --device cuda), so the rollout exchange never moves them by hand.
        self.comm_device = device
        # Scoring and training collectives: every rank, or every rank but the engines when they generate meanwhile.
        self.asynchronous = layout.asynchronous  # --async_train, when the layout gives the engines ranks of their own
        self.learners = groups.get("learners") if self.asynchronous else groups.world
        self.learner_ranks = [r for r in range(layout.world_size) if not self.asynchronous or r not in self.engine_ranks]
        self.pending: StepOutputs | None = None  # --async_train: the next step's batch, already gathered
        # --dynamic_batch: micro-batches by tokens, their count agreed over each role's group (rlrun.rl.dynamic_batch)
        self.budgets = role_budgets(cfg, groups, device)
        self.rollouts = RolloutSource(cfg, layout, groups, roles, prompts, sampler, tokenizer, self.comm_device)
        # --deepspeed_enable_sleep: models move off the device between the phases that use them (rlrun.rl.sleep)
        self.sleep = SleepSchedule.from_roles(cfg, layout, self.rank, roles, device=device,
                                              actor_scores=not skips_old_log_probs(cfg) or cfg.ref_is_actor_base)

    # ---- phases -------------------------------------------------------------------------------

    def score(self, out: StepOutputs) -> dict[str, torch.Tensor]:
        """Each role computes its shard at the same time as the others; one all-gather returns all."""
        batch, B, R = out.batch, out.batch.sequences.shape[0], out.batch.response_width
        micro = self.cfg.train.micro_rollout_batch_size
        widths, ranks, mine, orders = {}, {}, {}, {}
        jobs = [("old_log_probs", Role.ACTOR, R, self.roles.actor and self.roles.actor.log_probs),
                ("ref_log_probs", Role.ACTOR if self.cfg.ref_is_actor_base else Role.REF, R,
                 self.roles.reference and self.roles.reference.log_probs),
                ("values", Role.CRITIC, R, self.roles.critic and self.roles.critic.values),
                ("scores", Role.REWARD, 1, self.roles.reward_model and self.roles.reward_model.score)]
        if skips_old_log_probs(self.cfg):  # step() gathers them from the training forward instead
            jobs = jobs[1:]
        for key, role, width, fn in jobs:
            if not self.layout.has(role):
                continue
            widths[key], ranks[key] = width, self.layout.ranks_of(role)
            # Every rank knows every key's order (to put the gathered results back); the rows as they are, or dealt
            # by length (--dynamic_batch) so that the role's ranks score about the same tokens.
            orders[key] = scoring_order(batch, len(ranks[key]), self.budgets.on)
            if fn:
                rows = orders[key][shard(B, len(ranks[key]), ranks[key].index(self.rank))]
                mine[key] = fn(batch.rows(rows), self.budgets.score_micro(role, micro))
        plan = slot_plan(B, widths, ranks)
        flat = pack_slots(plan, self.rank, mine).to(self.comm_device)
        results = {key: unpermute(values, orders[key]) for key, values in self._gather_slots(plan, flat).items()}
        if "scores" not in results:
            results["scores"] = out.scores
        return results

    def _gather_slots(self, plan: SlotPlan, flat: torch.Tensor) -> dict[str, torch.Tensor]:
        """Every learner's packed results -> {key: all rows} on CPU (the learners: the world, or every rank but
        the engines with --async_train)."""
        return unpack_slots(plan, all_gather_vectors(flat, self.learners).cpu(), self.learner_ranks)

    def gather_on_policy_log_probs(self, batch: RolloutBatch) -> torch.Tensor:
        """[B, R] on every rank: the actor's log-probs from its on-policy training forward (before the update),
        standing in for the scoring pass skipped by skips_old_log_probs. One all-gather."""
        B, R = batch.sequences.shape[0], batch.response_width
        ranks = self.layout.ranks_of(Role.ACTOR)
        plan = slot_plan(B, {"old_log_probs": R + 1}, {"old_log_probs": ranks})
        mine = {"old_log_probs": self.roles.actor.on_policy_log_probs()} if self.roles.actor is not None else {}
        flat = pack_slots(plan, self.rank, mine).to(self.comm_device)
        rows_and_logp = self._gather_slots(plan, flat)["old_log_probs"]
        out = torch.zeros(B, R)
        out[rows_and_logp[:, 0].long()] = rows_and_logp[:, 1:]
        return out

    def advantages(self, batch: RolloutBatch, results: dict[str, torch.Tensor]) -> tuple[torch.Tensor, ...]:
        """Pure and identical on every rank: KL, shaped scores, advantages and returns.

        Order as in OpenRLHF: dynamic filtering on the raw scores, then length penalties, then the
        estimator's group baseline and the reward clip. --dynamic_filtering zeroes the response mask
        of filtered groups IN `batch`, so they drop out of every loss and token count downstream."""
        a, n = self.cfg.algo, self.cfg.train.n_samples_per_prompt
        scores = results["scores"].float()
        self.advantage_logs: dict[str, float] = {}
        if a.dynamic_filtering:
            keep = dynamic_filter_keep(scores, n, a.dynamic_filtering_reward_range)
            batch.action_mask = batch.action_mask * keep.unsqueeze(1).to(batch.action_mask.dtype)
            self.advantage_logs["dynamic_filtering/kept_frac"] = float(keep.float().mean())
        mask = batch.action_mask
        ref = results.get("ref_log_probs")
        # No old log-probs (skips_old_log_probs): the KL is not in the reward; step() computes the logged one.
        kl = (compute_approx_kl(results["old_log_probs"], ref, a.kl_estimator, mask)
              if ref is not None and "old_log_probs" in results else torch.zeros_like(mask))
        if a.running_reward_norm:
            self.state.reward_moments.update(scores)
            scores = self.state.reward_moments.normalize(scores)
        R = self.cfg.generation.generate_max_len
        if a.overlong_buffer_len is not None:
            penalty = overlong_penalty(batch.response_len, R, a.overlong_buffer_len, a.overlong_penalty_factor)
            scores = scores + penalty.to(scores.dtype)
            self.advantage_logs["reward/overlong_frac"] = float((penalty < 0).float().mean())
        if a.stop_properly_penalty_coef is not None:
            cut = truncated_rows(batch.sequences[:, -batch.response_width:], batch.response_len, R,
                                 int(self.tokenizer.eos_token_id))
            scores = stop_properly_penalty(scores, cut, a.stop_properly_penalty_coef)
            self.advantage_logs["reward/truncated_frac"] = float(cut.float().mean())
        in_reward = 0.0 if a.use_kl_loss else self.kl.value
        adv, ret = compute_advantages(
            a.advantage_estimator, scores, mask, n_samples_per_prompt=n, kl=kl,
            kl_coef=in_reward, values=results.get("values"), gamma=a.gamma, lambd=a.lambd,
            reward_clip_range=a.reward_clip_range, std_norm=not a.no_advantage_std_norm)
        return kl, adv, ret

    def train(self, step: int, batch: RolloutBatch, results: dict[str, torch.Tensor], adv: torch.Tensor,
              ret: torch.Tensor) -> dict[str, float]:
        t = self.cfg.train
        minibatches = [mb for epoch in range(t.max_epochs)
                       for mb in minibatch_order(batch.sequences.shape[0], t.train_batch_size,
                                                 derive_seed(t.seed, "minibatch", step, epoch))]
        stats: dict[str, float] = {}
        self.sleep.enter(Phase.TRAIN_ACTOR)
        if self.roles.actor is not None:
            data = PolicyData(batch, results.get("old_log_probs"), adv, results.get("ref_log_probs"))
            stats.update(self.roles.actor.train(data, minibatches, self.kl.value, self.budgets.train.get(Role.ACTOR)))
        self.sleep.enter(Phase.TRAIN_CRITIC)
        if self.roles.critic is not None:
            stats.update(self.roles.critic.train(ValueData(batch, results["values"], ret), minibatches,
                                                 self.budgets.train.get(Role.CRITIC)))
        if self.layout.has(Role.CRITIC):  # critic stats live on the critic's first rank; rank 0 logs
            src = self.layout.ranks_of(Role.CRITIC)[0]
            if src != 0:
                critic = broadcast_json({k: v for k, v in stats.items() if k.startswith("critic/")} if self.rank == src else None,
                                        src, self.learners, self.comm_device)
                stats.update(critic)  # type: ignore[arg-type]
        return stats

    def sync_weights(self) -> None:
        """Actor -> engines (collective over the actor and engine ranks), then the engine takes the new weights
        up (vLLM: one reload in its child), once per sync rather than once per generate call."""
        self.sleep.enter(Phase.SYNC)
        self.roles.weight_sync.sync()  # type: ignore[union-attr]
        if self.roles.engine is not None:
            self.roles.engine.load_weights()

    # ---- the loop -----------------------------------------------------------------------------

    def step(self, step: int) -> dict[str, float]:
        # Every random draw of this step derives from (seed, step, rank): exact resume needs no RNG state.
        seed_everything(derive_seed(self.cfg.train.seed, "step", step, self.rank))
        t0 = time.perf_counter()
        if self.asynchronous:
            return self._async_step(step, t0)
        self.sleep.enter(Phase.GENERATE)
        with self.phase("generate", step):
            out = self.rollouts.generate(step)
        times = {"time/generate": time.perf_counter() - t0}
        learned = self.learn(step, out, times)
        t3 = time.perf_counter()
        with self.phase("sync", step):
            self.sync_weights()
        times["time/sync"] = time.perf_counter() - t3
        return self._metrics(step, out, learned, times, time.perf_counter() - t0)

    def _async_step(self, step: int, t0: float) -> dict[str, float]:
        """--async_train: the engines generate step+1 with the weights before this step's update while the
        learners train on step `step` (generated a step earlier); weights sync at the step boundary, then
        step+1's batch is gathered and held in `self.pending` (checkpointed, so a resume is exact)."""
        out = self.pending
        if out is None:  # the first step (or a resume from a checkpoint without a batch in flight)
            with self.phase("generate", step):
                out = self.rollouts.generate(step)
        times: dict[str, float] = {}
        ahead = None
        if self.roles.engine is not None:
            if step + 1 < self.total_steps:
                with self.phase("generate", step + 1):
                    ahead = self.rollouts.produce(step + 1, step, overlapped=True)
            learned = None
        else:
            learned = self.learn(step, out, times)
            if step + 1 < self.total_steps:  # the engines are generating step+1 (and ahead): tell them
                self.rollouts.signal_trained()
        t3 = time.perf_counter()
        with self.phase("sync", step):
            self.sync_weights()
        times["time/sync"] = time.perf_counter() - t3
        t4 = time.perf_counter()
        self.pending = None
        if step + 1 < self.total_steps:
            with self.phase("generate", step + 1):
                self.pending = self.rollouts.exchange(step + 1, ahead)
        times["time/wait_rollout"] = time.perf_counter() - t4
        if learned is None:  # engine ranks train nothing and log nothing (rank 0 is a learner)
            return {"step": step + 1, "reward": float(out.scores.float().mean()) if out.scores.numel() else float("nan")}
        lag = {} if self.rollouts.partial else {"async/policy_lag": 1.0}  # else async/staleness_*
        return {**self._metrics(step, out, learned, times, time.perf_counter() - t0), **lag}

    def learn(self, step: int, out: StepOutputs, times: dict[str, float]) -> "Learned":
        """Score, advantages and the update of one batch (every rank but async engines). Adds time/score, time/train."""
        t1 = time.perf_counter()
        self.sleep.enter(Phase.SCORE)
        with self.phase("score", step):
            results = self.score(out)
            kl, adv, ret = self.advantages(out.batch, results)
        times["time/score"] = time.perf_counter() - t1
        t2 = time.perf_counter()
        with self.phase("train", step):
            stats = self.train(step, out.batch, results, adv, ret)
            if "old_log_probs" not in results:  # skipped in score: the training forward's log-probs stand in
                results["old_log_probs"] = self.gather_on_policy_log_probs(out.batch)
                if "ref_log_probs" in results:
                    kl = compute_approx_kl(results["old_log_probs"], results["ref_log_probs"], self.cfg.algo.kl_estimator,
                                           out.batch.action_mask)
        times["time/train"] = time.perf_counter() - t2
        # OpenRLHF's "kl": the mean over sequences of each one's token-mean KL; it also drives the
        # adaptive controller, with n_steps = rollout_batch_size * n_samples_per_prompt rows.
        mean_kl = sequence_mean_kl(kl, out.batch.action_mask)
        self.kl.update(mean_kl, self.cfg.rollouts_per_step)
        return Learned(results, mean_kl, adv, stats)

    def _metrics(self, step: int, out: StepOutputs, learned: "Learned", times: dict[str, float],
                 step_time: float) -> dict[str, float]:
        mask, results = out.batch.action_mask, learned.results
        generated = float(out.batch.response_len.sum())
        return {
            "step": step + 1,
            "episode": self.sampler.episode_of(step),
            "reward": float(results["scores"].float().mean()),
            "kl": learned.mean_kl,
            "kl_coef": self.kl.value,
            **self.advantage_logs,
            "response_length": float(out.batch.response_len.float().mean()),
            "tokens_per_s": generated / step_time,
            "advantage_mean": float(masked_mean(learned.advantages, mask)),
            **out.extra_logs,
            **engine_logprob_diff(out.batch, results["old_log_probs"]),
            **learned.stats,
            **times,
            "time/step": step_time,
        }

    def fit(self, sink: MetricsSink | None, on_step_end: Callable[[int], None] | None = None,
            evaluator: Evaluator | None = None) -> list[dict[str, float]]:
        """Run from self.state.step to total_steps; rank 0 logs every logging_steps; the evaluator (every rank)
        runs when due, before on_step_end(steps_done) (checkpointing), so a checkpoint's steps come with their
        evaluations."""
        history = []
        if evaluator is not None and evaluator.before_train and self.state.step == 0:
            with self.phase("eval", -1):
                self.sleep.enter(Phase.GENERATE)
                before = evaluator.run(0)
            if sink is not None:
                sink.log_eval(0, before)
        for step in range(self.state.step, self.total_steps):
            metrics = self.step(step)
            self.state.step = step + 1
            history.append(metrics)
            evals = None
            if evaluator is not None and evaluator.due(step + 1):
                with self.phase("eval", step):
                    self.sleep.enter(Phase.GENERATE)
                    evals = evaluator.run(step + 1)
            if sink is not None and (step + 1) % self.cfg.logging.logging_steps == 0:
                sink.log(metrics, evals)
            elif sink is not None and evals is not None:
                sink.log_eval(step + 1, evals)
            if on_step_end is not None:
                on_step_end(step + 1)
        self.rollouts.finish()
        self.sleep.wake_all()
        return history


def skips_old_log_probs(cfg: Config) -> bool:
    """Whether Trainer.score skips the actor's "old log-probs" forward. True exactly when

    * the update is on-policy: --max_epochs 1 and ONE mini-batch per rollout batch (--train_batch_size ==
      --rollout_batch_size * --n_samples_per_prompt), so the training forward runs on the same weights the
      scoring pass would and the PPO ratio can use its detached log-probs (ratio 1 in value, the same
      gradient; TRL's GRPOTrainer does this), and
    * nothing needs them before training: the KL is not a reward penalty (--use_kl_loss, or no reference
      model, i.e. --init_kl_coef 0).

    The logged `kl` (and the adaptive controller's input) and the engine-vs-actor log-prob diff are then
    computed after training from the training forward's log-probs (Trainer.gather_on_policy_log_probs),
    so they keep their meaning."""
    t = cfg.train
    on_policy = t.max_epochs == 1 and t.train_batch_size == cfg.rollouts_per_step
    return on_policy and (cfg.algo.use_kl_loss or not cfg.needs_ref)
