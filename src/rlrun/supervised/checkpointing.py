"""Resumable checkpoints of a supervised run: the trained model and optimizer (sharded, world-size independent),
the LR schedule and step; atomic like PPO's (rlrun.checkpoint.store). The data order is a function of (seed, step),
so the step is all a resume needs to continue with exactly the batches an uninterrupted run would see."""

from __future__ import annotations

import json
import os
import time
from typing import TYPE_CHECKING, Any

import torch

from rlrun.checkpoint import store as ckpt
from rlrun.checkpoint.config_diff import check_resume
from rlrun.checkpoint.ownership import run_record
from rlrun.config.fields import redacted
from rlrun.launch.checkpoint_sync import restore_newest, save_checkpoint, write_parts
from rlrun.roles.update import Updater
from rlrun.roles.update_state import architecture_problem, fingerprint, load_updater_state, strategy_problem, updater_state
from rlrun.runtime.log import get_logger
from rlrun.supervised.config import SupervisedConfig
from rlrun.supervised.task import Task

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

STATE_FILE = "trainer_state.json"

# A supervised step consumes train_batch_size samples of the seed's order over the usable samples (those within
# max_len): changing any of these moves every later step to other data.
FIXED_ON_RESUME = {
    "pretrain": "the checkpoint's model was trained from that model",
    "model_preset": "the checkpoint's model was trained from that model",
    "dataset": "the checkpoint's step counts positions in that data",
    "max_samples": "the checkpoint's step counts positions in that many samples",
    "max_len": "which samples are usable (and so every position) depends on it",
    "train_batch_size": "the checkpoint's step counts positions in batches of that size",
    "seed": "the data order derives from it",
}


class SupervisedCheckpoints:
    def __init__(self, cfg: SupervisedConfig, task: Task[Any], updater: Updater, group: "ProcessGroup",
                 comm_device: torch.device, total_steps: int, rank: int, world_size: int, run_id: str) -> None:
        self.cfg, self.task, self.updater, self.group, self.comm_device = cfg, task, updater, group, comm_device
        self.total_steps = total_steps
        self.root = cfg.checkpoint.ckpt_path
        self.rank, self.world_size = rank, world_size
        self.run_id = run_id  # becomes the resumed checkpoint's run on restore: this run continues it

    def should_save(self, steps_done: int) -> bool:
        every = self.cfg.checkpoint.save_steps
        return every > 0 and (steps_done % every == 0 or steps_done == self.total_steps)

    def save(self, steps_done: int) -> None:
        """Collective over every rank."""
        def write(path: str) -> None:
            parts = [lambda: self.task.strategy.save_state(self.task.model, self.task.optimizer, os.path.join(path, "model"))]
            if self.rank == 0:
                parts.append(lambda: ckpt.write_json_atomic(os.path.join(path, STATE_FILE),
                                                            {"step": steps_done, "updater": updater_state(self.updater)}))
            write_parts(*parts)

        config = redacted(self.cfg)
        save_checkpoint(self.root, steps_done, group=self.group, device=self.comm_device,
                        timeout_s=self.cfg.runtime.dist_timeout, keep=self.cfg.checkpoint.max_ckpt_num, write=write,
                        meta=lambda: {"step": steps_done, "trainer": self.task.name, "model": fingerprint(self.task.model),
                                      "world_size": self.world_size, "strategy": self.cfg.train.strategy,
                                      "config": config, "run": run_record(self.run_id, config)},
                        remove_foreign=self.cfg.checkpoint.overwrite_checkpoints,
                        needs_bytes=12 * sum(p.numel() for p in self.task.model.parameters()))

    def _problem(self, meta: dict[str, Any]) -> str | None:
        written_by = meta.get("trainer", "ppo")
        if written_by != self.task.name:
            return (f"checkpoint at step {meta.get('step')} in {self.root} was written by rlrun.{written_by}, this is "
                    f"rlrun.{self.task.name}; point --ckpt_path at this trainer's checkpoints")
        return (strategy_problem(meta, self.cfg.train.strategy, self.root)
                or architecture_problem(meta, "model", self.task.model, self.root, what=self.task.name)
                or check_resume(meta, redacted(self.cfg), FIXED_ON_RESUME, self.root, get_logger(self.rank).info_once))

    def restore(self) -> int:
        """Load the newest intact checkpoint (collective). Returns the steps already done. One that fails to load
        on any rank is skipped for the next newest (every rank agrees)."""
        start = time.perf_counter()
        restored = restore_newest(self.root, group=self.group, device=self.comm_device, problem=self._problem,
                                  load=self._load)
        if restored is None:
            return 0
        found, step = restored
        self.run_id = found.run or self.run_id
        get_logger(self.rank).info_once(f"resumed from {found.path} at step {step} ({time.perf_counter() - start:.2f} s, "
                                        f"checksums verified in {found.verify_s:.2f} s)")
        return step

    def _load(self, path: str) -> int:
        self.task.strategy.load_state(self.task.model, self.task.optimizer, os.path.join(path, "model"))
        with open(os.path.join(path, STATE_FILE), encoding="utf-8") as fh:
            state = json.load(fh)
        load_updater_state(self.updater, state["updater"])
        return int(state["step"])
