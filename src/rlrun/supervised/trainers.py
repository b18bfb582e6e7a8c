"""rlrun.sft's, rlrun.rm's and rlrun.dpo's trainers for the run skeleton: how each reads its data files and builds its
task (the loop, the update and the checkpoints are rlrun.supervised.assembly's, shared). Imported by the entry modules
only after the plan holds, as rlrun.ppo imports its assembly."""

from __future__ import annotations

from typing import Any, cast

from transformers import PreTrainedTokenizerBase

from rlrun.config.supervised import DPOConfig, RMConfig, SFTConfig
from rlrun.data.sources import DataSpec
from rlrun.models.loading import ScalarHeadModel, unfilled_policy
from rlrun.plan.shapes import SupervisedJob
from rlrun.supervised.assembly import BuildContext, Supervised, dpo_reference, reward_model, trainable
from rlrun.supervised.datasets import Completion, Loaded, PairTask, Preference, load_completions, load_preferences
from rlrun.supervised.tasks import DPOSettings, DPOTask, RewardModelTask, SFTTask

# ---- rlrun.sft: prompt -> response records, the NLL of the response tokens --------------------------------------


def load_sft(cfg: SFTConfig, tokenizer: PreTrainedTokenizerBase, path: str | DataSpec) -> Loaded[Completion]:
    d = cfg.data
    return load_completions(
        path,
        tokenizer,
        input_key=d.input_key,
        output_key=d.output_key,
        input_template=cfg.template.input_template,
        apply_chat_template=cfg.template.apply_chat_template,
        pretrain_mode=d.pretrain_mode,
        max_len=cfg.train.max_len,
        max_samples=cfg.train.max_samples,
    )


def build_sft(cfg: SFTConfig, ctx: BuildContext) -> SFTTask:
    model, optimizer, strategy = trainable(unfilled_policy(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    return SFTTask(
        model,
        optimizer,
        strategy,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        ctx.sp,
        aux_loss_coef=cfg.loss.aux_loss_coef,
    )


# ---- rlrun.rm and rlrun.dpo: preference pairs -------------------------------------------------------------------


def load_pairs(
    cfg: RMConfig | DPOConfig, tokenizer: PreTrainedTokenizerBase, path: str | DataSpec, task: PairTask = "reward_model"
) -> Loaded[Preference]:
    """Preference pairs with the trainer's keys (rlrun.rm, and rlrun.dpo with task "dpo")."""
    d = cfg.data
    return load_preferences(
        path,
        tokenizer,
        prompt_key=d.prompt_key,
        chosen_key=d.chosen_key,
        rejected_key=d.rejected_key,
        input_template=cfg.template.input_template,
        apply_chat_template=cfg.template.apply_chat_template,
        max_len=cfg.train.max_len,
        max_samples=cfg.train.max_samples,
        task=task,
    )


def build_rm(cfg: RMConfig, ctx: BuildContext) -> RewardModelTask:
    model, optimizer, strategy = trainable(reward_model(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    return RewardModelTask(
        cast(ScalarHeadModel, model),  # reward_model()'s, wrapped: a DeepSpeed engine forwards its attributes
        optimizer,
        strategy,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        cfg.loss.loss,
        cfg.loss.margin_loss,
        ctx.sp,
    )


def build_dpo(cfg: DPOConfig, ctx: BuildContext) -> DPOTask:
    model, optimizer, strategy = trainable(unfilled_policy(cfg.model, cfg.train.seed), cfg.model, cfg.train, ctx)
    reference = dpo_reference(cfg.model, cfg.loss, cfg.train, ctx)
    loss = cfg.loss
    return DPOTask(
        model,
        optimizer,
        strategy,
        reference,
        ctx.device,
        ctx.pad_id,
        cfg.train.packing_samples,
        DPOSettings(loss.beta, loss.label_smoothing, loss.ipo, loss.nll_loss_coef),
        ctx.sp,
    )


SFT: Supervised[Any] = Supervised(load_sft, build_sft, SupervisedJob())
# OpenRLHF's reward-model trainer evaluates on 1% of the training pairs without --eval_dataset (the mean/std it saves)
RM: Supervised[Any] = Supervised(load_pairs, build_rm, SupervisedJob(pairs=True, scalar=True), eval_from_train=0.01)
DPO: Supervised[Any] = Supervised(
    lambda cfg, tok, path: load_pairs(cfg, tok, path, "dpo"), build_dpo, SupervisedJob(pairs=True, reference=True)
)
