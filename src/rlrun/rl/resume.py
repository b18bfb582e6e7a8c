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

from rlrun.algo.algorithms import AdaptiveKLController
from rlrun.algo.running import RunningMoments
from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint.config_diff import check_resume
from rlrun.checkpoint.ownership import run_record
from rlrun.config.fields import redacted
from rlrun.config.schema import Config
from rlrun.launch.checkpoint_sync import restore_newest, save_checkpoint, write_parts
from rlrun.launch.groups import Groups
from rlrun.launch.layout import Layout, Role
from rlrun.rl.build import RankRoles
from rlrun.rl.rollout_source import StepOutputs
from rlrun.rl.trainer import Trainer
from rlrun.roles.export import save_critic, save_policy
from rlrun.roles.update_state import architecture_problem, fingerprint, load_updater_state, strategy_problem, updater_state
from rlrun.runtime.log import get_logger

PENDING_FILE = "pending_rollout.pt"  # --async_train: the next step's batch, generated before the save

# Settings a resume cannot change: what they mean is baked into the checkpoint's weights, optimizer state or
# position in the prompt order (step k trains on prompts [k * rollout_batch_size, ...) of the seed's order).
FIXED_ON_RESUME = {
    "pretrain": "the checkpoint's policy was trained from that model",
    "model_preset": "the checkpoint's policy was trained from that model",
    "critic_pretrain": "the checkpoint's critic was trained from that model",
    "advantage_estimator": "the checkpoint's critic, optimizer and statistics belong to that estimator",
    "prompt_data": "the checkpoint's step counts positions in that data",
    "prompt_split": "the checkpoint's step counts positions in that data",
    "prompt_data_probs": "the checkpoint's step counts positions in that blend",
    "max_samples": "the checkpoint's step counts positions in that many prompts",
    "rollout_batch_size": "the checkpoint's step counts positions in the prompt order in batches of that size",
    "seed": "the prompt order and every random draw of a step derive from it",
}


class Checkpointer:
    def __init__(self, cfg: Config, layout: Layout, groups: Groups, roles: RankRoles, trainer: Trainer,
                 tokenizer: Any, run_id: str) -> None:
        self.cfg, self.layout, self.groups, self.roles, self.trainer, self.tokenizer = cfg, layout, groups, roles, trainer, tokenizer
        self.root = cfg.checkpoint.ckpt_path
        self.rank = groups.rank
        self.timeout = cfg.runtime.dist_timeout
        self.log = get_logger(self.rank)
        self.run_id = run_id  # becomes the resumed checkpoint's run on restore: this run continues it
        self._saved_world_size = layout.world_size  # rank 0: the resumed checkpoint's, once found

    def should_save(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return every > 0 and (steps_done % every == 0 or steps_done == self.trainer.total_steps)

    # ---- save ---------------------------------------------------------------------------------

    def save(self, steps_done: int) -> None:
        """Collective over the world. Rank 0 prepares and seals; each role writes its own part."""
        config = redacted(self.cfg)
        save_checkpoint(self.root, steps_done, group=self.groups.world, device=self.trainer.comm_device,
                        timeout_s=self.timeout, keep=self.cfg.checkpoint.max_ckpt_num, write=self._write_parts,
                        meta=lambda: {"step": steps_done, "actor": fingerprint(self._actor_model()),
                                      "world_size": self.layout.world_size, "strategy": self.cfg.train.strategy,
                                      "config": config, "run": run_record(self.run_id, config)},
                        remove_foreign=self.cfg.checkpoint.overwrite_checkpoints, needs_bytes=self._expected_bytes())

    def _expected_bytes(self) -> int | None:
        """fp32 weights + Adam's two moments of the trained models this rank holds (the checkpoint's bulk)."""
        models = [r.model for r in (self.roles.actor, self.roles.critic) if r is not None]
        return sum(12 * p.numel() for m in models for p in m.parameters()) or None

    def _actor_model(self) -> Any:
        assert self.roles.actor is not None  # rank 0 always holds the actor
        return self.roles.actor.model

    def _write_parts(self, path: str) -> None:
        r = self.roles
        parts = []
        if r.actor is not None:
            actor, actor_strategy = r.actor, r.strategies[Role.ACTOR]
            parts.append(lambda: actor_strategy.save_state(actor.model, actor.updater.optimizer, os.path.join(path, "actor")))
            if self.cfg.checkpoint.save_hf_ckpt:
                parts.append(lambda: save_policy(actor, self.tokenizer, os.path.join(path, "hf"), is_writer=self.rank == 0,
                                                 strategy=actor_strategy, allow_nonfinite=True,
                                                 merged=self.cfg.checkpoint.save_merged,
                                                 image_processor=self.trainer.prompts.image_processor))
        if r.critic is not None:
            critic, critic_strategy = r.critic, r.strategies[Role.CRITIC]
            first = self.rank == self.layout.ranks_of(Role.CRITIC)[0]
            parts.append(lambda: critic_strategy.save_state(critic.model, critic.updater.optimizer,
                                                            os.path.join(path, "critic")))
            if first:
                parts.append(lambda: ckpt.write_json_atomic(os.path.join(path, "critic_state.json"),
                                                            updater_state(critic.updater)))
            if self.cfg.checkpoint.save_value_network:
                parts.append(lambda: save_critic(critic, os.path.join(path, "critic_hf"), is_writer=first,
                                                 strategy=critic_strategy, allow_nonfinite=True,
                                                 merged=self.cfg.checkpoint.save_merged))
        if self.rank == 0:
            parts.append(lambda: ckpt.write_json_atomic(os.path.join(path, "trainer_state.json"), self._trainer_state()))
            if self.trainer.pending is not None:  # --async_train: the batch in flight, so that a resume is exact
                pending = self.trainer.pending
                parts.append(lambda: torch.save(pending.state(), os.path.join(path, PENDING_FILE)))
        write_parts(*parts)

    def _trainer_state(self) -> dict[str, Any]:
        s = self.trainer.state
        assert self.roles.actor is not None
        return {"step": s.step, "kl_coef": self.trainer.kl.value, "reward_moments": asdict(s.reward_moments),
                "actor": updater_state(self.roles.actor.updater)}

    # ---- restore ------------------------------------------------------------------------------

    def restore(self) -> int:
        """Load the newest intact checkpoint (collective; one that fails to load is skipped for the next newest).
        Returns the step to continue from."""
        start = time.perf_counter()
        restored = restore_newest(self.root, group=self.groups.world, device=self.trainer.comm_device,
                                  problem=self._compatibility_problem, load=self._load)
        if restored is None:
            return 0
        found, _ = restored
        self.run_id = found.run or self.run_id
        if self.layout.world_size != self._saved_world_size:
            self.log.info_once(f"resharding the checkpoint of {self._saved_world_size} ranks onto {self.layout.world_size}")
        self.log.info_once(f"resumed from {found.path} at step {self.trainer.state.step} ({time.perf_counter() - start:.2f} s, "
                           f"checksums verified in {found.verify_s:.2f} s)")
        return self.trainer.state.step

    def _load(self, path: str) -> None:
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
        if isinstance(self.trainer.kl, AdaptiveKLController):  # a fixed coefficient is this run's --init_kl_coef
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

    def _compatibility_problem(self, meta: dict[str, Any]) -> str | None:
        """Rank 0: why the checkpoint `meta` describes cannot continue this run (None: it can; what the resume
        changes is said here, once)."""
        assert self.roles.actor is not None
        self._saved_world_size = int(meta.get("world_size", self.layout.world_size))
        return (strategy_problem(meta, self.cfg.train.strategy, self.root)
                or architecture_problem(meta, "actor", self.roles.actor.model, self.root)
                or check_resume(meta, redacted(self.cfg), FIXED_ON_RESUME, self.root, self.log.info_once))
