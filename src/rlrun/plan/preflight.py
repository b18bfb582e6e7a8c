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

from rlrun.config.supervised import SupervisedConfig
from rlrun.config.tree import Config
from rlrun.data.prompts import Prompts, eval_spec, load_prompt_records, prompt_keys, prompt_set, prompt_spec
from rlrun.data.sources import DataSpec, not_here
from rlrun.data.tasksets import taskset_records
from rlrun.models.loading import check_teacher_tokenizer, load_tokenizer, teacher_source, tokenizer_missing
from rlrun.reporting.run_report import pure_distillation_line
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import load_reward_function
from rlrun.runtime.errors import DataError
from rlrun.vision.inputs import image_inputs

SHOWN_CHARS = 400  # of the first rendered prompt
S = TypeVar("S")


# ---- rlrun.ppo's prompts ----------------------------------------------------------------------------------------


def ppo_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase, spec: DataSpec | None) -> Prompts:
    """`spec`'s prompts as the policy sees them, with a vision-language policy's image preprocessing; with --env_id,
    the taskset's tasks."""
    a = cfg.agent
    records = None
    if a.env_id is not None and spec is None:  # the training prompts (an --eval_dataset is still a file)
        records = taskset_records(a.env_id, a.env_args, a.env_harness, a.max_turns, cfg.train.max_samples)
    elif a.environment_factory is not None:  # reset(**row) reads every column
        keys = dataclasses.replace(prompt_keys(cfg.data), columns=True)
        records = load_prompt_records(spec, keys, cfg.train.max_samples)
    return prompt_set(
        cfg.data,
        cfg.template,
        cfg.vision,
        cfg.generation,
        tokenizer,
        spec,
        cfg.train.max_samples,
        image_inputs(cfg.model, cfg.vision),
        policy=str(cfg.model.pretrain or cfg.model.model_preset),
        records=records,
    )


def ppo_eval_prompts(cfg: Config, tokenizer: PreTrainedTokenizerBase) -> Prompts:
    """--eval_dataset, read, formatted and cut like the training prompts (--max_samples too, as OpenRLHF does)."""
    assert cfg.eval.eval_dataset is not None
    prompts = ppo_prompts(cfg, tokenizer, eval_spec(cfg.eval, cfg.train.seed))
    if not prompts.ids:
        raise DataError(
            f"every prompt of --eval_dataset {cfg.eval.eval_dataset} is longer than --prompt_max_len "
            f"{cfg.generation.prompt_max_len} and was dropped (--prompt_overflow drop); raise "
            "--prompt_max_len or use --prompt_overflow truncate"
        )
    return prompts


def preflight(cfg: Config) -> list[str]:
    """rlrun.ppo's --dry_run: one line per thing checked (raises the run's own DataError/ConfigError/RewardError on
    what would fail)."""
    lines = []
    missing = tokenizer_missing(cfg.model)
    tokenizer = load_tokenizer(cfg.model) if missing is None else None
    seed = cfg.train.seed
    sets = [prompt_spec(cfg.data, seed)] + ([eval_spec(cfg.eval, seed)] if cfg.eval.eval_dataset is not None else [])
    a = cfg.agent
    for spec in sets:
        tasks = spec is None and a.env_id is not None
        name = (
            f"--{spec.flag} {spec.sources}"
            if spec is not None
            else f"--env_id {a.env_id}"
            if tasks
            else "built-in prompts"
        )
        if spec is not None and (elsewhere := not_here(spec.sources)):
            lines.append(f"{name}: not read ({', '.join(elsewhere)} is not on this machine)")
            continue
        if tokenizer is None:
            records = (
                taskset_records(a.env_id, a.env_args, a.env_harness, a.max_turns, cfg.train.max_samples)
                if tasks and a.env_id is not None
                else load_prompt_records(spec, prompt_keys(cfg.data), cfg.train.max_samples)
            )
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
    if (teacher := cfg.distill.teacher_pretrain) is not None and tokenizer is not None:
        if (unread := tokenizer_missing(teacher_source(cfg.model, teacher))) is None:
            check_teacher_tokenizer(cfg.model, teacher, tokenizer)
            lines.append(f"--teacher_pretrain {cfg.distill.teacher_pretrain}: reads the policy's token ids as it does")
        else:
            lines.append(f"--teacher_pretrain {cfg.distill.teacher_pretrain}: tokenizer not checked ({unread})")
    lines.append(_reward_line(cfg))
    if (gateway := _gateway_line(cfg)) is not None:
        lines.append(gateway)
    return lines


def _gateway_line(cfg: Config) -> str | None:
    """Where the token gateway listens and what it holds, for the sources that sample through it."""
    a, g = cfg.agent, cfg.generation
    if a.gateway_source is None:
        return None
    where = f"port {a.gateway_port} + its engine number" if a.gateway_port else "a free port"
    return (
        f"token gateway: each engine rank serves vLLM's and OpenAI's API on {a.gateway_host}, {where}, while its "
        f"rollouts run (model calls of at most {a.max_tokens_per_turn or g.generate_max_len} new tokens at "
        f"--temperature {g.temperature:g} --top_p {g.top_p:g}); each episode's calls are kept as ids and log-probs "
        "until its row is built (the memory plan's host `gateway` part)"
    )


def _reward_line(cfg: Config) -> str:
    m = cfg.reward
    if m.needs_reward_model:
        return f"reward: the reward model --reward_pretrain {m.reward_pretrain}"
    if cfg.scores_nothing:
        return pure_distillation_line(cfg.distill.teacher_pretrain)
    if cfg.agent.agent_command is not None:
        added = " + the reward function" if m.names_reward_function else ""
        return f"reward: what each episode's --agent_command prints{added} (programs start with the first rollouts)"
    if cfg.agent.env_id is not None:
        return f"reward: the rubric of the verifiers taskset --env_id {cfg.agent.env_id}"
    if cfg.agent.openenv_url is not None:
        return "reward: the OpenEnv server's step rewards (the server is contacted when the run starts)"
    if cfg.agent.openenv_app is not None:
        return f"reward: the step rewards of --openenv_app {cfg.agent.openenv_app} (each engine rank starts one)"
    if cfg.agent.environment_factory is not None:
        added = " + the reward function" if m.names_reward_function else ""
        spec = cfg.agent.environment_factory
        return f"reward: get_reward() of --environment_factory {spec}{added} (imported at start-up)"
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


def supervised_preflight(cfg: SupervisedConfig, read: Callable[[PreTrainedTokenizerBase, str, str], Any]) -> list[str]:
    """A supervised trainer's --dry_run: each dataset read and tokenized as training will (`read(tokenizer, path,
    flag)`: the trainer's loader), its first sample shown as the model sees it (as rlrun.ppo's preflight); no model
    weights, no process group. Paths this machine lacks are only named."""
    if (missing := tokenizer_missing(cfg.model)) is not None:
        return [f"data not read: {missing}, so neither is its tokenizer"]
    tokenizer = load_tokenizer(cfg.model, cfg.data.tokenizer_chat_template)
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
