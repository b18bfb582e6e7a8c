"""The supervised trainers' assembly (rlrun.sft, rlrun.rm, rlrun.dpo) for the run skeleton (rlrun.run.skeleton).

`Supervised` is a trainer: how it reads a data file and builds its task (rlrun.supervised.trainers declares the
three, with the model builders here). Every rank trains one data-parallel share of one model on the all-ranks group,
in the loop rlrun.supervised.loop runs. The only modules of supervised/ that read the whole config: this one and
trainers.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Generic, TypeVar, cast

import torch
from torch import nn
from transformers import PreTrainedModel, PreTrainedTokenizerBase

from rlrun.checkpoint.checkpointer import Identity
from rlrun.config.model import PretrainedConfig
from rlrun.config.supervised import DPOLossConfig, SupervisedConfig, SupervisedTrainConfig
from rlrun.config.training import OptimConfig
from rlrun.data.batching import seed_everything
from rlrun.data.prompts import PromptSampler
from rlrun.data.sources import DataSpec
from rlrun.launch.env import DistEnv
from rlrun.launch.groups import SequenceParallel, all_ranks_group, sequence_parallel_groups, solo_group
from rlrun.launch.transfer import sum_over
from rlrun.models.adapter_pretrain import lora_settings
from rlrun.models.loading import ScalarHeadModel, load_tokenizer, trained_policy, unfilled_policy, unfilled_scalar_model
from rlrun.models.lora import LoraSettings, add_scalar_adapters
from rlrun.models.weights import Unfilled
from rlrun.plan.checks import reference_is_base
from rlrun.plan.memory_text import supervised_memory
from rlrun.plan.plan import Planned
from rlrun.plan.preflight import supervised_preflight
from rlrun.plan.shapes import SupervisedJob
from rlrun.reporting.run_report import model_form, saved_outputs
from rlrun.roles.update import Updater, make_optimizer, warmup_cosine
from rlrun.run.skeleton import Built, Started
from rlrun.runtime.errors import DataError
from rlrun.runtime.log import RankLogger, get_logger
from rlrun.runtime.phases import deadline
from rlrun.strategies import ulysses
from rlrun.strategies.base import ModelState, Strategy
from rlrun.strategies.choose import make_strategy
from rlrun.supervised.datasets import Loaded
from rlrun.supervised.loop import Loop
from rlrun.supervised.tasks import Task

S = TypeVar("S")

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


# ---- the trainers -------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class BuildContext:
    group: torch.distributed.ProcessGroup  # every rank: the trained model's data-parallel group
    device: torch.device
    rank: int
    pad_id: int
    solo: torch.distributed.ProcessGroup | None = None  # this rank alone: DeepSpeed's model-parallel group
    sp: SequenceParallel | None = None  # this rank's sequence-parallel block (--sequence_parallel_size > 1)
    packing: bool = False  # --packing_samples

    def ulysses(self, model: nn.Module) -> nn.Module:
        """`model` with its attention switched to Ulysses when this run is sequence-parallel, or packs rows that an
        sdpa text model then attends sequence by sequence (each sequence costs n^2, not the packed row's width^2 under
        a block-diagonal mask), as rlrun.ppo's packed rows do."""
        if self.sp is not None or (self.packing and ulysses.packs_by_sequence(model)):
            ulysses.enable(model)
        return model


@dataclass
class Data(Generic[S]):
    """What a supervised trainer reads before the first collective."""

    tokenizer: PreTrainedTokenizerBase
    train: Loaded[S]
    evals: Loaded[S] | None
    sampler: PromptSampler
    total_steps: int


@dataclass(frozen=True)
class Supervised(Generic[S]):
    """One supervised trainer for the run skeleton (rlrun.run.skeleton.Trainer): how it reads a data file and how it
    builds its task (rlrun.supervised.trainers declares rlrun.sft's, rlrun.rm's and rlrun.dpo's)."""

    load: Callable[[Any, PreTrainedTokenizerBase, DataSpec], Loaded[S]]  # (config, tokenizer, sources) -> samples
    build_task: Callable[[Any, BuildContext], Task[S]]
    job: SupervisedJob  # what the trainer holds, for --dry_run's memory plan (rlrun.plan.shapes)
    # Without --eval_dataset, evaluate on this fraction of the first training samples (OpenRLHF's reward-model
    # trainer does, with 1%, for the reward mean/std it saves); 0: no evaluation.
    eval_from_train: float = 0.0

    def memory(self, planned: Planned[SupervisedConfig], env: DistEnv) -> tuple[list[str], list[str]]:
        return supervised_memory(planned.config, self.job, env.world_size, env.local_world_size, env.rank == 0)

    def preflight(self, planned: Planned[SupervisedConfig]) -> list[str]:
        cfg = planned.config
        log = get_logger(0)
        return supervised_preflight(cfg, lambda tokenizer, path, flag: self._read(cfg, tokenizer, path, flag, log))

    def read(self, planned: Planned[SupervisedConfig], started: Started) -> Data[S]:
        cfg, log = planned.config, started.log
        tokenizer = load_tokenizer(cfg.model, cfg.data.tokenizer_chat_template)
        d, t = cfg.data, cfg.train
        assert d.dataset is not None  # check_supervised
        with deadline(
            cfg.runtime.data_timeout,
            lambda: DataError(
                f"loading --dataset {d.dataset}"
                + (f" and --eval_dataset {d.eval_dataset}" if d.eval_dataset else "")
                + f" took over --data_timeout {cfg.runtime.data_timeout:g} s; check the filesystem or network it "
                "comes from, or raise --data_timeout"
            ),
        ):
            train = self._read(cfg, tokenizer, d.dataset, "--dataset", log)
            evals = self._read(cfg, tokenizer, d.eval_dataset, "--eval_dataset", log) if d.eval_dataset else None
        held = int(self.eval_from_train * len(train.samples))
        if evals is None and held > 0:
            evals = Loaded(train.samples[:held], 0, 0)
            log.info_once(
                f"no --eval_dataset: evaluating on the first {held} training samples "
                f"({self.eval_from_train:.0%}, as OpenRLHF)"
            )
        if len(train.samples) < t.train_batch_size:
            raise DataError(
                f"--dataset {d.dataset}: {len(train.samples)} usable samples do not fill one "
                f"--train_batch_size {t.train_batch_size}; lower --train_batch_size or add data"
            )
        sampler = PromptSampler(len(train.samples), t.train_batch_size, t.seed, t.max_epochs)
        total_steps = min(sampler.total_steps, t.max_steps or sampler.total_steps)
        log.info_once(
            f"{len(train.samples)} samples, {total_steps} steps of {t.train_batch_size} "
            f"({sampler.steps_per_episode} per epoch), {started.backend} on {started.device.type}"
        )
        seed_everything(t.seed)
        return Data(tokenizer, train, evals, sampler, total_steps)

    def _read(
        self, cfg: SupervisedConfig, tokenizer: PreTrainedTokenizerBase, path: str, flag: str, log: RankLogger
    ) -> Loaded[S]:
        d = cfg.data
        spec = (
            DataSpec(path, "dataset", d.dataset_split, d.dataset_probs, cfg.train.seed)
            if flag == "--dataset"
            else DataSpec(path, "eval_dataset", d.eval_split, seed=cfg.train.seed)
        )
        loaded = self.load(cfg, tokenizer, spec)
        if loaded.dropped or loaded.truncated:
            log.info_once(
                f"{flag} {path}: {len(loaded.samples)} samples; {loaded.dropped} records dropped and "
                f"{loaded.truncated} truncated at --max_len {cfg.train.max_len}"
            )
        return loaded

    def announce(self, planned: Planned[SupervisedConfig], inputs: Data[S], env: DistEnv) -> list[str]:
        return []

    def build(self, planned: Planned[SupervisedConfig], inputs: Data[S], started: Started) -> Built[Loop[S]]:
        cfg, env = planned.config, started.env
        t = cfg.train
        group = all_ranks_group(cfg.runtime.dist_timeout)
        solo = solo_group(cfg.runtime.dist_timeout) if t.strategy == "deepspeed" else None
        sp = sequence_parallel_groups(t.sequence_parallel_size, cfg.runtime.dist_timeout)
        task = self.build_task(
            cfg,
            BuildContext(
                group, started.device, env.rank, int(inputs.tokenizer.pad_token_id), solo, sp, t.packing_samples
            ),
        )
        # the ranks of a sequence-parallel block train the same samples, a token shard each
        dp_rank, dp_size = env.rank // t.sequence_parallel_size, env.world_size // t.sequence_parallel_size
        updater = Updater(
            task.model,
            task.strategy,
            task.optimizer,
            warmup_cosine(task.optimizer, inputs.total_steps, t.lr_warmup_ratio),
            t.max_norm,
            t.micro_train_batch_size,
            dp_rank,
            dp_size,
            max_nonfinite_in_a_row=t.max_skipped_steps,
            ops=task.strategy.step_ops(task.model),
        )
        loop = Loop(
            task,
            updater,
            inputs.train.samples,
            inputs.evals.samples if inputs.evals else None,
            inputs.sampler,
            inputs.total_steps,
            functools.partial(sum_over, group=group, device=started.comm_device),
            env.rank,
            env.world_size,
            t.micro_train_batch_size,
            cfg.logging.eval_steps,
            started.phase,
            steps_per_epoch=inputs.sampler.steps_per_episode,
            eval_before_train=cfg.logging.eval_before_train,
            sequence_parallel=t.sequence_parallel_size,
        )
        identity = Identity(task.name, t.strategy, "model", task.model, FIXED_ON_RESUME, what=task.name)
        return Built(
            loop, identity, [ModelState(task.strategy, task.model, task.optimizer, "model")], group, [task.model]
        )

    def export(self, planned: Planned[SupervisedConfig], inputs: Data[S], built: Built[Loop[S]]) -> dict[str, str]:
        cfg, task = planned.config, built.job.task
        task.save(
            cfg.checkpoint.save_path,
            inputs.tokenizer,
            is_writer=built.job.rank == 0,
            allow_nonfinite=cfg.checkpoint.export_nonfinite,
            merged=cfg.checkpoint.save_merged,
        )
        saving = cfg.checkpoint
        get_logger(built.job.rank).info_once(f"saved the model {model_form(cfg.model, saving)} to {saving.save_path}")
        return saved_outputs(cfg.model, saving)


# ---- the models -------------------------------------------------------------------------------------------------


def trainable(
    model: nn.Module | Unfilled, source: PretrainedConfig, train: SupervisedTrainConfig, ctx: BuildContext
) -> tuple[nn.Module, torch.optim.Optimizer, Strategy]:
    """(wrapped model, its optimizer, the strategy that steps it) on the all-ranks group. With --lora_rank the model
    gets LoRA adapters first (`with_adapters`): the optimizer then holds the adapters (and a reward model's head)
    only."""
    if (lora := lora_settings(source)) is not None:
        assert isinstance(model, Unfilled), "LoRA adapters are added before the strategy fills the model"
        model = with_adapters(model, lora, source, train.seed, rank=ctx.rank)
    strategy = make_strategy(ctx.group, ctx.device, source, train, ctx.solo)
    wrapped, optimizer = strategy.wrap_trainable(
        model, lambda m: make_optimizer(m, train.learning_rate, train.adam_betas, train.l2)
    )
    return ctx.ulysses(wrapped), optimizer, strategy


def with_adapters(
    model: Unfilled, lora: LoraSettings, source: PretrainedConfig, seed: int, *, rank: int = 0
) -> Unfilled:
    """`model` with PEFT LoRA layers on --target_modules, still unallocated. A reward model's adapters go on its
    transformer body only: its freshly initialised score head stays outside them, trained whole (a rank-r update
    of a random one-row head would not train it), and ScalarHeadModel keeps reading the body's hidden states."""
    scalar = isinstance(model.model, ScalarHeadModel)
    # a policy continues an adapter directory given as --pretrain (trained_policy); a reward model starts afresh
    adapted = (
        add_scalar_adapters(model, lora, seed)
        if scalar
        else trained_policy(cast("Unfilled[PreTrainedModel]", model), source, seed)
    )
    params = list(adapted.model.parameters())  # meta tensors: counting them allocates nothing
    total, trained = sum(p.numel() for p in params), sum(p.numel() for p in params if p.requires_grad)
    get_logger(rank).info_once(
        f"LoRA rank {lora.rank} alpha {lora.alpha:g} on {' '.join(lora.target_modules)}: {trained:,} of {total:,} "
        f"parameters trained ({trained / max(total, 1):.2%}{', the score head whole' if scalar else ''}); the base "
        "weights stay frozen"
    )
    return adapted


def reward_model(source: PretrainedConfig, seed: int) -> Unfilled[ScalarHeadModel]:
    """The model to train as a reward model, unallocated: --pretrain's body (a causal LM or a classifier) with a
    fresh scalar head, identical on every rank."""
    hf = unfilled_scalar_model(source.pretrain, source, seed, fresh_head=True)
    return Unfilled(ScalarHeadModel(hf.model), hf.weights, prefix="hf.")


def dpo_reference(
    model: PretrainedConfig, loss: DPOLossConfig, train: SupervisedTrainConfig, ctx: BuildContext
) -> nn.Module | None:
    """The frozen reference: --ref_pretrain, else the initial policy; --ref_offload keeps its parameters in CPU
    memory between forwards (FSDP2's CPU offload, GPU only). None with LoRA (`reference_is_base`): the DPO task
    scores the reference with the policy's adapters disabled."""
    offload = loss.ref_offload
    log = get_logger(ctx.rank)
    if reference_is_base(model, loss):
        log.info_once(
            "--lora_rank: the reference is the policy's base model with its adapters disabled; no reference "
            "copy is built" + (", so --ref_offload has nothing to offload" if offload else "")
        )
        return None
    # a reference built from a model of its own: never with adapters, it is not trained
    source = dataclasses.replace(model, pretrain=loss.ref_pretrain or model.pretrain, lora_rank=0)
    if model.lora_rank > 0:
        log.info_once(
            f"--lora_rank with --ref_pretrain {loss.ref_pretrain}: a separate frozen reference (a full "
            "copy of that model); drop --ref_pretrain to score with the policy's base instead"
        )
    if offload and ctx.device.type != "cuda":
        log.info_once("--ref_offload: parameters already live in CPU memory on CPU; nothing to offload")
    if offload and train.strategy == "deepspeed":
        log.warning_once(
            "--ref_offload has no effect with --strategy deepspeed yet (its frozen models are ZeRO-0 "
            "inference engines); use --strategy fsdp to offload the reference"
        )
    ref_train: OptimConfig = dataclasses.replace(train, adam_offload=offload and train.strategy == "fsdp")
    strategy = make_strategy(ctx.group, ctx.device, source, ref_train, ctx.solo)
    return ctx.ulysses(strategy.wrap(unfilled_policy(source, train.seed), trainable=False))
