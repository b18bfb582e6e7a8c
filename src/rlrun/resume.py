"""Save and restore everything an exact resume needs, on any layout.

What goes in: actor and critic weights + optimizer state (sharded DCP, resharded on load), LR
scheduler state, step, KL controller and running reward statistics, and with --async_train the rollout
batch already generated for the next step (the weights that generated it are gone). What does not: frozen
models (reference, reward: reloaded from their source) and RNG state — every random draw of a
step (generation sampling, mini-batch order, the global Python/NumPy/torch RNGs) is derived from
(seed, step, rank) at the start of the step, so a resumed run draws exactly what an
uninterrupted one would, whatever the layout.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from rlrun import checkpoint as ckpt
from rlrun.build import RankRoles
from rlrun.config import Config, redacted
from rlrun.faults import maybe_inject
from rlrun.launch.dcp import barrier
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.launch.transfer import broadcast_json
from rlrun.log import get_logger
from rlrun.roles.update import Updater
from rlrun.running import RunningMoments
from rlrun.save import save_critic, save_policy
from rlrun.rollout_source import StepOutputs
from rlrun.trainer import Trainer

PENDING_FILE = "pending_rollout.pt"  # --async_train: the next step's batch, generated before the save


def _fingerprint(model: Any) -> dict[str, Any]:
    shapes = {n: list(p.shape) for n, p in model.named_parameters()}
    digest = hashlib.sha256(json.dumps(shapes, sort_keys=True).encode()).hexdigest()[:16]
    return {"digest": digest, "num_params": len(shapes), "shapes": shapes}


def _updater_state(u: Updater) -> dict[str, Any]:
    sched = {k: v for k, v in u.scheduler.state_dict().items() if k != "lr_lambdas"}
    return {"scheduler": sched, "skipped_steps": u.skipped_steps}


def _load_updater_state(u: Updater, state: dict[str, Any]) -> None:
    sched = dict(state["scheduler"])
    sched["lr_lambdas"] = [None] * len(u.optimizer.param_groups)
    u.scheduler.load_state_dict(sched)
    u.skipped_steps = int(state["skipped_steps"])


class Checkpointer:
    def __init__(self, cfg: Config, layout: Layout, groups: Groups, roles: RankRoles, trainer: Trainer,
                 tokenizer: Any) -> None:
        self.cfg, self.layout, self.groups, self.roles, self.trainer, self.tokenizer = cfg, layout, groups, roles, trainer, tokenizer
        self.root = cfg.checkpoint.ckpt_path
        self.rank = groups.rank
        self.timeout = cfg.runtime.dist_timeout
        self.log = get_logger(self.rank)

    def should_save(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return every > 0 and (steps_done % every == 0 or steps_done == self.trainer.total_steps)

    # ---- save ---------------------------------------------------------------------------------

    def save(self, steps_done: int) -> None:
        """Collective over the world. Rank 0 prepares and seals; each role writes its own part."""
        world = self.groups.world
        path = ckpt.tmp_dir(self.root, steps_done)
        start = time.perf_counter()
        error = None
        if self.rank == 0:
            try:
                ckpt.prepare(self.root, steps_done)
            except ckpt.CheckpointError as exc:
                error = str(exc)
        # Every rank learns whether the directory exists before anyone writes into it.
        error = broadcast_json(error, 0, world, self.trainer.comm_device)
        if error:
            raise ckpt.CheckpointError(error)
        r = self.roles
        if r.actor is not None:
            actor_strategy = r.strategies[Role.ACTOR]
            actor_strategy.save_state(r.actor.model, r.actor.updater.optimizer, os.path.join(path, "actor"))
            if self.cfg.checkpoint.save_hf_ckpt:
                save_policy(r.actor, self.tokenizer, os.path.join(path, "hf"), is_writer=self.rank == 0,
                            strategy=actor_strategy)
        if r.critic is not None:
            r.strategies[Role.CRITIC].save_state(r.critic.model, r.critic.updater.optimizer, os.path.join(path, "critic"))
            first = self.rank == self.layout.ranks_of(Role.CRITIC)[0]
            if first:
                ckpt.write_json_atomic(os.path.join(path, "critic_state.json"), _updater_state(r.critic.updater))
            if self.cfg.checkpoint.save_value_network:
                save_critic(r.critic, os.path.join(path, "critic_hf"), is_writer=first, strategy=r.strategies[Role.CRITIC])
        if self.rank == 0:
            ckpt.write_json_atomic(os.path.join(path, "trainer_state.json"), self._trainer_state())
            if self.trainer.pending is not None:  # --async_train: the batch in flight, so that a resume is exact
                torch.save(self.trainer.pending.state(), os.path.join(path, PENDING_FILE))
        # A kill here leaves a half-written directory. (Not "save": run.py's PhaseTracker already injects
        # "save" faults on entering the save phase, before anything is written, so it would never get here.)
        maybe_inject("save_shards", steps_done - 1, self.rank)
        barrier(world, self.timeout)  # every part is on disk before the checkpoint is sealed
        if self.rank == 0:
            assert r.actor is not None
            meta = {"step": steps_done, "actor": _fingerprint(r.actor.model), "world_size": self.layout.world_size,
                    "strategy": self.cfg.train.strategy, "config": redacted(self.cfg)}
            final = ckpt.publish(self.root, steps_done, meta, self.cfg.checkpoint.max_ckpt_num)
            size_mb = sum(ckpt.validate(final)["files"].values()) / 2**20
            self.log.info_once(f"checkpoint saved: {final} ({size_mb:.1f} MB in {time.perf_counter() - start:.2f} s)")
        barrier(world, self.timeout)

    def _trainer_state(self) -> dict[str, Any]:
        s = self.trainer.state
        assert self.roles.actor is not None
        return {"step": s.step, "kl_coef": self.trainer.kl.value, "reward_moments": asdict(s.reward_moments),
                "actor": _updater_state(self.roles.actor.updater)}

    # ---- restore ------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest complete checkpoint (collective). Returns the step to continue from."""
        world = self.groups.world
        start = time.perf_counter()
        choice: Any = None
        if self.rank == 0:
            found, warnings = ckpt.find_latest(self.root)
            for line in warnings:
                self.log.warning_once(line)
            if found is not None:
                problem = self._compatibility_problem(found.meta)
                choice = {"error": problem} if problem else {"path": found.path, "step": found.step}
        choice = broadcast_json(choice, 0, world, self.trainer.comm_device)
        if choice is None:
            self.log.info_once(f"--load_checkpoint: no complete checkpoint in {self.root}; starting fresh")
            return 0
        if "error" in choice:
            raise ckpt.CheckpointError(choice["error"])
        path = choice["path"]
        r = self.roles
        if r.actor is not None:
            r.strategies[Role.ACTOR].load_state(r.actor.model, r.actor.updater.optimizer, os.path.join(path, "actor"))
        if r.critic is not None:
            critic_dir = os.path.join(path, "critic")
            if not os.path.isdir(critic_dir):
                raise ckpt.CheckpointError(f"{path} has no critic state, but this run trains a critic "
                                           f"(--advantage_estimator {self.cfg.algo.advantage_estimator})")
            r.strategies[Role.CRITIC].load_state(r.critic.model, r.critic.updater.optimizer, critic_dir)
            with open(os.path.join(path, "critic_state.json"), encoding="utf-8") as fh:
                _load_updater_state(r.critic.updater, json.load(fh))
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        self.trainer.state.step = int(state["step"])
        self.trainer.kl.value = float(state["kl_coef"])
        self.trainer.state.reward_moments = RunningMoments(**state["reward_moments"])
        if r.actor is not None:
            _load_updater_state(r.actor.updater, state["actor"])
        pending = os.path.join(path, PENDING_FILE)
        if self.trainer.asynchronous and os.path.exists(pending):
            self.trainer.pending = StepOutputs.from_state(torch.load(pending, weights_only=True))
        elif self.trainer.asynchronous:
            self.log.info_once(f"{path} holds no rollout batch in flight (saved without --async_train): step "
                               f"{self.trainer.state.step + 1} is generated with the restored weights")
        self.log.info_once(f"resumed from {path} at step {self.trainer.state.step} ({time.perf_counter() - start:.2f} s)")
        return self.trainer.state.step

    def _compatibility_problem(self, meta: dict[str, Any]) -> str | None:
        assert self.roles.actor is not None
        written_with = meta.get("strategy", "fsdp")  # checkpoints from before --strategy existed are FSDP2's
        if written_with != self.cfg.train.strategy:
            return (f"checkpoint at step {meta.get('step')} in {self.root} was written with --strategy {written_with}, "
                    f"this run uses --strategy {self.cfg.train.strategy}; resume with --strategy {written_with} or point "
                    "--ckpt_path elsewhere")
        mine, theirs = _fingerprint(self.roles.actor.model), meta.get("actor", {})
        if mine["digest"] == theirs.get("digest"):
            return None
        a, b = mine["shapes"], theirs.get("shapes", {})
        only_ckpt = sorted(set(b) - set(a))[:3]
        only_model = sorted(set(a) - set(b))[:3]
        shape = [f"{n}: checkpoint {b[n]} vs model {a[n]}" for n in sorted(set(a) & set(b)) if a[n] != b[n]][:3]
        return (f"checkpoint at step {meta.get('step')} in {self.root} was written for a different policy architecture "
                f"({theirs.get('num_params')} parameter tensors vs {mine['num_params']}; only in checkpoint: {only_ckpt}; "
                f"only in model: {only_model}; shape differs: {shape}). Point --ckpt_path elsewhere or load the same model.")
