"""Command line: defaults < YAML (--config) < flags, OpenRLHF flag names, --help (a short usage, then every flag
grouped by section).

The parser is generated from the config tree (``rlrun.config.tree``); nothing here defines a setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import textwrap
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal, TypeGuard, get_args, get_origin, get_type_hints

import yaml

from rlrun.compat import openrlhf_flags, verl_overrides
from rlrun.compat.argv import LAUNCHER, NOT_YET, QLORA, RAY_ONLY, RING_HEAD_STRIDE, Nargs, refused
from rlrun.config.fields import DuplicateKey, FieldInfo, build_config, coerce, fields_of, load_yaml_text, suggest
from rlrun.config.tree import FORMER_SECTIONS, Config
from rlrun.runtime.errors import ConfigError

# OpenRLHF train_ppo_ray flags rlrun accepts but does not act on: name -> (values it takes, reason).
IGNORED_FLAGS: dict[str, tuple[int | str, str]] = {
    "vllm_sync_with_ray": (0, RAY_ONLY),
    "rollout_tasks_per_gpu": (1, RAY_ONLY),
    "runtime_env": (1, RAY_ONLY),
    "runtime-env": (1, RAY_ONLY),
    "runtime-env-json": (1, RAY_ONLY),
    "local_rank": (1, LAUNCHER),
    "ref_reward_offload": (0, NOT_YET),
    "enable_prefix_caching": (0, NOT_YET),
    "vllm_generate_batch_size": (1, NOT_YET),
    "ds_tensor_parallel_size": (1, NOT_YET),
    "deepcompile": (0, NOT_YET),
    "disable_ds_ckpt": (0, NOT_YET),
    "use_ds_universal_ckpt": (0, NOT_YET),
    "max_ckpt_mem": (1, NOT_YET),
    "enable_ema": (0, NOT_YET),
    "ema_beta": (1, NOT_YET),
    "zpg": (1, NOT_YET),
    "actor_init_on_gpu": (0, NOT_YET),
    "use_liger_kernel": (0, NOT_YET),
    "grad_accum_dtype": (1, NOT_YET),
    "overlap_comm": (0, NOT_YET),
    "gradient_checkpointing_use_reentrant": (0, NOT_YET),
    "disable_fast_tokenizer": (0, NOT_YET),
    "load_in_4bit": (0, QLORA),  # refused (reasons.CHANGES_TRAINING); the LoRA flags are fields
    "max_len": (1, NOT_YET),
    "ptx_coef": (1, NOT_YET),
    "full_determinism": (0, "rlrun is deterministic on CPU by default"),
    "freezing_actor_steps": (1, NOT_YET),
    "lr_scheduler": (1, "rlrun always uses linear warmup + cosine decay"),
    "ring_head_stride": (1, RING_HEAD_STRIDE),
    "value_head_prefix": (1, NOT_YET),
    "perf": (0, NOT_YET),
    "use_ms": (0, "ModelScope hub: rlrun reads local paths and Hugging Face Hub ids"),
}


# OpenRLHF train_ppo_ray flags spelled differently in rlrun: classic name -> rlrun field (the value passes unchanged).
RENAMED_FLAGS: dict[str, str] = {
    "use_dynamic_batch": "dynamic_batch",
    "vllm_is_truncated_threshold": "is_correction_threshold",  # OpenRLHF 0.9.1-0.10.1: LOW HIGH
    "ring_attn_size": "sequence_parallel_size",  # OpenRLHF's ring attention groups: rlrun's Ulysses groups
    "deepspeed_enable_sleep": "sleep",  # OpenRLHF's name; rlrun's sleep works under either strategy
}


# Config fields that parse and are kept (so configs stay valid) but act on nothing in this release.
NO_EFFECT_YET: dict[str, str] = {
    "vllm_gpu_memory_utilization": "only --generation_backend vllm uses it",
    "vllm_enable_sleep": "only --generation_backend vllm uses it (and only on GPU: vLLM has no sleep mode on CPU)",
    "enforce_eager": "only --generation_backend vllm uses it",
    "vllm_engine_host": "only --generation_backend vllm uses it",
    "vllm_kv_cache_memory_bytes": "only --generation_backend vllm uses it (on GPU)",
    "vllm_seeded_requests": "only --generation_backend vllm uses it",
}

# NO_EFFECT_YET entries that do act when --generation_backend vllm is chosen.
VLLM_BACKEND_FIELDS = frozenset(
    {
        "vllm_gpu_memory_utilization",
        "enforce_eager",
        "vllm_enable_sleep",
        "vllm_engine_host",
        "vllm_kv_cache_memory_bytes",
        "vllm_seeded_requests",
    }
)


@dataclass(frozen=True)
class CliSpec:
    """One entry point's command line: its config tree and the peer spellings it accepts."""

    prog: str
    description: str
    config_cls: type
    ignored: Mapping[str, tuple[int | str, str]]  # classic peer flags accepted without effect: name -> (nargs, reason)
    dotted: dict[str, openrlhf_flags.Meaning]  # the peer trainer's OpenRLHF 0.11 dotted flags, in order
    no_effect: Mapping[str, str] = dataclasses.field(default_factory=dict)  # fields kept but not acted on yet
    renamed: Mapping[str, str] = dataclasses.field(
        default_factory=dict
    )  # classic peer flag -> rlrun field of another name
    defaults: Mapping[str, Any] = dataclasses.field(default_factory=dict)  # this trainer's defaults of shared fields
    verl_overrides: bool = False  # verl key=value overrides (PPO only)
    start: tuple[tuple[str, str], ...] = ()  # --help's first examples: (what it does, the command line)
    bare: str | None = None  # the one line answering a command line without any argument (None: parse the defaults)


def _demo_config() -> str:
    """configs/demo.yaml as the user can type it: relative to here when the checkout holding rlrun is below."""
    path = Path(__file__).resolve().parents[3] / "configs" / "demo.yaml"
    if not path.is_file():
        return "configs/demo.yaml (in the rlrun repository)"
    try:
        return str(path.relative_to(Path.cwd()))
    except ValueError:
        return str(path)


PPO_CLI = CliSpec(
    prog="python -m rlrun.ppo",
    description="Ray-free RLHF: one torchrun/srun SPMD program. OpenRLHF train_ppo_ray flag names work.",
    config_cls=Config,
    ignored=IGNORED_FLAGS,
    dotted={**openrlhf_flags.OPENRLHF_DOTTED, **openrlhf_flags.EARLIER_DOTTED},
    no_effect=NO_EFFECT_YET,
    renamed=RENAMED_FLAGS,
    verl_overrides=True,
    start=(
        (
            "the offline demo (embedded tiny model, built-in prompts, rule reward; about 20 s on a CPU)",
            f"python -m rlrun.ppo --config {_demo_config()}",
        ),
        (
            "GRPO on your model and prompts with a reward function, 8 ranks",
            "torchrun --nproc_per_node 8 -m rlrun.ppo --pretrain MODEL --prompt_data FILE --input_key prompt \\\n"
            "    --remote_rm_url reward.py --advantage_estimator group_norm --n_samples_per_prompt 8",
        ),
    ),
    bare=(
        "nothing to train: pass a model, prompts and their reward (e.g. --pretrain MODEL --prompt_data FILE "
        f"--remote_rm_url reward.py; --help lists every flag), or run the offline demo: python -m rlrun.ppo --config "
        f"{_demo_config()}"
    ),
)

# --help's "common flags", those of them an entry point has, in this order.
COMMON_FLAGS = (
    "pretrain",
    "prompt_data",
    "dataset",
    "input_key",
    "label_key",
    "output_key",
    "remote_rm_url",
    "compute_score",
    "reward_pretrain",
    "advantage_estimator",
    "n_samples_per_prompt",
    "rollout_batch_size",
    "train_batch_size",
    "max_epochs",
    "max_steps",
    "save_path",
    "save_steps",
    "dry_run",
)
# The same two settings in each spelling --help shows: (field, value); verl's keys for PPO's pair.
SPELLING_EXAMPLES = {
    "ppo": (("n_samples_per_prompt", "8"), ("actor_learning_rate", "1e-6")),
    "supervised": (("max_epochs", "2"), ("learning_rate", "1e-6")),
}
VERL_EXAMPLE = "actor_rollout_ref.rollout.n=8 actor_rollout_ref.actor.optim.lr=1e-6"


@dataclass(frozen=True)
class ParsedArgs:
    config: Any  # an instance of the spec's config_cls (PPO: rlrun.config.tree.Config)
    ignored: tuple[str, ...]  # one line per ignored flag, with the reason
    explicit: frozenset[str]  # fields set by YAML or flags (not defaults)
    vllm_acts_on: tuple[str, ...] = ()  # the lines of `ignored` that a vLLM backend acts on (VLLM_BACKEND_FIELDS)

    def ignored_under(self, backend: str | None) -> tuple[str, ...]:
        """`ignored` once the generation backend is known: under vllm (asked for, or picked by `auto`) its flags act."""
        return (
            tuple(line for line in self.ignored if line not in self.vllm_acts_on) if backend == "vllm" else self.ignored
        )


def _unwrap_optional(tp: Any) -> Any:
    args = get_args(tp)
    if type(None) in args and len(args) == 2:
        return next(a for a in args if a is not type(None))
    return tp


def _flag_kwargs(info: FieldInfo, default: Any) -> dict[str, Any]:
    tp = info.type
    kwargs: dict[str, Any] = {"default": argparse.SUPPRESS, "dest": info.name}
    default_text = (
        ""
        if default is None
        else f" (default: {default!r})"
        if isinstance(default, str) and "\n" in default
        else f" (default: {default})"
    )
    kwargs["help"] = info.help.replace("%", "%%") + default_text.replace("%", "%%")
    base = _unwrap_optional(tp)
    if info.name == "use_wandb":  # OpenRLHF: --use_wandb KEY; rlrun also takes a bare --use_wandb
        kwargs.update(nargs="?", const="", metavar=info.metavar)
    elif base is bool:
        kwargs.update(nargs="?", const="true", metavar="BOOL")
    elif get_origin(base) is tuple:
        args = get_args(base)
        kwargs.update(nargs="+" if args[-1] is Ellipsis else len(args))
    elif get_origin(base) is Literal:
        kwargs["metavar"] = "{" + ",".join(map(str, get_args(base))) + "}"
    return kwargs


class _Parser(argparse.ArgumentParser):
    """argparse that raises ConfigError instead of printing usage and exiting."""

    def error(self, message: str) -> Any:
        raise ConfigError(message)


def spelling_examples(spec: CliSpec) -> dict[str, str]:
    """The same settings in each spelling the entry point accepts: {'classic': '--a 1 ...', 'dotted': ...,
    'verl': ...}."""
    infos = fields_of(spec.config_cls)
    # the settings this entry point has (rlrun.tinker's learning rate comes with each request)
    pairs = [(n, v) for n, v in SPELLING_EXAMPLES["ppo" if spec.verl_overrides else "supervised"] if n in infos]
    dotted = {m.field: name for name, m in reversed(spec.dotted.items()) if isinstance(m, openrlhf_flags.Same)}
    out = {
        "classic": " ".join(f"--{name} {value}" for name, value in pairs),
        "dotted": " ".join(f"--{dotted.get(name, f'{infos[name].section}.{name}')} {value}" for name, value in pairs),
    }
    if spec.verl_overrides:
        out["verl"] = VERL_EXAMPLE
    return out


def quick_help(spec: CliSpec) -> str:
    """What --help opens with: how to start, the common flags, the spellings, where the rest is."""
    infos = fields_of(spec.config_cls)
    lines = [spec.description, "", "start here:"]
    for what, command in spec.start:
        lines += [f"  {what}:", *(f"    {line}" for line in command.splitlines())]
    lines += [
        "  add --dry_run to check a job before it starts: it reads the data, shows the first sample, loads no weights",
        f"  every run writes SAVE_PATH/config.yaml; {spec.prog} --config SAVE_PATH/config.yaml reruns it",
        "",
        "common flags:",
        textwrap.fill(
            ", ".join(f"--{name}" for name in COMMON_FLAGS if name in infos),
            width=110,
            initial_indent="  ",
            subsequent_indent="  ",
        ),
        "",
    ]
    examples = spelling_examples(spec)
    where = {
        "classic": "OpenRLHF's classic flags",
        "dotted": "OpenRLHF 0.11, and rlrun's --section.field",
        "verl": "verl's Hydra overrides, key=value",
    }
    lines.append(
        f"{'three' if len(examples) == 3 else 'two'} spellings, mixed freely (later wins; --config YAML sits "
        "under all of them):"
    )
    width = max(len(text) for text in examples.values())
    lines += [f"  {name:<8} {text:<{width}}  ({where[name]})" for name, text in examples.items()]
    lines += [
        "",
        "Every flag follows, by section. docs/compat.md (in the repository) says what each OpenRLHF"
        + (" and verl" if spec.verl_overrides else "")
        + " name does here.",
    ]
    return "\n".join(lines)


def build_parser(spec: CliSpec = PPO_CLI) -> argparse.ArgumentParser:
    parser = _Parser(
        prog=spec.prog,
        usage="%(prog)s [--config FILE] [--FLAG VALUE ...]" + (" [key=value ...]" if spec.verl_overrides else ""),
        description=quick_help(spec),
        epilog="Ray-only and not-yet-supported OpenRLHF flags are accepted and reported as ignored.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    parser.add_argument(
        "--config",
        default=None,
        metavar="FILE",
        help="YAML file setting fields (nested by section or flat by flag name); a run's "
        "SAVE_PATH/config.yaml reruns it.",
    )
    hints = get_type_hints(spec.config_cls)
    infos = fields_of(spec.config_cls)
    for section in dataclasses.fields(spec.config_cls):
        doc = (hints[section.name].__doc__ or "").strip().splitlines()[0]
        group = parser.add_argument_group(section.name, doc)
        for info in infos.values():
            if info.section == section.name:
                group.add_argument(f"--{info.name}", **_flag_kwargs(info, spec.defaults.get(info.name, info.default)))
    return parser


def load_yaml(path: str, config_cls: type = Config, renamed: Mapping[str, str] | None = None) -> dict[str, Any]:
    """Flat {field: value} from a YAML file; sections may nest (also under a field's former section,
    FORMER_SECTIONS). Unknown keys are errors; `renamed`: the peer spellings of a field's name (the command line's
    aliases, e.g. deepspeed_enable_sleep), taken as that field."""
    renamed = renamed or {}
    if not os.path.isfile(path):
        raise ConfigError(f"--config {path}: no such file")
    with open(path, encoding="utf-8") as fh:
        try:
            raw = load_yaml_text(fh) or {}
        except DuplicateKey as exc:
            raise ConfigError(
                f"--config {path}: '{exc.key}' is given twice in one mapping (lines {exc.first_line} and "
                f"{exc.second_line}); YAML would keep the last silently: keep one"
            ) from None
        except yaml.YAMLError as exc:
            raise ConfigError(f"--config {path}: not valid YAML: {exc}") from None
    if not isinstance(raw, dict):
        raise ConfigError(f"--config {path}: the top level must be a mapping of keys to values")
    infos = fields_of(config_cls)
    sections = {f.name for f in dataclasses.fields(config_cls)}
    flat: dict[str, Any] = {}
    written: dict[str, str] = {}  # field -> where the file gave it ('seed', 'train.seed', a peer's spelling)

    def take(name: str, value: Any, spelled: str) -> None:
        if name in written:
            raise ConfigError(
                f"--config {path}: '{name}' is given twice, as '{written[name]}' and as '{spelled}'; keep one"
            )
        written[name] = spelled
        flat[name] = value

    for key, value in raw.items():
        if key in sections and isinstance(value, dict):
            for sub, sub_value in value.items():
                name = renamed.get(sub, sub)
                info = infos.get(name)
                if info is not None and info.section != key and FORMER_SECTIONS.get(name) != key:
                    raise ConfigError(
                        f"--config {path}: unknown key '{key}.{sub}'; '{name}' belongs in section '{info.section}'"
                    )
                if info is None:
                    valid = [i.name for i in infos.values() if i.section == key]
                    raise ConfigError(f"--config {path}: unknown key '{key}.{sub}'{suggest(str(sub), valid)}")
                take(name, sub_value, f"{key}.{sub}")
        elif renamed.get(key, key) in infos:
            take(renamed.get(key, key), value, str(key))
        elif key in sections:
            raise ConfigError(f"--config {path}: section '{key}' must be a mapping of field: value, got {value!r}")
        else:
            raise ConfigError(f"--config {path}: unknown key '{key}'{suggest(str(key), list(infos) + list(sections))}")
    if isinstance(flat.get("use_wandb"), bool):  # YAML true/false: on (key from WANDB_API_KEY) / off, not a key
        flat["use_wandb"] = "" if flat["use_wandb"] else None
    return {k: coerce(infos[k], v, f"--config {path}") for k, v in flat.items()}


def _strip_ignored(
    argv: Sequence[str], ignored_flags: Mapping[str, tuple[int | str, str]]
) -> tuple[list[str], list[str]]:
    """Remove ignored OpenRLHF/Ray flags (and their values); return (rest, report lines)."""
    rest: list[str] = []
    report: list[str] = []
    i = 0
    while i < len(argv):
        token = argv[i]
        name, eq, _ = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        ignored = ignored_flags.get(name) or ((0, RAY_ONLY) if name.startswith("ray_") else None)
        if ignored is None:
            rest.append(token)
            i += 1
            continue
        nargs, reason = ignored
        i += 1
        if not eq:
            want = 10**9 if nargs == "*" else int(nargs)
            if name.startswith("ray_"):
                want = 1  # --ray_* flags take a value unless the next token is a flag
            while want and i < len(argv) and not argv[i].startswith("--"):
                i += 1
                want -= 1
        report.append(f"--{name}: ignored ({reason})")
    return rest, report


def _renamed(argv: Sequence[str], renamed: Mapping[str, str]) -> list[str]:
    """Classic peer flags rlrun spells differently (--use_dynamic_batch) -> rlrun's name, in place (later still
    wins)."""
    out = []
    for token in argv:
        name, eq, value = token[2:].partition("=") if token.startswith("--") else ("", "", "")
        out.append(f"--{renamed[name]}{eq}{value}" if name in renamed else token)
    return out


def _flags_with_values(argv: Sequence[str]) -> list[tuple[str, str | None]]:
    """(--flag, its first value or None) for every flag token."""
    out = []
    for i, token in enumerate(argv):
        if token.startswith("--"):
            name, eq, value = token.partition("=")
            following = argv[i + 1] if i + 1 < len(argv) and not argv[i + 1].startswith("--") else None
            out.append((name, value if eq else following))
    return out


def _is_nargs_word(nargs: int | str) -> TypeGuard[Literal["*", "+", "?"]]:
    return nargs in ("*", "+", "?")


def _arity(
    parser: argparse.ArgumentParser, ignored_flags: Mapping[str, tuple[int | str, str]]
) -> Callable[[str], Nargs]:
    """How many values each classic flag takes (so a flag's value is never read as a verl override)."""
    by_flag: dict[str, Nargs] = {}
    for action in parser._actions:
        nargs = 1 if action.nargs is None else action.nargs
        for option in action.option_strings:
            by_flag[option[2:]] = nargs if isinstance(nargs, int) or _is_nargs_word(nargs) else 1

    def arity(name: str) -> Nargs:
        if name in by_flag:
            return by_flag[name]
        if name in ignored_flags:
            return ignored_flags[name][0]  # type: ignore[return-value]
        return "?" if name.startswith("ray_") else 0  # an unknown flag fails in argparse

    return arity


def _translate_peer_spellings(
    argv: Sequence[str], parser: argparse.ArgumentParser, spec: CliSpec
) -> tuple[list[str], list[str], verl_overrides.Translated]:
    """OpenRLHF 0.11 dotted flags, rlrun's --section.field aliases and (PPO) verl key=value overrides -> classic flags.

    Returns (argv, report lines for the peer flags/keys that are ignored, the verl translation: its implied defaults
    and the LoRA keys checked on the built config)."""
    infos = fields_of(spec.config_cls)
    dotted = openrlhf_flags.translate(_renamed(argv, spec.renamed), infos, spec.ignored, spec.dotted)
    if not spec.verl_overrides:
        return dotted.argv, dotted.ignored, verl_overrides.Translated([])
    verl = verl_overrides.translate(
        dotted.argv, _arity(parser, spec.ignored), infos, spec.ignored, verl_overrides.launched_world_size()
    )
    return verl.argv, dotted.ignored + verl.ignored, verl


def parse_args(argv: Sequence[str] | None = None, spec: CliSpec = PPO_CLI) -> ParsedArgs:
    """Parse flags (and --config YAML) into a validated-type config of `spec`; raise ConfigError on bad input.
    `argv` None: the command line, where no argument at all is answered by `spec.bare` when the spec has one."""
    if argv is None and not sys.argv[1:] and spec.bare is not None:
        raise ConfigError(spec.bare)
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser(spec)
    translated, peer_ignored, verl = _translate_peer_spellings(argv, parser, spec)
    if (stop := refused(_flags_with_values(translated), accepted=fields_of(spec.config_cls).keys())) is not None:
        raise ConfigError(stop)
    rest, ignored = _strip_ignored(translated, spec.ignored)
    ignored = peer_ignored + ignored
    known, unknown = parser.parse_known_args(rest)
    infos = fields_of(spec.config_cls)
    if unknown:
        flag = next((u for u in unknown if u.startswith("-")), unknown[0])
        name = flag.lstrip("-").split("=", 1)[0]
        spellings = [*openrlhf_flags.all_spellings(infos, spec.ignored, spec.dotted), *spec.renamed]
        raise ConfigError(
            f"unknown flag '{flag}'{suggest(name, spellings, prefix='--')}"
            if flag.startswith("-")
            else f"unexpected argument '{flag}' (flags take the form --name value"
            + (", or key=value for verl keys)" if spec.verl_overrides else ")")
        )
    values = load_yaml(known.config, spec.config_cls, spec.renamed) if known.config else {}
    defaults = {name: value for name, value in spec.defaults.items() if name not in values}
    for name, raw in vars(known).items():
        if name == "config":
            continue
        if name == "use_wandb" and raw == "":
            values[name] = ""  # bare flag: key from WANDB_API_KEY
            continue
        values[name] = coerce(infos[name], raw, f"--{name}")
    defaults.update({d.field: d.value for d in verl.defaults if d.field not in values and not d.unless & values.keys()})
    no_effect = {name: f"--{name}: has no effect ({why})" for name, why in spec.no_effect.items() if name in values}
    config: Any = build_config({**defaults, **values}, spec.config_cls)  # an instance of spec.config_cls
    if verl.lora:  # PPO's Config: verl's critic keys matter only in a run that trains a critic
        verl_overrides.check_lora(
            verl.lora, config.model, config.algo.advantage_estimator if config.algo.needs_critic else None
        )
    parsed = ParsedArgs(
        config,
        tuple(dict.fromkeys([*ignored, *no_effect.values()])),
        frozenset(values),
        tuple(line for name, line in no_effect.items() if name in VLLM_BACKEND_FIELDS),
    )
    return dataclasses.replace(parsed, ignored=parsed.ignored_under(values.get("generation_backend")))
