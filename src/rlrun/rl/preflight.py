"""--dry_run's preflight: what a job reads and calls first, read and resolved now, so that a bad data file, key,
chat template or reward file fails on the login node (`--dry_run` is the Slurm scripts' preflight) instead of after
the nodes are allocated. Loads no model weights and contacts no server; paths this machine cannot see are left
to planning's warnings."""

from __future__ import annotations

import os

from rlrun.config.schema import Config
from rlrun.data.prompts import load_prompt_records
from rlrun.data.sources import not_here
from rlrun.models.loading import load_tokenizer, tokenizer_missing
from rlrun.rewards.compute_score import load_compute_score_function
from rlrun.rewards.reward_fn import load_reward_function
from rlrun.rl.build import eval_spec, prompt_keys, prompt_set, prompt_spec

SHOWN_CHARS = 400  # of the first rendered prompt


def preflight(cfg: Config) -> list[str]:
    """One line per thing checked (raises the run's own DataError/ConfigError/RewardError on what would fail)."""
    lines = []
    missing = tokenizer_missing(cfg.model)
    tokenizer = load_tokenizer(cfg.model) if missing is None else None
    sets = [prompt_spec(cfg)] + ([eval_spec(cfg)] if cfg.logging.eval_dataset is not None else [])
    for spec in sets:
        name = f"--{spec.flag} {spec.sources}" if spec is not None else "built-in prompts"
        if spec is not None and (elsewhere := not_here(spec.sources)):
            lines.append(f"{name}: not read ({', '.join(elsewhere)} is not on this machine)")
            continue
        if tokenizer is None:
            records = load_prompt_records(spec, prompt_keys(cfg), cfg.train.max_samples)
            lines.append(f"{name}: {len(records)} records read (not rendered: {missing}, so neither is its tokenizer "
                         "or chat template)")
            continue
        prompts = prompt_set(cfg, tokenizer, spec)
        first = prompts.texts[0] if prompts.texts else ""
        shown = first if len(first) <= SHOWN_CHARS else first[:SHOWN_CHARS] + f"... ({len(first)} chars)"
        lines.append(f"{name}: {len(prompts.ids)} prompts ({prompts.truncated} truncated, {prompts.dropped} dropped at "
                     f"--prompt_max_len {cfg.generation.prompt_max_len}); the first as the policy sees it: {shown!r}; "
                     f"its label: {prompts.labels[0]!r}" if prompts.ids else f"{name}: no prompt left")
    lines.append(_reward_line(cfg))
    return lines


def _reward_line(cfg: Config) -> str:
    m = cfg.model
    if cfg.needs_reward_model:
        return f"reward: the reward model --reward_pretrain {m.reward_pretrain}"
    if cfg.multi_turn:
        return "reward: from the agent's episodes (the agent file is imported at start-up)"
    path = m.compute_score if m.compute_score is not None else m.remote_rm_url
    if path is not None and path.endswith(".py") and not os.path.exists(path):
        return f"reward: {path} is not on this machine (imported at start-up)"
    if m.compute_score is not None:
        fn = load_compute_score_function(m.compute_score, m.compute_score_name, workers=1)
    else:
        fn = load_reward_function(m.remote_rm_url, timeout_s=m.remote_rm_timeout, retries=m.remote_rm_retries)
    return f"reward: {fn.source} (imported; a server is not contacted by --dry_run)"
