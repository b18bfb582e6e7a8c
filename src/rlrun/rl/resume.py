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

import json
import os
import time
from dataclasses import asdict
from typing import Any

import torch

from rlrun.algo.running import RunningMoments
from rlrun.checkpoint import store as ckpt
from rlrun.config.fields import redacted
from rlrun.config.schema import Config
from rlrun.launch.checkpoint_sync import find_checkpoint, save_checkpoint
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.rl.build import RankRoles
from rlrun.rl.rollout_source import StepOutputs
from rlrun.rl.trainer import Trainer
from rlrun.roles.export import save_critic, save_policy
from rlrun.roles.update_state import architecture_problem, fingerprint, load_updater_state, strategy_problem, updater_state
from rlrun.runtime.log import get_logger

PENDING_FILE = "pending_rollout.pt"  # --async_train: the next step's batch, generated before the save


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
        save_checkpoint(self.root, steps_done, group=self.groups.world, device=self.trainer.comm_device,
                        timeout_s=self.timeout, keep=self.cfg.checkpoint.max_ckpt_num, write=self._write_parts,
                        meta=lambda: {"step": steps_done, "actor": fingerprint(self._actor_model()),
                                      "world_size": self.layout.world_size, "strategy": self.cfg.train.strategy,
                                      "config": redacted(self.cfg)})

    def _actor_model(self) -> Any:
        assert self.roles.actor is not None  # rank 0 always holds the actor
        return self.roles.actor.model

    def _write_parts(self, path: str) -> None:
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
                ckpt.write_json_atomic(os.path.join(path, "critic_state.json"), updater_state(r.critic.updater))
            if self.cfg.checkpoint.save_value_network:
                save_critic(r.critic, os.path.join(path, "critic_hf"), is_writer=first, strategy=r.strategies[Role.CRITIC])
        if self.rank == 0:
            ckpt.write_json_atomic(os.path.join(path, "trainer_state.json"), self._trainer_state())
            if self.trainer.pending is not None:  # --async_train: the batch in flight, so that a resume is exact
                torch.save(self.trainer.pending.state(), os.path.join(path, PENDING_FILE))

    def _trainer_state(self) -> dict[str, Any]:
        s = self.trainer.state
        assert self.roles.actor is not None
        return {"step": s.step, "kl_coef": self.trainer.kl.value, "reward_moments": asdict(s.reward_moments),
                "actor": updater_state(self.roles.actor.updater)}

    # ---- restore ------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest complete checkpoint (collective). Returns the step to continue from."""
        start = time.perf_counter()
        found = find_checkpoint(self.root, group=self.groups.world, device=self.trainer.comm_device,
                                problem=self._compatibility_problem)
        if found is None:
            return 0
        path = found[0]
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
                load_updater_state(r.critic.updater, json.load(fh))
        with open(os.path.join(path, "trainer_state.json"), encoding="utf-8") as fh:
            state = json.load(fh)
        self.trainer.state.step = int(state["step"])
        self.trainer.kl.value = float(state["kl_coef"])
        self.trainer.state.reward_moments = RunningMoments(**state["reward_moments"])
        if r.actor is not None:
            load_updater_state(r.actor.updater, state["actor"])
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
        return (strategy_problem(meta, self.cfg.train.strategy, self.root)
                or architecture_problem(meta, "actor", self.roles.actor.model, self.root))
