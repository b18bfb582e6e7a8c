"""One supervised training run (rlrun.sft, rlrun.rm, rlrun.dpo): parse and check everything first, read the
data before the first collective, then build, train, save; the same failure policy as rlrun.rl.run (one line
per failing rank, then os._exit)."""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Generic, Sequence, TypeVar

import torch
from transformers import PreTrainedTokenizerBase

from rlrun.checkpoint.ownership import run_identity
from rlrun.cli.parser import CliSpec, ParsedArgs, parse_args
from rlrun.data.prompts import PromptSampler
from rlrun.data.sources import DataSpec, missing_paths, not_here
from rlrun.launch.dist import (collective_device, init_distributed, resolve_dist_backend, resolve_device_and_precision,
                               restart_safety_warning, teardown)
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import check_outputs, checked_on_every_rank, fail_and_exit, launch_environment
from rlrun.launch.groups import all_ranks_group, solo_group
from rlrun.launch.transfer import sum_over
from rlrun.models.adapter_pretrain import resolve_adapter_pretrain
from rlrun.models.hub import resolve, resolve_models
from rlrun.models.loading import load_tokenizer, tokenizer_missing
from rlrun.reporting.metrics import MetricsSink
from rlrun.reporting.run_report import announce, model_form, saved_outputs
from rlrun.roles.optim import warmup_cosine
from rlrun.roles.update import Updater
from rlrun.runtime.deadline import deadline, set_reporter
from rlrun.runtime.errors import DataError
from rlrun.runtime.faults import run_phases
from rlrun.runtime.log import get_logger, quiet_third_party
from rlrun.runtime.seeding import seed_everything
from rlrun.supervised.build import check_lora
from rlrun.supervised.checkpointing import SupervisedCheckpoints
from rlrun.supervised.config import DPOConfig, SupervisedConfig
from rlrun.supervised.datasets import Loaded
from rlrun.supervised.loop import Loop
from rlrun.supervised.task import Task
from rlrun.supervised.validation import check_supervised

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup

S = TypeVar("S")


@dataclass(frozen=True)
class BuildContext:
    group: "ProcessGroup"  # every rank: the trained model's data-parallel group
    device: torch.device
    rank: int
    pad_id: int
    solo: "ProcessGroup | None" = None  # this rank alone: DeepSpeed's model-parallel group (--strategy deepspeed)


@dataclass(frozen=True)
class SupervisedTrainer(Generic[S]):
    """What makes one entry point: its command line, how it reads a data file, and how it builds its task."""

    cli: CliSpec
    load: Callable[[Any, PreTrainedTokenizerBase, DataSpec], Loaded[S]]  # (config, tokenizer, sources) -> samples
    build: Callable[[Any, BuildContext], Task[S]]
    # Without --eval_dataset, evaluate on this fraction of the first training samples (OpenRLHF's reward-model
    # trainer does, with 1%, for the reward mean/std it saves); 0: no evaluation.
    eval_from_train: float = 0.0
    # --dry_run's memory plan, given by the entry point (rlrun.rl.memory_text.supervised_memory, a tier this package
    # may not import): (config, world size, ranks per node, write --plan_json) -> (printed lines, problems)
    memory_plan: Callable[[Any, int, int, bool], tuple[list[str], list[str]]] | None = None


def main(trainer: SupervisedTrainer[Any], argv: Sequence[str] | None = None) -> int:
    env = launch_environment()
    if env is None:
        return 2
    log = get_logger(env.rank)
    quiet_third_party(env.rank)  # before the hub downloads of parse()

    def parse() -> ParsedArgs:
        parsed = parse_args(argv, trainer.cli)
        check_supervised(parsed.config, env.world_size, trainer.cli.prog)
        cfg = resolved_models(parsed.config)
        check_lora(cfg)  # reads --pretrain, so after it is resolved to a local path
        return dataclasses.replace(parsed, config=cfg)

    parsed = checked_on_every_rank(env, parse)
    if parsed is None:
        return 2
    for line in parsed.ignored:
        log.warning_once(line)
    cfg = parsed.config
    if cfg.runtime.dry_run:
        return _dry_run(trainer, cfg, env, log)
    return _run(trainer, cfg, env)


def _dry_run(trainer: SupervisedTrainer[Any], cfg: SupervisedConfig, env: DistEnv, log: Any) -> int:
    """--dry_run: the data-parallel split, the memory plan per rank, what this machine cannot read, the preflight."""
    t = cfg.train
    log.info_once(f"{trainer.cli.prog}: {env.world_size} ranks (launcher {env.launcher}), every rank trains one "
                  f"data-parallel shard: {t.train_batch_size // env.world_size} samples per rank and step in micro-"
                  f"batches of {t.micro_train_batch_size}; --strategy {t.strategy} --zero_stage {t.zero_stage}")
    memory = trainer.memory_plan
    planned = checked_on_every_rank(env, lambda: memory(cfg, env.world_size, env.local_world_size, env.rank == 0)
                                    if memory is not None else ([], []))
    if planned is None:
        return 2
    plan_lines, problems = planned
    models = [("pretrain", cfg.model.pretrain)]
    if isinstance(cfg, DPOConfig):
        models.append(("ref_pretrain", cfg.loss.ref_pretrain))
    for line in plan_lines:
        log.info_once(line)
    for line in (*problems, *missing_paths(models, [("dataset", cfg.data.dataset),
                                                    ("eval_dataset", cfg.data.eval_dataset)])):
        log.warning_once(line)
    lines = checked_on_every_rank(env, lambda: _preflight(trainer, cfg, log))
    for line in lines or ():
        log.info_once(line)
    return 0 if lines is not None else 2


def resolved_models(cfg: SupervisedConfig) -> SupervisedConfig:
    """Hub ids of --pretrain (and DPO's --ref_pretrain) as their cached snapshots (downloaded unless a dry run or
    HF_HUB_OFFLINE=1)."""
    download = not cfg.runtime.dry_run
    cfg = dataclasses.replace(cfg, model=resolve_models(cfg.model, download=download))
    cfg = dataclasses.replace(cfg, model=resolve_adapter_pretrain(cfg.model, download=download))
    if isinstance(cfg, DPOConfig) and cfg.loss.ref_pretrain is not None:
        ref = resolve(cfg.loss.ref_pretrain, "model", "ref_pretrain", download=download)
        cfg = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, ref_pretrain=ref))
    return cfg


def _run(trainer: SupervisedTrainer[Any], cfg: SupervisedConfig, env: DistEnv) -> int:
    started = time.monotonic()
    log = get_logger(env.rank)
    name = trainer.cli.prog.split()[-1]
    phase = run_phases(env.rank, cfg.runtime.dist_timeout)
    sink = None
    local_only = True  # until the first collective: a failure here is the same on every rank
    # A bound that passes (a dataset that never loads) ends the run the same way.
    set_reporter(lambda exc: fail_and_exit(log, env.rank, name, phase, exc, cfg.runtime.dist_timeout,
                                           local_only=local_only, sink=sink))
    try:
        device = resolve_device_and_precision(cfg.runtime.device, env.local_rank, cfg.runtime.tf32)
        backend = resolve_dist_backend(cfg.runtime.dist_backend, device, cpu_collectives=cfg.train.reduces_on_cpu)
        tokenizer = load_tokenizer(cfg.model)
        if cfg.data.tokenizer_chat_template is not None:
            tokenizer.chat_template = cfg.data.tokenizer_chat_template
        assert cfg.data.dataset is not None  # check_supervised
        with deadline(cfg.runtime.data_timeout, lambda: DataError(
                f"loading --dataset {cfg.data.dataset}" + (f" and --eval_dataset {cfg.data.eval_dataset}"
                                                          if cfg.data.eval_dataset else "")
                + f" took over --data_timeout {cfg.runtime.data_timeout:g} s; check the filesystem or network it "
                "comes from, or raise --data_timeout")):
            train = _load(trainer, cfg, tokenizer, cfg.data.dataset, "--dataset", log)
            evals = _load(trainer, cfg, tokenizer, cfg.data.eval_dataset, "--eval_dataset", log) if cfg.data.eval_dataset else None
        held = int(trainer.eval_from_train * len(train.samples))
        if evals is None and held > 0:
            evals = Loaded(train.samples[:held], 0, 0)
            log.info_once(f"no --eval_dataset: evaluating on the first {held} training samples "
                          f"({trainer.eval_from_train:.0%}, as OpenRLHF)")
        t = cfg.train
        if len(train.samples) < t.train_batch_size:
            raise DataError(f"--dataset {cfg.data.dataset}: {len(train.samples)} usable samples do not fill one "
                            f"--train_batch_size {t.train_batch_size}; lower --train_batch_size or add data")
        sampler = PromptSampler(len(train.samples), t.train_batch_size, t.seed, t.max_epochs)
        total_steps = min(sampler.total_steps, t.max_steps or sampler.total_steps)
        log.info_once(f"{len(train.samples)} samples, {total_steps} steps of {t.train_batch_size} "
                      f"({sampler.steps_per_episode} per epoch), {backend} on {device.type}")
        run_id = run_identity()
        if env.rank == 0:
            check_outputs(cfg.checkpoint, cfg.checkpoint.ckpt_path, run_id, log)
            launched = f"world size {env.world_size}, launcher {env.launcher}"
            for line in announce(cfg, trainer.cli.defaults, trainer.cli.prog, launched, cfg.checkpoint.ckpt_path):
                log.info_once(line)
        seed_everything(t.seed)
        local_only = False
        if (warning := restart_safety_warning(env)) is not None:
            log.warning_once(warning)
        init_distributed(env, backend, cfg.runtime.dist_timeout, os.path.join(cfg.checkpoint.save_path, "nccl_trace"))
        phase.phase = "build"
        group = all_ranks_group(cfg.runtime.dist_timeout)
        solo = solo_group(cfg.runtime.dist_timeout) if t.strategy == "deepspeed" else None
        comm_device = collective_device(backend, device)
        task = trainer.build(cfg, BuildContext(group, device, env.rank, int(tokenizer.pad_token_id), solo))
        updater = Updater(task.model, task.strategy, task.optimizer,
                          warmup_cosine(task.optimizer, total_steps, t.lr_warmup_ratio), t.max_norm,
                          t.micro_train_batch_size, env.rank, env.world_size, max_nonfinite_in_a_row=t.max_skipped_steps,
                          ops=task.strategy.step_ops(task.model))
        loop = Loop(task, updater, train.samples, evals.samples if evals else None, sampler, total_steps,
                    functools.partial(sum_over, group=group, device=comm_device), env.rank, env.world_size,
                    t.micro_train_batch_size, cfg.logging.eval_steps, cfg.logging.logging_steps, phase,
                    steps_per_epoch=sampler.steps_per_episode,
                    eval_before_train=cfg.logging.eval_before_train)
        checkpoints = SupervisedCheckpoints(cfg, task, updater, group, comm_device, total_steps, env.rank, env.world_size,
                                            run_id)
        if cfg.checkpoint.load_checkpoint:
            with phase("load", -1):
                loop.step_done = checkpoints.restore()
        sink = MetricsSink(cfg, total_steps, loop.step_done, trainer=name.removeprefix("rlrun.")) if env.rank == 0 else None

        def after_step(steps_done: int) -> None:
            if checkpoints.should_save(steps_done):
                with phase("save", steps_done - 1):
                    checkpoints.save(steps_done)

        loop.fit(sink, after_step)  # rank 0's summary (sink.finish, below) reads the metrics it logged
        with phase("save", loop.step_done):
            task.save(cfg.checkpoint.save_path, tokenizer, is_writer=env.rank == 0,
                      allow_nonfinite=cfg.checkpoint.export_nonfinite, merged=cfg.checkpoint.save_merged)
        log.info_once(f"saved the model {model_form(cfg)} to {cfg.checkpoint.save_path}")
        saved = saved_outputs(cfg, cfg.checkpoint.ckpt_path)
    except BaseException as exc:  # noqa: BLE001 - every failure ends in the same one-line report
        fail_and_exit(log, env.rank, name, phase, exc, cfg.runtime.dist_timeout, local_only=local_only, sink=sink)
    if sink is not None:
        sink.finish(log, saved, time.monotonic() - started)
    teardown()
    return 0


def _preflight(trainer: SupervisedTrainer[Any], cfg: SupervisedConfig, log: Any) -> list[str]:
    """--dry_run: each dataset read and tokenized as training will, its first sample shown as the model sees it
    (as rlrun.ppo's preflight); no model weights, no process group. Paths this machine lacks are only named."""
    if (missing := tokenizer_missing(cfg.model)) is not None:
        return [f"data not read: {missing}, so neither is its tokenizer"]
    tokenizer = load_tokenizer(cfg.model)
    if cfg.data.tokenizer_chat_template is not None:
        tokenizer.chat_template = cfg.data.tokenizer_chat_template
    lines = []
    for flag, path in (("--dataset", cfg.data.dataset), ("--eval_dataset", cfg.data.eval_dataset)):
        if path is None:
            continue
        if elsewhere := not_here(path):
            lines.append(f"{flag} {path}: not read ({', '.join(elsewhere)} is not on this machine)")
            continue
        loaded = _load(trainer, cfg, tokenizer, path, flag, log)
        first = {k: tokenizer.decode(v) if isinstance(v, list) else v
                 for k, v in dataclasses.asdict(loaded.samples[0]).items()} if loaded.samples else {}
        lines.append(f"{flag} {path}: {len(loaded.samples)} samples ({loaded.dropped} dropped, {loaded.truncated} "
                     f"truncated at --max_len {cfg.train.max_len}); the first as the model sees it: {first}")
    return lines


def _load(trainer: SupervisedTrainer[Any], cfg: SupervisedConfig, tokenizer: PreTrainedTokenizerBase, path: str,
          flag: str, log: Any) -> Loaded[Any]:
    d = cfg.data
    spec = (DataSpec(path, "dataset", d.dataset_split, d.dataset_probs, cfg.train.seed) if flag == "--dataset" else
            DataSpec(path, "eval_dataset", d.eval_split, seed=cfg.train.seed))
    loaded = trainer.load(cfg, tokenizer, spec)
    if loaded.dropped or loaded.truncated:
        log.info_once(f"{flag} {path}: {len(loaded.samples)} samples; {loaded.dropped} records dropped and "
                      f"{loaded.truncated} truncated at --max_len {cfg.train.max_len}")
    return loaded
