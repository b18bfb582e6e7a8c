"""The compatibility status table (docs/compat.md) generated from rlrun's flag tables:
`python scripts/compat_report.py > docs/compat.md` (after adding or changing a spelling in src/rlrun/compat/).

A docs generator, outside the package: it reads every entry point's command line, which no module of rlrun may
import (tests/test_package_layout.py)."""

from __future__ import annotations

import inspect
from collections.abc import Mapping

from rlrun.cli.parser import IGNORED_FLAGS, NO_EFFECT_YET, PPO_CLI, CliSpec
from rlrun.compat import verl_keys as verl
from rlrun.compat.argv import CHANGES_TRAINING, NOT_YET
from rlrun.compat.openrlhf_flags import ByValue, Ignored, Same, resolve
from rlrun.compat.verl_overrides import GROUP_RULES
from rlrun.config.fields import fields_of
from rlrun.config.tree import Config
from rlrun.dpo import CLI as DPO_CLI
from rlrun.rm import CLI as RM_CLI
from rlrun.sft import CLI as SFT_CLI

GROUP_FIELDS = {
    "kl": "use_kl_loss, init_kl_coef, kl_estimator, kl_target, kl_horizon",
    "batch": "n_samples_per_prompt, train_batch_size",
    "micro": "micro_train_batch_size, micro_rollout_batch_size",
    "estimator": "advantage_estimator",
    "data": "prompt_data, input_key, label_key, data_source_key, "
    "reward_pretrain, compute_score, compute_score_name, "
    "retriever_url",
    "clip": "eps_clip, eps_clip_low_high",
    "turns": "prompt_max_len, generate_max_len, max_turns, max_tokens_per_turn, max_obs_len",
    "lora": "lora_rank, lora_alpha, target_modules",
    "cov": "clip_cov_bounds",
    "distill": "teacher_pretrain, teacher_kl_estimator, teacher_kl_loss, distill_task_reward, teacher_kl_coef, "
    "teacher_kl_clamp, teacher_num_nodes, teacher_num_gpus_per_node",
    "sp": "sequence_parallel_size, ref_sequence_parallel_size, critic_sequence_parallel_size",
}


def _field_status(field: str, no_effect: Mapping[str, str] = NO_EFFECT_YET) -> str:
    if field in no_effect:
        return f"accepted as `--{field}`, no effect yet ({no_effect[field]})"
    return f"supported: `--{field}`"


def _refusal(*names: str) -> str | None:
    """The status of a flag/key rlrun refuses (reasons.CHANGES_TRAINING) under any of its spellings, else None."""
    why = next((CHANGES_TRAINING[n] for n in names if n in CHANGES_TRAINING), None)
    return None if why is None else f"refused at start-up unless its value asks for nothing ({why})"


def openrlhf_rows(spec: CliSpec = PPO_CLI) -> list[tuple[str, str]]:
    """One row per OpenRLHF 0.11 dotted flag of the trainer `spec` stands for."""
    fields = fields_of(spec.config_cls)
    rows = []
    for name in spec.dotted:
        meaning = resolve(name, fields, spec.ignored, spec.dotted)
        if isinstance(meaning, Same):
            status = _field_status(meaning.field, spec.no_effect)
        elif isinstance(meaning, ByValue):
            accepted = "; ".join(
                f"`{v}` -> `{' '.join(t) or '(nothing: rlrun default)'}`" for v, t in meaning.tokens.items()
            )
            status = f"supported: {accepted}; other values rejected ({meaning.fix})"
        else:
            assert isinstance(meaning, Ignored)
            original = spec.dotted[name]
            via = f"; classic flag `--{original.field}`" if isinstance(original, Same) else ""
            classic = original.field if isinstance(original, Same) else name
            status = (_refusal(name, classic) or f"ignored ({meaning.reason})") + via
        rows.append((f"`--{name}`", status))
    return rows


def _first_line(doc: str | None) -> str:
    return " ".join((doc or "").strip().split("\n\n")[0].split())


def verl_rows() -> list[tuple[str, str]]:
    fields = fields_of(Config)
    rows = []
    for key, meaning in verl.VERL_KEYS.items():
        if isinstance(meaning, verl.To):
            if meaning.field in fields:
                status = _field_status(meaning.field)
                if meaning.convert is not None:
                    status += f" ({_first_line(meaning.convert.__doc__)})"
            else:
                reason = IGNORED_FLAGS[meaning.field][1] if meaning.field in IGNORED_FLAGS else NOT_YET
                status = (_refusal(key, meaning.field) or f"ignored ({reason})") + f"; would set `--{meaning.field}`"
        elif isinstance(meaning, verl.GroupInput):
            rule = GROUP_RULES[meaning.group]
            status = (
                f"supported, with related keys -> {GROUP_FIELDS[meaning.group]}: {_first_line(inspect.getdoc(rule))}"
            )
        elif isinstance(meaning, verl.Expand):
            status = f"supported: {_first_line(inspect.getdoc(meaning.rule))}"
        elif isinstance(meaning, verl.Skip):
            status = _refusal(key) or f"ignored ({meaning.reason.format(world_size='N')})"
        else:
            status = f"rejected: {meaning.fix}"
        rows.append((f"`{key}`", status))
    for segment, reason in verl.SKIPPED_SUBTREES.items():
        rows.append((f"any key with a `{segment}` part", f"ignored ({reason})"))
    return rows


def markdown() -> str:
    def table(rows: list[tuple[str, str]], head: str) -> str:
        return "\n".join([f"| {head} | status |", "|---|---|", *(f"| {a} | {b.replace('|', '/')} |" for a, b in rows)])

    return (
        "\n\n".join(
            [
                "### OpenRLHF 0.11.2 dotted flags (`train_ppo_ray.py`)",
                table(openrlhf_rows(), "flag"),
                "### verl / Search-R1 overrides (`key=value`)",
                table(verl_rows(), "key"),
                *(
                    part
                    for title, spec in (
                        ("train_sft.py` -> `rlrun.sft", SFT_CLI),
                        ("train_rm.py` -> `rlrun.rm", RM_CLI),
                        ("train_dpo.py` -> `rlrun.dpo", DPO_CLI),
                    )
                    for part in (f"### OpenRLHF 0.11.2 dotted flags (`{title}`)", table(openrlhf_rows(spec), "flag"))
                ),
            ]
        )
        + "\n"
    )


if __name__ == "__main__":
    print(markdown(), end="")
