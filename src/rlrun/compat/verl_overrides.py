"""verl (and Search-R1) Hydra overrides -> rlrun's flags: ``python -m rlrun.ppo data.train_batch_size=512 ...``.

A bare ``key=value`` token (no leading ``--``; Hydra's ``+``/``++`` prefixes allowed) is a verl override; what
each key means is the table in ``rlrun.compat.verl_keys``. Any key that is neither there nor under a skipped
subtree is rejected with a suggestion. Keys that are parts of one setting (``GroupInput``) are combined here by the
rules over several keys.

``translate`` replaces each override by ``--field=value`` tokens at its own position (a group's tokens go
where its last key was), so overrides and flags combine with one rule: later on the command line wins.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, get_args

import yaml

from rlrun.compat.argv import NOT_YET, Nargs, refused, split_override, take_values
from rlrun.compat.verl_keys import (
    DL,
    ESTIMATORS,
    REF,
    TEACHER,
    VERL_KEYS,
    A,
    C,
    D,
    Expand,
    Group,
    GroupInput,
    R,
    Reject,
    Skip,
    To,
    as_bool,
    as_int,
    kl_type,
    meaning_of,
    source_list,
)
from rlrun.config.fields import FieldInfo, coerce, suggest
from rlrun.runtime.errors import ConfigError

# --- rules over several keys -------------------------------------------------------------------------------------

Assignment = tuple[str, Any]  # (rlrun field, value)


@dataclass(frozen=True)
class Default:
    """What verl assumes when a key is not given (its yaml defaults): applied below YAML and flags, and not at all
    when any field of `unless` is set (a reward source the user named replaces verl's default scorer)."""

    field: str
    value: Any
    unless: frozenset[str] = frozenset()


def _kl(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """verl: KL as a loss (actor.use_kl_loss) and/or in the reward (algorithm.use_kl_in_reward, default false).

    Search-R1's older verl has no use_kl_in_reward and always puts kl_ctrl.kl_coef in the reward unless
    use_kl_loss; so kl_coef given without use_kl_in_reward turns the reward penalty on.
    """
    use_loss = as_bool(v.get(A + "use_kl_loss", False), A + "use_kl_loss")
    in_reward_set = "algorithm.use_kl_in_reward" in v
    in_reward = (
        as_bool(v["algorithm.use_kl_in_reward"], "algorithm.use_kl_in_reward")
        if in_reward_set
        else ("algorithm.kl_ctrl.kl_coef" in v and not use_loss)
    )
    if use_loss and in_reward:
        raise ConfigError(
            "actor_rollout_ref.actor.use_kl_loss=True and algorithm.use_kl_in_reward=True: rlrun puts "
            "the KL either in the loss or in the reward; set one of them to False"
        )
    out: list[Assignment] = []
    if A + "use_kl_loss" in v:
        out.append(("use_kl_loss", use_loss))
    if use_loss:
        out.append(("init_kl_coef", v.get(A + "kl_loss_coef", 0.001)))
        out.append(("kl_estimator", kl_type(v.get(A + "kl_loss_type", "low_var_kl"), A + "kl_loss_type")))
    elif in_reward:
        out.append(("init_kl_coef", v.get("algorithm.kl_ctrl.kl_coef", 0.001)))
        out.append(("kl_estimator", kl_type(v.get("algorithm.kl_penalty", "kl"), "algorithm.kl_penalty")))
        kind = v.get("algorithm.kl_ctrl.type", "fixed")
        if kind not in ("fixed", "adaptive"):
            raise ConfigError(f"algorithm.kl_ctrl.type={kind}: use fixed or adaptive")
        if "algorithm.kl_ctrl.type" in v:
            out.append(("kl_target", v.get("algorithm.kl_ctrl.target_kl", 0.1) if kind == "adaptive" else None))
        if kind == "adaptive":
            out.append(("kl_horizon", v.get("algorithm.kl_ctrl.horizon", 10000)))
    elif in_reward_set:  # verl with both off: no KL at all
        out.append(("init_kl_coef", 0.0))
    return out


def _batch(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """Samples per prompt = rollout.n (x Search-R1's n_agent); verl's mini batch counts prompts: x rollout.n."""
    n = as_int(v.get(R + "n", 1), R + "n")
    out: list[Assignment] = []
    if R + "n" in v or R + "n_agent" in v:
        out.append(("n_samples_per_prompt", n * as_int(v.get(R + "n_agent", 1), R + "n_agent")))
    if A + "ppo_mini_batch_size" in v:
        out.append(("train_batch_size", as_int(v[A + "ppo_mini_batch_size"], A + "ppo_mini_batch_size") * n))
    return out


def _micro(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """verl's deprecated global micro batch sizes are split over all ranks (verl puts every role on every GPU)."""
    out: list[Assignment] = []
    for key, target in (
        (A + "ppo_micro_batch_size", "micro_train_batch_size"),
        (R + "log_prob_micro_batch_size", "micro_rollout_batch_size"),
    ):
        if key in v:
            total = as_int(v[key], key)
            if total < world_size or total % world_size:
                raise ConfigError(
                    f"{key}={total} is a global micro batch size; it must be a multiple of the "
                    f"{world_size} launched ranks (or use {key}_per_gpu)"
                )
            out.append((target, total // world_size))
    return out


def _estimator(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """gae; grpo -> group_norm (dr_grpo with norm_adv_by_std_in_grpo=False); reinforce_plus_plus(_baseline); rloo."""
    if "algorithm.adv_estimator" not in v:
        return []  # norm_adv_by_std_in_grpo alone changes nothing outside GRPO
    name = str(v["algorithm.adv_estimator"])
    norm = as_bool(v.get("algorithm.norm_adv_by_std_in_grpo", True), "algorithm.norm_adv_by_std_in_grpo")
    if name not in ESTIMATORS:
        raise ConfigError(
            f"algorithm.adv_estimator={name}: rlrun implements {', '.join(ESTIMATORS)}{suggest(name, ESTIMATORS)}"
        )
    if name == "grpo" and not norm:  # Dr. GRPO: group mean subtracted, no division by the std
        return [("advantage_estimator", "dr_grpo")]
    return [("advantage_estimator", ESTIMATORS[name])]


REWARD_SOURCE_FIELDS = frozenset(
    {"reward_pretrain", "remote_rm_url", "compute_score", "agent_func_path", "retriever_url"}
)


def _data(v: Mapping[str, Any], world_size: int) -> list[Assignment | Default]:
    """verl's data and reward source, with verl's defaults whenever verl's data is named (data.train_files): the
    prompt is the `prompt` column (data.prompt_key), the label `reward_model.ground_truth`, the data source
    `data_source` (data.reward_fn_key), and the reward, in verl's order: a reward model when reward_model.enable
    (its score replaces the rule scores), else custom_reward_function.path, else verl's default per-data-source
    rule scores (--compute_score builtin). Search-R1's retriever.url makes the run an agent run, whose exact-match
    reward replaces the others."""
    out: list[Assignment | Default] = []
    if "retriever.url" in v:
        out.append(("retriever_url", v["retriever.url"]))
    if "data.prompt_key" in v:
        out.append(("input_key", v["data.prompt_key"]))
    if "data.reward_fn_key" in v:
        out.append(("data_source_key", v["data.reward_fn_key"]))
    if "data.train_files" in v:
        out += [
            ("prompt_data", source_list(v["data.train_files"], "data.train_files")),
            Default("input_key", "prompt"),
            Default("label_key", "reward_model.ground_truth"),
        ]
    enabled = as_bool(v.get("reward_model.enable", False), "reward_model.enable")
    if enabled:
        if "reward_model.model.path" not in v:
            raise ConfigError("reward_model.enable=True needs reward_model.model.path")
        out.append(("reward_pretrain", v["reward_model.model.path"]))
    elif "custom_reward_function.path" in v and v["custom_reward_function.path"] is not None:
        out.append(("compute_score", v["custom_reward_function.path"]))
    elif "data.train_files" in v:
        out.append(Default("compute_score", "builtin", REWARD_SOURCE_FIELDS))
    if "custom_reward_function.name" in v:
        out.append(("compute_score_name", v["custom_reward_function.name"]))
    return out


def _clip(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """clip_ratio_low/high default to clip_ratio (verl); rlrun: --eps_clip and --eps_clip_low_high."""
    clip = v.get(A + "clip_ratio", 0.2)
    out: list[Assignment] = [("eps_clip", clip)] if A + "clip_ratio" in v else []
    if A + "clip_ratio_low" in v or A + "clip_ratio_high" in v:
        low, high = v.get(A + "clip_ratio_low", clip), v.get(A + "clip_ratio_high", clip)
        out.append(("eps_clip_low_high", (clip if low is None else low, clip if high is None else high)))
    return out


def _cov(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """policy_loss.clip_cov_lb / clip_cov_ub (verl defaults 1 and 5): --clip_cov_bounds LB UB."""
    lb, ub = v.get(A + "policy_loss.clip_cov_lb", 1.0), v.get(A + "policy_loss.clip_cov_ub", 5.0)
    return [("clip_cov_bounds", (1.0 if lb is None else lb, 5.0 if ub is None else ub))]


def _sp(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """verl's Ulysses sizes: the actor's ulysses_sequence_parallel_size (deprecated, it wins when > 1, as verl's
    __post_init__) or its fsdp_config's; the reference's own keys, else the actor's (verl's oc.select); the critic's
    own, else 1 (verl's default: the critic does not follow the actor)."""

    def size(*keys: str) -> int | None:
        given = [as_int(v[key], key) for key in keys if v.get(key) is not None]
        return next((n for n in given if n > 1), given[0] if given else None)

    actor = size(A + "ulysses_sequence_parallel_size", A + "fsdp_config.ulysses_sequence_parallel_size")
    ref = size(REF + "ulysses_sequence_parallel_size", REF + "fsdp_config.ulysses_sequence_parallel_size")
    critic = size(C + "ulysses_sequence_parallel_size", C + "fsdp.ulysses_sequence_parallel_size")
    out: list[Assignment] = [("sequence_parallel_size", actor)] if actor is not None else []
    if ref is not None:
        out.append(("ref_sequence_parallel_size", ref))
    if critic is not None or (actor or 1) > 1:
        out.append(("critic_sequence_parallel_size", critic or 1))
    return out


# verl's distillation_loss.loss_mode (its kl_penalty names) -> --teacher_kl_estimator
_DIVERGENCES = {"k1": "k1", "kl": "k1", "k2": "k2", "mse": "k2", "k3": "k3", "low_var_kl": "k3"}


def _distill(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """verl's distillation.* (defaults of its distillation.yaml: loss_mode k3, use_policy_gradient false,
    use_task_rewards true, distillation_loss_coef 1 used only with task rewards, loss_max_clamp null):
    --teacher_pretrain and --teacher_kl_*. verl sums the teacher term at the loss level and rlrun the
    policy-gradient form at the advantage level: the two agree wherever no token is clipped."""
    if not as_bool(v.get(D + "enabled", False), D + "enabled"):
        return []
    if v.get(TEACHER + "model_path") is None:
        raise ConfigError(f"{D}enabled=true needs {TEACHER}model_path (the teacher model)")
    mode = str(v.get(DL + "loss_mode", "k3"))
    if mode not in _DIVERGENCES:
        raise ConfigError(
            f"{DL}loss_mode={mode}: rlrun distils with the sampled token's k1, k2 or k3 (kl, mse, low_var_kl); "
            "verl's abs and top-k forward-KL modes are not implemented"
        )
    gradient = as_bool(v.get(DL + "use_policy_gradient", False), DL + "use_policy_gradient")
    if not gradient and _DIVERGENCES[mode] == "k1":
        raise ConfigError(
            f"{DL}loss_mode={mode} with use_policy_gradient=false: k1's gradient does not involve the teacher (verl "
            "refuses it too); use k3, or use_policy_gradient=true"
        )
    task = as_bool(v.get(DL + "use_task_rewards", True), DL + "use_task_rewards")
    out: list[Assignment] = [
        ("teacher_pretrain", v[TEACHER + "model_path"]),
        ("teacher_kl_estimator", _DIVERGENCES[mode]),
        ("teacher_kl_loss", not gradient),
        ("distill_task_reward", task),
        ("teacher_kl_coef", v.get(DL + "distillation_loss_coef", 1.0) if task else 1.0),
        ("teacher_kl_clamp", v.get(DL + "loss_max_clamp")),
    ]
    if D + "n_gpus_per_node" in v:
        out.append(("teacher_num_gpus_per_node", as_int(v[D + "n_gpus_per_node"], D + "n_gpus_per_node")))
    if D + "nnodes" in v:
        out.append(("teacher_num_nodes", as_int(v[D + "nnodes"], D + "nnodes")))
    return out


def _turns(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """Lengths. verl: max_prompt_length and max_response_length are the prompt and response caps. Search-R1
    (max_turns=K set): max_response_length is per turn and there are K search turns plus a final answer turn,
    so the response region holds (K + 1) turns and K observations of at most max_obs_length; its first prompt
    keeps its last max_start_length tokens (max_prompt_length caps Search-R1's rolling context, which rlrun
    never cuts: prompt and response regions are separate)."""
    out: list[Assignment] = []
    if "data.max_obs_length" in v:
        out.append(("max_obs_len", as_int(v["data.max_obs_length"], "data.max_obs_length")))
    if "do_search" in v and not as_bool(v["do_search"], "do_search") and v.get("max_turns") is not None:
        raise ConfigError(
            "do_search=false: Search-R1 without search is a single-turn run; drop max_turns and retriever.url instead"
        )
    if "max_turns" not in v:
        if "data.max_prompt_length" in v:
            out.append(("prompt_max_len", as_int(v["data.max_prompt_length"], "data.max_prompt_length")))
        if "data.max_response_length" in v:
            out.append(("generate_max_len", as_int(v["data.max_response_length"], "data.max_response_length")))
        return out
    turns = as_int(v["max_turns"], "max_turns") + 1
    out.append(("max_turns", turns))
    start = v.get("data.max_start_length", v.get("data.max_prompt_length"))
    if start is not None:
        out.append(("prompt_max_len", as_int(start, "data.max_start_length")))
    if "data.max_response_length" in v:
        per_turn = as_int(v["data.max_response_length"], "data.max_response_length")
        obs = as_int(v.get("data.max_obs_length", per_turn), "data.max_obs_length")
        out += [("max_tokens_per_turn", per_turn), ("generate_max_len", per_turn * turns + obs * (turns - 1))]
    return out


M, CM = "actor_rollout_ref.model.", "critic.model."
VERL_LORA_DEFAULTS: dict[str, Any] = {"lora_rank": 0, "lora_alpha": 16, "target_modules": "all-linear"}  # both yamls


def _lora(v: Mapping[str, Any], world_size: int) -> list[Assignment]:
    """actor_rollout_ref.model.lora_rank, lora_alpha, target_modules (all-linear or a list like [q_proj,v_proj]) are
    --lora_rank, --lora_alpha, --target_modules; in a run with a critic, critic.model.* must equal them;
    exclude_modules must be null with LoRA on.

    rlrun gives a critic the actor's adapters (as OpenRLHF), verl by its critic.model keys (default: none). Both
    rules are checked once the config is built (check_lora), as a later --lora_rank wins over the keys."""
    return [(name, v[M + name]) for name in VERL_LORA_DEFAULTS if M + name in v]


def _module_names(value: Any) -> tuple[str, ...]:
    """verl's target_modules (a name, a comma-separated string or a list) as rlrun's --target_modules tuple (the
    same reading as config.fields.coerce)."""
    items = value if isinstance(value, (list, tuple)) else [value]
    return tuple(part.strip() for item in items for part in str(item).split(","))


def check_lora(given: Mapping[str, Any], model: Any, critic: str | None) -> None:
    """The verl LoRA keys of `given` (the "lora" group as typed) against the built config's model section `model`
    (a later --lora_rank wins over the keys). `critic`: the run's --advantage_estimator when it trains a critic,
    else None. Raises ConfigError where rlrun would train something other than verl."""
    if not given:
        return
    exclude = given.get(M + "exclude_modules")
    if model.lora_rank > 0 and exclude not in (None, "", []):
        raise ConfigError(
            f"{M}exclude_modules={exclude}: rlrun has no list of modules to leave out of LoRA; name "
            f"the modules to adapt with {M}target_modules=[...] (or --target_modules), or drop the key"
        )
    if critic is None:
        return  # verl builds no critic either: its critic.model.* keys ask for nothing
    actor = {"lora_rank": model.lora_rank, "lora_alpha": model.lora_alpha, "target_modules": model.target_modules}
    # Without adapters, alpha and target modules mean nothing.
    for name in ("lora_rank",) if model.lora_rank == 0 else tuple(VERL_LORA_DEFAULTS):
        raw = given.get(CM + name, VERL_LORA_DEFAULTS[name])
        value = _module_names(raw) if name == "target_modules" else as_int(raw, CM + name)
        if value != actor[name]:
            shown = ",".join(value) if isinstance(value, tuple) else value
            mine = " ".join(actor[name]) if name == "target_modules" else actor[name]
            trained = "whole" if name == "lora_rank" and value == 0 else "with adapters of its own"
            raise ConfigError(
                f"{CM}{name}={shown}{'' if CM + name in given else ' (verl default)'} with the actor's --{name} "
                f"{mine}: "
                f"rlrun gives the critic (--advantage_estimator {critic}) the actor's LoRA settings (one --lora_rank, "
                f"--lora_alpha and --target_modules for both, as OpenRLHF) where verl would train it {trained}; set "
                f"{CM}{name} to the actor's value to train it so, or use an estimator without a critic "
                "(algorithm.adv_estimator=grpo)"
            )


# --- translation ---------------------------------------------------------------------------------------------------

# Every rule gets the launched world size (only the global micro batches need it), so one mapping serves
# translate() and the docs report.
Rule = Callable[[Mapping[str, Any], int], Sequence[Assignment | Default]]
GROUP_RULES: dict[Group, Rule] = {
    "kl": _kl,
    "batch": _batch,
    "micro": _micro,
    "estimator": _estimator,
    "data": _data,
    "clip": _clip,
    "turns": _turns,
    "lora": _lora,
    "cov": _cov,
    "distill": _distill,
    "sp": _sp,
}


def parse_value(raw: str) -> Any:
    """A Hydra override value: YAML scalars and flow lists (null, true, 1e-6, ['console','wandb']), else text."""
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        return raw
    # YAML 1.1 reads 1e-6 as text: coerce() turns it into the field's number type later.
    return value if isinstance(value, (str, int, float, bool, list, dict, type(None))) else raw


def launched_world_size() -> int:
    """Ranks the launcher started (torchrun: WORLD_SIZE, srun: SLURM_NTASKS); 1 for a plain `python -m`."""
    return int(os.environ.get("WORLD_SIZE") or os.environ.get("SLURM_NTASKS") or 1)


@dataclass
class Translated:
    argv: list[str]  # rlrun flags only
    ignored: list[str] = field(default_factory=list)  # one report line per ignored key
    defaults: list[Default] = field(default_factory=list)  # verl's assumptions, coerced (see Default)
    lora: dict[str, Any] = field(default_factory=dict)  # the verl LoRA keys given, for check_lora on the built config


def _tokens(
    assignments: list[Assignment],
    source: str,
    fields: Mapping[str, FieldInfo],
    classic_ignored: Mapping[str, tuple[int | str, str]],
    ignored: list[str],
) -> list[str]:
    """rlrun flag tokens for the assignments; a field rlrun lacks is reported, never an error."""
    out: list[str] = []
    for name, value in assignments:
        if name not in fields:
            reason = classic_ignored[name][1] if name in classic_ignored else NOT_YET
            ignored.append(f"{source}: ignored ({reason})")
            continue
        checked = coerce(fields[name], value, source)  # errors name the verl key
        if isinstance(checked, tuple):
            out += [f"--{name}", *map(str, checked)]
        else:
            text = "none" if checked is None else str(checked).lower() if isinstance(checked, bool) else str(checked)
            out.append(f"--{name}={text}")
    return out


def translate(
    argv: Sequence[str],
    arity: Callable[[str], Nargs],
    fields: Mapping[str, FieldInfo],
    classic_ignored: Mapping[str, tuple[int | str, str]],
    world_size: int,
) -> Translated:
    """Replace verl overrides in argv (classic rlrun flags otherwise) by rlrun flags, in place.

    `arity(flag name)` says how many values a flag takes, so that a flag's value is never read as an override.
    """
    out: list[str | None] = []
    result = Translated([])
    groups: dict[Group, dict[str, Any]] = {}
    group_at: dict[Group, int] = {}  # index in `out` of the placeholder for a group's tokens
    i = 0
    while i < len(argv):
        token = argv[i]
        i += 1
        if token.startswith("--"):
            out.append(token)
            name, eq, _ = token[2:].partition("=")
            if not eq:
                values = take_values(argv, i, arity(name), token)
                out += values
                i += len(values)
            continue
        parts = split_override(token)
        if parts is None:
            out.append(token)  # a stray positional: argparse reports it
            continue
        prefix, key, raw = parts
        if prefix == "~":
            raise ConfigError(f"{token}: rlrun has no key deletion; leave the key out")
        meaning = meaning_of(key)
        if meaning is None:
            raise ConfigError(f"unknown verl key '{key}'{suggest(key, VERL_KEYS)}")
        value = parse_value(raw)
        shown = "null" if value is None else str(value)
        # The key itself, or the rlrun flag it stands for (trainer.critic_warmup is --freezing_actor_steps).
        stands_for = meaning.field if isinstance(meaning, To) else None
        if (stop := refused([(key, shown)])) is not None:
            raise ConfigError(stop)
        if stands_for is not None and (stop := refused([(stands_for, shown)])) is not None:
            raise ConfigError(stop.replace(stands_for, key, 1))
        if isinstance(meaning, Skip):
            result.ignored.append(f"{key}: ignored ({meaning.reason.format(world_size=world_size)})")
        elif isinstance(meaning, Reject):
            if value not in (None, ""):  # null is verl's default: nothing asked for
                raise ConfigError(f"{key}: {meaning.fix}")
        elif isinstance(meaning, GroupInput):
            groups.setdefault(meaning.group, {})[key] = value
            group_at[meaning.group] = len(out)  # the group's tokens go where its last key is
            out.append(None)
        elif isinstance(meaning, Expand):
            out += _tokens(meaning.rule(value), key, fields, classic_ignored, result.ignored)
        elif value is None and meaning.field in fields and type(None) not in get_args(fields[meaning.field].type):
            continue  # verl's null where rlrun needs a value: keep rlrun's default (data.train_data_num=null)
        else:
            converted = meaning.convert(value, key) if meaning.convert else value
            out += _tokens([(meaning.field, converted)], key, fields, classic_ignored, result.ignored)
    expanded: list[str] = []
    at = {index: group for group, index in group_at.items()}
    for index, entry in enumerate(out):
        if entry is not None:
            expanded.append(entry)
        elif index in at:
            group = at[index]
            source = ", ".join(groups[group])
            assigned = GROUP_RULES[group](groups[group], world_size)
            expanded += _tokens(
                [a for a in assigned if not isinstance(a, Default)], source, fields, classic_ignored, result.ignored
            )
            result.defaults += [
                Default(d.field, coerce(fields[d.field], d.value, source), d.unless)
                for d in assigned
                if isinstance(d, Default)
            ]
    result.argv = expanded
    result.lora = groups.get("lora", {})
    return result
