"""What a job reads first, read the way the run reads it: the prompt sets of rlrun.ppo (`ppo_prompts`, which the run
itself uses at start-up) and a supervised trainer's datasets; and --dry_run's preflight over them, so that a bad data
file, key, chat template or reward file fails on the login node (`--dry_run` is the Slurm scripts' preflight) instead
of after the nodes are allocated. Loads no model weights and contacts no server; paths this machine cannot see are
left to planning's warnings.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any, TypeVar

from transformers import PreTrainedTokenizerBase

from rlrun.config.model import PretrainedConfig
from rlrun.config.supervised import SupervisedConfig
from rlrun.config.tree import Config
from rlrun.data.prompts import Prompts, load_prompt_records, prompt_keys, prompt_set
from rlrun.data.sources import DataSpec, not_here
from rlrun.models.architecture import is_vision_language
from rlrun.models.loading import load_model_config, load_tokenizer, model_folder, tokenizer_missing
from rlrun.plan.checks import pure_distillation_line, scores_nothing
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import load_reward_function
from rlrun.runtime.errors import ConfigError, DataError
from rlrun.vision.inputs import ImageInputs

SHOWN_CHARS = 400  # of the first rendered prompt
S = TypeVar("S")


# ---- rlrun.ppo's prompts ----------------------------------------------------------------------------------------


def prompt_spec(cfg: Config) -> DataSpec | None:
    """--prompt_data's sources (None: the built-in prompts)."""
    d = cfg.data
    return (
        None
        if d.prompt_data is None
        else DataSpec(d.prompt_data, "prompt_data", d.prompt_split, d.prompt_data_probs, cfg.train.seed)
    )


def eval_spec(cfg: Config) -> DataSpec | None:
    e = cfg.eval
    return (
        None if e.eval_dataset is None else DataSpec(e.eval_dataset, "eval_dataset", e.eval_split, seed=cfg.train.seed)
    )


def ppo_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase, spec: DataSpec | None) -> Prompts:
    """`spec`'s prompts as the policy sees them, with a vision-language policy's image preprocessing."""
    return prompt_set(
        cfg.data,
        cfg.template,
        cfg.vision,
        cfg.generation,
        tokenizer,
        spec,
        cfg.train.max_samples,
        image_inputs(cfg),
        policy=str(cfg.model.pretrain or cfg.model.model_preset),
    )


def ppo_eval_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """--eval_dataset, read, formatted and cut like the training prompts (--max_samples too, as OpenRLHF does)."""
    assert cfg.eval.eval_dataset is not None
    prompts = ppo_prompts(cfg, tokenizer, eval_spec(cfg))
    if not prompts.ids:
        raise DataError(
            f"every prompt of --eval_dataset {cfg.eval.eval_dataset} is longer than --prompt_max_len "
            f"{cfg.generation.prompt_max_len} and was dropped (--prompt_overflow drop); raise "
            "--prompt_max_len or use --prompt_overflow truncate"
        )
    return prompts


def image_inputs(cfg: Config) -> ImageInputs | None:
    """A vision-language policy's image preprocessing; None for a text policy."""
    config = load_model_config(cfg.model)
    if not is_vision_language(config):
        return None
    v = cfg.vision
    assert cfg.model.pretrain is not None  # the embedded models are text-only
    return ImageInputs(model_folder(cfg.model.pretrain, "pretrain"), config, v.min_pixels, v.max_pixels)


def preflight(cfg: Config) -> list[str]:
    """rlrun.ppo's --dry_run: one line per thing checked (raises the run's own DataError/ConfigError/RewardError on
    what would fail)."""
    lines = []
    missing = tokenizer_missing(cfg.model)
    tokenizer = load_tokenizer(cfg.model) if missing is None else None
    sets = [prompt_spec(cfg)] + ([eval_spec(cfg)] if cfg.eval.eval_dataset is not None else [])
    for spec in sets:
        name = f"--{spec.flag} {spec.sources}" if spec is not None else "built-in prompts"
        if spec is not None and (elsewhere := not_here(spec.sources)):
            lines.append(f"{name}: not read ({', '.join(elsewhere)} is not on this machine)")
            continue
        if tokenizer is None:
            records = load_prompt_records(spec, prompt_keys(cfg.data), cfg.train.max_samples)
            lines.append(
                f"{name}: {len(records)} records read (not rendered: {missing}, so neither is its tokenizer "
                "or chat template)"
            )
            continue
        prompts = ppo_prompts(cfg, tokenizer, spec)
        first = prompts.texts[0] if prompts.texts else ""
        shown = first if len(first) <= SHOWN_CHARS else first[:SHOWN_CHARS] + f"... ({len(first)} chars)"
        lines.append(
            f"{name}: {len(prompts.ids)} prompts ({prompts.truncated} truncated, {prompts.dropped} dropped at "
            f"--prompt_max_len {cfg.generation.prompt_max_len}); the first as the policy sees it: {shown!r}; "
            f"its label: {prompts.labels[0]!r}"
            if prompts.ids
            else f"{name}: no prompt left"
        )
    if cfg.distill.teacher_pretrain is not None and tokenizer is not None:
        if (unread := tokenizer_missing(teacher_source(cfg))) is None:
            check_teacher_tokenizer(cfg, tokenizer)
            lines.append(f"--teacher_pretrain {cfg.distill.teacher_pretrain}: reads the policy's token ids as it does")
        else:
            lines.append(f"--teacher_pretrain {cfg.distill.teacher_pretrain}: tokenizer not checked ({unread})")
    lines.append(_reward_line(cfg))
    return lines


def teacher_source(cfg: Config) -> PretrainedConfig:
    """Where --teacher_pretrain's model comes from, run as the policy runs (dtype, attention) without adapters."""
    return dataclasses.replace(cfg.model, pretrain=cfg.distill.teacher_pretrain, lora_rank=0)


def check_teacher_tokenizer(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> None:
    """The teacher scores the policy's token ids, so it must read every id the policy can sample as the same token,
    and end and pad responses alike. Not the configs' vocab_size, which pads differently across one family's sizes
    (Qwen2.5-1.5B 151936, 7B 152064) with the same tokenizer; tokens past the policy's embedding rows (a tokenizer's
    added unk, say) are never sampled and do not matter."""
    teacher = teacher_source(cfg)
    theirs = load_tokenizer(teacher)
    sampled = load_model_config(cfg.model).get_text_config().vocab_size
    mine, other = tokenizer.get_vocab(), theirs.get_vocab()
    differ = [token for token, i in mine.items() if i < sampled and other.get(token) != i]
    ends = [
        name
        for name in ("eos_token_id", "pad_token_id")
        if getattr(tokenizer, name) is not None and getattr(tokenizer, name) != getattr(theirs, name)
    ]
    if differ or ends:
        what = f"{len(differ)} of the policy's tokens (e.g. {differ[0]!r}) have other ids" if differ else ""
        what += (" and " if what and ends else "") + (f"{'/'.join(ends)} differ" if ends else "")
        raise ConfigError(
            f"--teacher_pretrain {cfg.distill.teacher_pretrain}'s tokenizer is not the policy's ({what}); the teacher "
            "scores the policy's token ids, so it needs the same tokenizer (distillation across tokenizers is not "
            "implemented)"
        )
    rows = load_model_config(teacher).get_text_config().vocab_size
    if rows < sampled:
        raise ConfigError(
            f"--teacher_pretrain {cfg.distill.teacher_pretrain} has {rows} embedding rows for the policy's {sampled}; "
            "it cannot score every id the policy may sample"
        )


def _reward_line(cfg: Config) -> str:
    m = cfg.reward
    if m.needs_reward_model:
        return f"reward: the reward model --reward_pretrain {m.reward_pretrain}"
    if scores_nothing(cfg):
        return pure_distillation_line(cfg)
    if cfg.agent.multi_turn:
        return "reward: from the agent's episodes (the agent file is imported at start-up)"
    path = m.compute_score if m.compute_score is not None else m.remote_rm_url
    if path is not None and path.endswith(".py") and not os.path.exists(path):
        return f"reward: {path} is not on this machine (imported at start-up)"
    if m.compute_score is not None:
        fn = load_compute_score_function(m.compute_score, m.compute_score_name, workers=1)
    else:
        fn = load_reward_function(m.remote_rm_url, timeout_s=m.remote_rm_timeout, retries=m.remote_rm_retries)
    return f"reward: {fn.source} (imported; a server is not contacted by --dry_run)"


# ---- the supervised trainers' datasets --------------------------------------------------------------------------


def supervised_tokenizer(cfg: SupervisedConfig) -> PreTrainedTokenizerBase:
    """--pretrain's tokenizer, with --tokenizer_chat_template in place of its own when given."""
    tokenizer = load_tokenizer(cfg.model)
    if cfg.data.tokenizer_chat_template is not None:
        tokenizer.chat_template = cfg.data.tokenizer_chat_template
    return tokenizer


def supervised_preflight(cfg: SupervisedConfig, read: Callable[[PreTrainedTokenizerBase, str, str], Any]) -> list[str]:
    """A supervised trainer's --dry_run: each dataset read and tokenized as training will (`read(tokenizer, path,
    flag)`: the trainer's loader), its first sample shown as the model sees it (as rlrun.ppo's preflight); no model
    weights, no process group. Paths this machine lacks are only named."""
    if (missing := tokenizer_missing(cfg.model)) is not None:
        return [f"data not read: {missing}, so neither is its tokenizer"]
    tokenizer = supervised_tokenizer(cfg)
    lines = []
    for flag, path in (("--dataset", cfg.data.dataset), ("--eval_dataset", cfg.data.eval_dataset)):
        if path is None:
            continue
        if elsewhere := not_here(path):
            lines.append(f"{flag} {path}: not read ({', '.join(elsewhere)} is not on this machine)")
            continue
        loaded = read(tokenizer, path, flag)
        first = (
            {
                k: tokenizer.decode(v) if isinstance(v, list) else v
                for k, v in dataclasses.asdict(loaded.samples[0]).items()
            }
            if loaded.samples
            else {}
        )
        lines.append(
            f"{flag} {path}: {len(loaded.samples)} samples ({loaded.dropped} dropped, {loaded.truncated} "
            f"truncated at --max_len {cfg.train.max_len}); the first as the model sees it: {first}"
        )
    return lines
