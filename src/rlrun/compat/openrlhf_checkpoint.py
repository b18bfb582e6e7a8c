"""Write an OpenRLHF DeepSpeed checkpoint's weights into HF models, and the offline converter CLI.

The checkpoint is read by rlrun.compat.openrlhf_checkpoint (HF-named fp32 weights). `apply_weights` copies such
weights into a (possibly FSDP2- or DeepSpeed-wrapped) HF model after checking every name and shape. Two ways in:
- `rlrun.ppo --load_openrlhf_checkpoint ROOT` (rlrun.compat.openrlhf_checkpoint: `read_openrlhf_init` on every rank
  before the first collective, then `init_from_openrlhf` after the roles are built): every actor/critic rank reads the
  files itself and writes the full weights into its FSDP2 shard / DeepSpeed ZeRO-0/1/2 partition; no collective, no
  temp files.
- `python -m rlrun.compat.openrlhf_checkpoint ROOT OUT --pretrain HF_DIR [--critic_pretrain DIR] [--tag T]`
  (`convert`) writes `OUT/actor` and `OUT/critic` (HF directories for `--pretrain` / `--critic_pretrain`) and
  `OUT/openrlhf_state.json`.
"""

from __future__ import annotations

import argparse
import contextlib
import io
import json
import os
import re
import sys
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Literal

import torch

from rlrun.runtime.errors import CheckpointError

if TYPE_CHECKING:  # transformers is imported where a conversion needs it
    from transformers import PreTrainedModel

# ---- reading a checkpoint ----------------------------------------------------------------------------------------
# Read an OpenRLHF DeepSpeed checkpoint (`--ckpt_path` of an OpenRLHF PPO run) into HF-named fp32 weights.
#
# Layout read (OpenRLHF 0.11 `trainer/ray/ppo_actor.py`/`ppo_critic.py` -> `utils/deepspeed/deepspeed.py:save_ckpt`
# -> `DeepSpeedEngine.save_checkpoint`):
#
#     ROOT/_actor/latest                      text: the newest tag (written by DeepSpeed's global rank 0)
#     ROOT/_actor/global_stepN/               one tag per save (`best_global_stepN` for best-metric saves)
#         mp_rank_00_model_states.pt          ZeRO-0/1/2: the 16-bit (or fp32) module + DeepSpeed metadata
#                                             + OpenRLHF's client_state (global_step, episode, ...)
#         [bf16_]zero_pp_rank_R_mp_rank_00_optim_states.pt   ZeRO-1/2/3: rank R's fp32 master partition + Adam
#         zero_pp_rank_R_mp_rank_00_model_states.pt          ZeRO-3: rank R's parameter partition + metadata
#     ROOT/_critic/...                        the same for the critic (no client_state of its own)
#
# Names: OpenRLHF's `Actor` holds the HF causal LM as `.model`, so DeepSpeed's keys are `model.<HF name>`;
# the critic is the HF base model under its `base_model_prefix` plus a `nn.Linear(hidden, 1, bias=False)`
# head named by `--value_head_prefix` (default `score`) -- the names of a transformers
# sequence-classification model with `num_labels=1`, which is what rlrun's critic is.
#
# Weights only: the fp32 master weights are rebuilt offline by `deepspeed.utils.zero_to_fp32` for ZeRO-1/2/3
# (one process, no torch.distributed). Adam moments are not carried over (see `OPTIMIZER_NOTE`).
#
# Parsing only (locating the tag, checking every rank's file is present, rebuilding the weights, mapping names,
# refusing LoRA); nothing here touches a model. Its users: rlrun.compat.openrlhf_checkpoint (`rlrun.ppo
# --load_openrlhf_checkpoint ROOT`) and rlrun.compat.openrlhf_checkpoint (writing the weights into HF models, and
# the offline converter `python -m rlrun.compat.openrlhf_checkpoint`).

TrainedRole = Literal["actor", "critic"]
PART_DIRS: dict[TrainedRole, str] = {"actor": "_actor", "critic": "_critic"}
LATEST = "latest"
OPTIMIZER_NOTE = (
    "Adam moments are not read: rlrun starts a fresh optimizer and learning-rate schedule. (DeepSpeed keeps "
    "them as flat per-rank partitions whose per-parameter mapping differs by stage and version; a fresh "
    "schedule from step 0 would not match the restored moments anyway.)"
)
# Keys DeepSpeed itself writes into a model-states file; everything else there is the client_state.
_DEEPSPEED_KEYS = frozenset(
    {
        "module",
        "buffer_names",
        "optimizer",
        "param_shapes",
        "frozen_param_shapes",
        "shared_params",
        "frozen_param_fragments",
        "lr_scheduler",
        "data_sampler",
        "random_ltd",
        "sparse_tensor_module_names",
        "skipped_steps",
        "global_steps",
        "global_samples",
        "dp_world_size",
        "mp_world_size",
        "ds_config",
        "ds_version",
        "checkpoint_parallel_dimensions",
        "autotp_uc_info",
    }
)
_LORA = re.compile(r"(^|\.)(lora_[AB]|lora_embedding_[AB]|lora_magnitude_vector)(\.|$)")


@dataclass(frozen=True)
class TagFiles:
    """The files of one DeepSpeed tag directory, checked complete."""

    tag_dir: str
    zero_stage: int
    dp_world_size: int
    meta_file: str  # the model-states file holding client_state (rank 0's)
    meta: dict[str, Any] = field(repr=False)


@dataclass
class OpenRLHFCheckpoint:
    """Full fp32 weights under HF names, and what OpenRLHF stored beside them."""

    root: str
    tag: str
    zero_stage: int
    dp_world_size: int
    actor: dict[str, torch.Tensor]
    critic: dict[str, torch.Tensor] | None
    client_state: dict[str, Any]
    exact_fp32: bool  # False: ZeRO-0 with 16-bit training, where only the 16-bit module copy exists

    @property
    def global_step(self) -> int:
        return int(self.client_state.get("global_step", 0))

    def summary(self) -> dict[str, Any]:
        """The JSON-able part (scalars of client_state; no tensors, no dataloader pickles)."""
        scalars = {k: v for k, v in self.client_state.items() if isinstance(v, (int, float, str, bool)) or v is None}
        return {
            "root": self.root,
            "tag": self.tag,
            "zero_stage": self.zero_stage,
            "dp_world_size": self.dp_world_size,
            "exact_fp32": self.exact_fp32,
            "has_critic": self.critic is not None,
            "client_state": scalars,
            "optimizer": OPTIMIZER_NOTE,
        }


# ---- locating the tag ---------------------------------------------------------------------------------------


def part_dir(root: str, part: TrainedRole) -> str:
    return os.path.join(root, PART_DIRS[part])


def resolve_tag(root: str, tag: str | None, name_tag: str = "name one with --tag") -> str:
    """The tag to read: `tag` if given, else `_actor/latest`. Checks the root and the tag directory exist.
    `name_tag`: how the caller lets a user choose a tag (for the message when `latest` is missing)."""
    if not os.path.isdir(root):
        raise CheckpointError(
            f"OpenRLHF checkpoint {root}: not a directory (pass the --ckpt_path of the OpenRLHF "
            "run, the folder that holds _actor/ and _critic/)"
        )
    actor = part_dir(root, "actor")
    if not os.path.isdir(actor):
        found = sorted(os.listdir(root))[:8]
        hint = (
            " (this looks like a tag directory itself: pass its grandparent)"
            if any(n.endswith("model_states.pt") for n in found)
            else ""
        )
        raise CheckpointError(
            f"OpenRLHF checkpoint {root}: no _actor/ directory (found {found}){hint}; pass the "
            "--ckpt_path of an OpenRLHF PPO run saved with --save_steps"
        )
    if tag is None:
        latest = os.path.join(actor, LATEST)
        if not os.path.isfile(latest):
            tags = list_tags(actor)
            raise CheckpointError(
                f"OpenRLHF checkpoint {root}: {latest} is missing (DeepSpeed writes it only on "
                f"global rank 0), so the newest tag is unknown; {name_tag} "
                f"(tags here: {tags or 'none'})"
            )
        tag = _read_text(latest).strip()
    if not os.path.isdir(os.path.join(actor, tag)):
        raise CheckpointError(
            f"OpenRLHF checkpoint {root}: tag {tag!r} does not exist in {actor} "
            f"(tags here: {list_tags(actor) or 'none'})"
        )
    return tag


def list_tags(part: str) -> list[str]:
    return sorted(n for n in os.listdir(part) if os.path.isdir(os.path.join(part, n)))


def _read_text(path: str) -> str:
    try:
        with open(path, encoding="utf-8") as fh:
            return fh.read()
    except (OSError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"cannot read {path}: {exc}") from exc


def _deepspeed_globals() -> list[Any]:
    """The DeepSpeed classes a checkpoint's metadata pickles (0.19: loss scaler, ZeRO stage, bf16 fragment map)."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler  # noqa: PLC0415 - DeepSpeed checkpoints need DeepSpeed
    from deepspeed.runtime.zero.config import ZeroStageEnum  # noqa: PLC0415
    from deepspeed.utils.tensor_fragment import fragment_address  # noqa: PLC0415

    return [LossScaler, ZeroStageEnum, fragment_address]


def _load(path: str) -> dict[str, Any]:
    # weights_only, with DeepSpeed's own metadata classes allowed by name. (DeepSpeed's zero_to_fp32, which
    # rebuilds ZeRO-1/2/3 weights from the optimizer files, unpickles those files fully, as DeepSpeed always
    # does: load only checkpoints you trust.)
    try:
        with torch.serialization.safe_globals(_deepspeed_globals()):
            state = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as exc:
        if "Unsupported global" in str(exc):
            found = re.search(r"GLOBAL ([\w.]+)", str(exc))
            raise CheckpointError(
                f"cannot read {path}: it pickles {found.group(1) if found else 'a Python object'}, "
                "which rlrun does not unpickle (torch.load weights_only); convert the tag with "
                "DeepSpeed's zero_to_fp32.py into a state dict and load that with --pretrain"
            ) from None
        raise CheckpointError(
            f"cannot read {path}: {type(exc).__name__}: {exc} (a truncated or partly copied "
            "checkpoint? copy the tag directory again)"
        ) from exc
    if not isinstance(state, dict):
        raise CheckpointError(f"{path}: not a DeepSpeed checkpoint file (holds a {type(state).__name__})")
    return state


def inspect_tag(tag_dir: str) -> TagFiles:
    """The ZeRO stage and data-parallel size of a tag, after checking every rank's file is present."""
    if not os.path.isdir(tag_dir):
        raise CheckpointError(f"{tag_dir}: not a directory")
    names = set(os.listdir(tag_dir))
    z3_first = "zero_pp_rank_0_mp_rank_00_model_states.pt"
    if "mp_rank_00_model_states.pt" in names:
        meta_file = os.path.join(tag_dir, "mp_rank_00_model_states.pt")
    elif z3_first in names:
        meta_file = os.path.join(tag_dir, z3_first)
    else:
        raise CheckpointError(
            f"{tag_dir}: neither mp_rank_00_model_states.pt (ZeRO-0/1/2) nor {z3_first} (ZeRO-3) "
            f"is here (found {sorted(names)[:8]}); is this a DeepSpeed tag directory?"
        )
    meta = _load(meta_file)
    if "module" not in meta or "param_shapes" not in meta:
        raise CheckpointError(f"{meta_file}: not a DeepSpeed model-states file (keys {sorted(meta)[:8]})")
    if int(meta.get("mp_world_size", 1)) != 1:
        raise CheckpointError(
            f"{tag_dir}: saved with model (tensor) parallel size {meta['mp_world_size']}; rlrun "
            "reads data-parallel DeepSpeed checkpoints only (mp_rank_00)"
        )
    stage = int(((meta.get("ds_config") or {}).get("zero_optimization") or {}).get("stage", 0))
    dp = int(meta.get("dp_world_size", 1))
    needed: list[str] = []
    for r in range(dp if stage > 0 else 0):
        optim = f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt"
        if optim not in names and f"bf16_{optim}" not in names:
            needed.append(optim)
        if stage == 3 and f"zero_pp_rank_{r}_mp_rank_00_model_states.pt" not in names:
            needed.append(f"zero_pp_rank_{r}_mp_rank_00_model_states.pt")
    if needed:
        raise CheckpointError(
            f"{tag_dir}: ZeRO-{stage} checkpoint of {dp} ranks is missing {len(needed)} file(s), "
            f"first {needed[0]} (a multi-node run without a shared filesystem leaves each node's "
            "files on that node: copy them all into this directory)"
        )
    return TagFiles(tag_dir, stage, dp, meta_file, meta)


# ---- weights ------------------------------------------------------------------------------------------------


def read_deepspeed_weights(part: str, tag: str, files: TagFiles) -> tuple[dict[str, torch.Tensor], bool]:
    """Full weights of one DeepSpeed engine under its module's names, and whether they are the fp32 masters.

    ZeRO-1/2/3: the fp32 master weights, rebuilt from every rank's partition (bit-identical to the engine's).
    ZeRO-0: the module copy itself (fp32 when trained in fp32; 16-bit when trained in bf16/fp16)."""
    if files.zero_stage == 0:
        module = files.meta["module"]
        exact = all(t.dtype == torch.float32 for t in module.values() if t.is_floating_point())
        return {k: (v.float() if v.is_floating_point() else v).clone() for k, v in module.items()}, exact
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415 - optional extra

    try:
        with contextlib.redirect_stdout(io.StringIO()):  # it prints progress lines meant for its own CLI
            state = get_fp32_state_dict_from_zero_checkpoint(part, tag=tag)
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError, RuntimeError, OSError) as exc:
        raise CheckpointError(
            f"{files.tag_dir}: DeepSpeed's zero_to_fp32 could not rebuild the weights: {type(exc).__name__}: {exc}"
        ) from exc
    # Detached: the saved flat fp32 groups require grad, so their unflattened slices would carry autograd history.
    return {k: v.detach() for k, v in state.items()}, True


def actor_names(state: dict[str, torch.Tensor], where: str) -> dict[str, torch.Tensor]:
    """OpenRLHF Actor keys (`model.<HF name>`) -> HF causal-LM keys."""
    _refuse_lora(state, where)
    out = {}
    for key, value in state.items():
        if not key.startswith("model."):
            raise CheckpointError(
                f"{where}: parameter {key!r} is not under OpenRLHF's Actor wrapper `model.`; "
                "this is not an OpenRLHF actor checkpoint"
            )
        out[key[len("model.") :]] = value
    return out


def critic_names(
    state: dict[str, torch.Tensor], where: str, value_head_prefix: str = "score"
) -> dict[str, torch.Tensor]:
    """OpenRLHF CriticModel keys (`<base_model_prefix>.*`, `<value_head_prefix>.weight`) -> HF
    sequence-classification keys (`<base_model_prefix>.*`, `score.weight`)."""
    _refuse_lora(state, where)
    head = f"{value_head_prefix}.weight"
    if head not in state:
        tops = sorted({k.split(".", 1)[0] for k in state})
        raise CheckpointError(
            f"{where}: no value head {head!r} (top-level modules: {tops}); if the OpenRLHF run "
            "used --value_head_prefix X, pass --value_head_prefix X"
        )
    if len(state[head].shape) != 2 or state[head].shape[0] != 1:  # (lazy tensors have .shape only)
        raise CheckpointError(
            f"{where}: value head {head!r} has shape {tuple(state[head].shape)}, expected (1, hidden)"
        )
    extra = sorted(k for k in state if k.startswith(f"{value_head_prefix}.") and k != head)
    if extra:
        raise CheckpointError(
            f"{where}: value head has parameters besides its weight ({extra[0]}); OpenRLHF's "
            "critic head is a bias-free Linear(hidden, 1)"
        )
    return {("score.weight" if k == head else k): v for k, v in state.items()}


def _refuse_lora(state: dict[str, torch.Tensor], where: str) -> None:
    lora = next((k for k in state if _LORA.search(k)), None)
    if lora is not None:
        raise CheckpointError(
            f"{where}: holds LoRA adapter weights ({lora}); rlrun reads full-weight checkpoints "
            "only. Merge the adapters (OpenRLHF's --save_hf_ckpt export, or peft's "
            "merge_and_unload) and pass the merged model as --pretrain"
        )


def client_state_of(files: TagFiles) -> dict[str, Any]:
    """What OpenRLHF passed as client_state (global_step, episode, total_consumed_prompts, ...)."""
    return {k: v for k, v in files.meta.items() if k not in _DEEPSPEED_KEYS}


def read_openrlhf_checkpoint(
    root: str, tag: str | None = None, *, critic: bool = True, value_head_prefix: str = "score"
) -> OpenRLHFCheckpoint:
    """Read ROOT/_actor/TAG (and ROOT/_critic/TAG when `critic` and it exists) into HF-named fp32 state dicts.

    `tag` None: the tag named in ROOT/_actor/latest. The critic is read at the actor's tag (OpenRLHF saves
    both under one tag); a `_critic/` without that tag is an error, as it would pair mismatched weights."""
    root = os.path.abspath(root)
    tag = resolve_tag(root, tag)
    actor_dir = part_dir(root, "actor")
    files = inspect_tag(os.path.join(actor_dir, tag))
    weights, exact = read_deepspeed_weights(actor_dir, tag, files)
    actor = actor_names(weights, files.tag_dir)
    critic_state = None
    critic_dir = part_dir(root, "critic")
    if critic and os.path.isdir(critic_dir):
        if not os.path.isdir(os.path.join(critic_dir, tag)):
            raise CheckpointError(
                f"OpenRLHF checkpoint {root}: _actor has tag {tag!r} but _critic does not (tags "
                f"there: {list_tags(critic_dir) or 'none'}); the save was interrupted between the "
                "two -- pass an older --tag that both have"
            )
        cfiles = inspect_tag(os.path.join(critic_dir, tag))
        cweights, cexact = read_deepspeed_weights(critic_dir, tag, cfiles)
        critic_state = critic_names(cweights, cfiles.tag_dir, value_head_prefix)
        exact = exact and cexact
    return OpenRLHFCheckpoint(
        root, tag, files.zero_stage, files.dp_world_size, actor, critic_state, client_state_of(files), exact
    )


STATE_FILE = "openrlhf_state.json"  # beside OUT/actor and OUT/critic: the checkpoint's summary()


# ---- into a model ---------------------------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy `state` into an unwrapped HF model (the converter): apply_weights against --pretrain's architecture."""
    apply_weights(model, state, what, target="--pretrain's architecture")


def convert(
    root: str,
    out: str,
    pretrain: str,
    critic_pretrain: str | None = None,
    tag: str | None = None,
    value_head_prefix: str = "score",
) -> OpenRLHFCheckpoint:
    """Write OUT/actor (and OUT/critic) as HF directories built on `pretrain`'s architecture and tokenizer,
    with the checkpoint's fp32 weights, plus OUT/openrlhf_state.json."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: PLC0415

    for flag, path in (("--pretrain", pretrain), ("--critic_pretrain", critic_pretrain)):
        if path is not None and not os.path.isdir(path):
            raise CheckpointError(
                f"{flag} {path}: not a local HF model directory (the architecture and tokenizer "
                "come from it; OpenRLHF checkpoints store neither)"
            )
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"output {out} exists and is not empty; choose a new directory")
    ckpt = read_openrlhf_checkpoint(root, tag, value_head_prefix=value_head_prefix)
    actor = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.float32)
    load_weights(actor, ckpt.actor, f"{root} actor ({ckpt.tag})")
    parts: list[tuple[str, PreTrainedModel]] = [("actor", actor)]
    if ckpt.critic is not None:
        critic = AutoModelForSequenceClassification.from_pretrained(
            critic_pretrain or pretrain, num_labels=1, dtype=torch.float32
        )
        load_weights(critic, ckpt.critic, f"{root} critic ({ckpt.tag})")
        parts.append(("critic", critic))
    try:
        tokenizer = AutoTokenizer.from_pretrained(pretrain)
    except (OSError, ValueError):
        tokenizer = None  # a weights-only --pretrain: the user passes their tokenizer as before
    os.makedirs(out, exist_ok=True)
    for name, model in parts:
        model.save_pretrained(os.path.join(out, name))
        if tokenizer is not None:
            tokenizer.save_pretrained(os.path.join(out, name))
    with open(os.path.join(out, STATE_FILE), "w", encoding="utf-8") as fh:
        json.dump(ckpt.summary(), fh, indent=2, sort_keys=True)
    return ckpt


# ---- --load_openrlhf_checkpoint: initialise a run's actor (and critic) -----------------------------------------


def _tensor(value: Any) -> torch.Tensor:
    """A plain tensor with no autograd history (DeepSpeed's saved flat groups require grad)."""
    return (value if isinstance(value, torch.Tensor) else value.contiguous()).detach()


def _set_full(target: torch.Tensor, full: torch.Tensor) -> None:
    """Write a full (unsharded) fp32 value into a parameter however the role's strategy holds it. No collective:
    FSDP2 DTensors take their own slice (`src_data_rank=None`); DeepSpeed ZeRO-1/2 set this rank's fp32 master
    partition and the module's whole copy."""
    from torch.distributed.tensor import DTensor, distribute_tensor  # noqa: PLC0415

    if isinstance(target, DTensor):
        mine = distribute_tensor(
            full.to(device=target.device, dtype=target.dtype), target.device_mesh, target.placements, src_data_rank=None
        )
        target.to_local().copy_(mine.to_local())
        return
    if hasattr(target, "ds_id"):
        raise CheckpointError(
            "--load_openrlhf_checkpoint cannot write into a DeepSpeed ZeRO-3 model; convert the "
            "checkpoint with `python -m rlrun.compat.openrlhf_checkpoint` and pass --pretrain"
        )
    if hasattr(target, "_hp_mapping"):
        from deepspeed.utils import safe_set_full_fp32_param  # noqa: PLC0415 - only under --strategy deepspeed

        safe_set_full_fp32_param(target, full.to(target.device))
    target.copy_(full.to(device=target.device, dtype=target.dtype))


def apply_weights(
    hf_model: torch.nn.Module, weights: dict[str, Any], what: str, target: str = "this run's model"
) -> None:
    """Copy HF-named full weights into a (possibly FSDP2- or DeepSpeed-wrapped) HF model, one tensor at a time.

    Every name and (global) shape is checked before the first write, naming the first difference. A key the
    checkpoint lacks is accepted only when the model ties it to one the checkpoint has (e.g. lm_head.weight
    tied to embed_tokens.weight)."""
    own = hf_model.state_dict(keep_vars=True)
    kind = type(hf_model).__name__
    for name, value in weights.items():
        if name not in own:
            raise CheckpointError(
                f"{what}: tensor {name!r} has no counterpart in {target} ({kind}); is --pretrain "
                "the model the OpenRLHF run started from?"
            )
        if tuple(own[name].shape) != tuple(value.shape):
            raise CheckpointError(
                f"{what}: tensor {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                f"{tuple(own[name].shape)} in {target}; use the model the OpenRLHF run started from "
                "as --pretrain (--critic_pretrain)"
            )
    present = {id(own[k]) for k in weights}
    missing = [k for k in own if k not in weights and id(own[k]) not in present]
    if missing:
        raise CheckpointError(
            f"{what}: the checkpoint has no tensor {missing[0]!r} ({len(missing)} missing) that {target} ({kind}) needs"
        )
    with torch.no_grad():
        for name, value in weights.items():
            _set_full(own[name], _tensor(value).float())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m rlrun.compat.openrlhf_checkpoint",
        description="Convert an OpenRLHF DeepSpeed checkpoint (ROOT/_actor, ROOT/_critic) "
        "into HF directories OUT/actor and OUT/critic for rlrun's --pretrain "
        "and --critic_pretrain. Weights only: " + OPTIMIZER_NOTE,
    )
    p.add_argument("root", help="The OpenRLHF run's --ckpt_path (holds _actor/ and optionally _critic/).")
    p.add_argument("out", help="New output directory.")
    p.add_argument(
        "--pretrain",
        required=True,
        help="HF directory of the model the OpenRLHF run started from (architecture and tokenizer).",
    )
    p.add_argument(
        "--critic_pretrain", default=None, help="HF directory of the critic's starting model (default: --pretrain)."
    )
    p.add_argument("--tag", default=None, help="Tag to read, e.g. global_step20 (default: _actor/latest).")
    p.add_argument("--value_head_prefix", default="score", help="The OpenRLHF run's --value_head_prefix.")
    args = p.parse_args(argv)
    try:
        ckpt = convert(args.root, args.out, args.pretrain, args.critic_pretrain, args.tag, args.value_head_prefix)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written = "actor and critic" if ckpt.critic is not None else "actor"
    print(
        f"wrote {written} of {ckpt.root} tag {ckpt.tag} (ZeRO-{ckpt.zero_stage}, {ckpt.dp_world_size} ranks, "
        f"OpenRLHF global_step {ckpt.global_step}) to {args.out}. Use --pretrain {os.path.join(args.out, 'actor')}"
        + (f" --critic_pretrain {os.path.join(args.out, 'critic')}" if ckpt.critic is not None else "")
        + f". {OPTIMIZER_NOTE}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())

# ---- starting a run from one -------------------------------------------------------------------------------------
# `rlrun.ppo --load_openrlhf_checkpoint ROOT`: start the actor (and critic) from an OpenRLHF DeepSpeed checkpoint.
#
# `read_openrlhf_init` runs on every rank before the first collective (cheap checks of the layout, rlrun.compat.
# openrlhf_reader reads it); `init_from_openrlhf` runs after the roles are built: every actor/critic rank
# reads the files itself and writes the full weights into its FSDP2 shard / DeepSpeed ZeRO-0/1/2 partition; no
# collective, no temp files.


@dataclass(frozen=True)
class OpenRLHFInit:
    """What --load_openrlhf_checkpoint will read, checked on every rank before the first collective."""

    root: str
    tag: str
    actor: TagFiles
    critic: TagFiles | None  # None: the run has no critic, or the checkpoint has no _critic

    @property
    def global_step(self) -> int:
        return int(client_state_of(self.actor).get("global_step", 0))


def read_openrlhf_init(root: str, *, run_has_critic: bool) -> OpenRLHFInit:
    """Resolve the tag and check every file is there (reads only rank 0's model-states file, memory-mapped)."""
    try:
        tag = resolve_tag(os.path.abspath(root), None, name_tag=f"write the tag to use into {root}/_actor/latest")
    except CheckpointError as exc:
        raise CheckpointError(f"--load_openrlhf_checkpoint: {exc}") from None
    root = os.path.abspath(root)
    actor = inspect_tag(os.path.join(part_dir(root, "actor"), tag))
    critic = None
    if run_has_critic and os.path.isdir(part_dir(root, "critic")):
        tag_dir = os.path.join(part_dir(root, "critic"), tag)
        if not os.path.isdir(tag_dir):
            raise CheckpointError(
                f"--load_openrlhf_checkpoint {root}: _actor has tag {tag!r} but _critic does not "
                f"(tags there: {list_tags(part_dir(root, 'critic')) or 'none'}); point `latest` in "
                f"both "
                "at a tag they share"
            )
        critic = inspect_tag(tag_dir)
    return OpenRLHFInit(root, tag, actor, critic)


def _lazy_weights(part: str, tag: str, files: TagFiles) -> dict[str, Any]:
    """name -> tensor, or a zero_to_fp32 lazy tensor (`.contiguous()` materialises it): the optimizer files are
    memory-mapped, so ranks on one node share the page cache instead of each holding a full fp32 copy."""
    if files.zero_stage == 0:
        return read_deepspeed_weights(part, tag, files)[0]
    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint  # noqa: PLC0415

    try:
        with contextlib.redirect_stdout(io.StringIO()):
            return dict(get_fp32_state_dict_from_zero_checkpoint(part, tag=tag, lazy_mode=True))
    except (ValueError, FileNotFoundError, KeyError, NotImplementedError, RuntimeError, OSError) as exc:
        raise CheckpointError(
            f"{files.tag_dir}: DeepSpeed's zero_to_fp32 could not rebuild the weights: {type(exc).__name__}: {exc}"
        ) from exc


def hf_module_of(model: torch.nn.Module) -> torch.nn.Module:
    """The HF model inside a role's model: a DeepSpeed engine keeps it as `.module`, rlrun's critic
    (ScalarHeadModel) as `.hf`; FSDP2 shards in place and keeps the names."""
    inner = model.module if hasattr(model, "module") and hasattr(model, "optimizer") else model
    return getattr(inner, "hf", inner)  # type: ignore[arg-type]  # a DeepSpeed engine's .module is a Module


def init_from_openrlhf(plan: OpenRLHFInit, actor: torch.nn.Module | None, critic: torch.nn.Module | None) -> str:
    """Overwrite the wrapped actor's (and critic's) weights with the checkpoint's; every rank of the role reads
    the files itself (no collective). Returns a line for the log."""
    if actor is not None:
        weights = _lazy_weights(part_dir(plan.root, "actor"), plan.tag, plan.actor)
        apply_weights(hf_module_of(actor), actor_names(weights, plan.actor.tag_dir), f"{plan.actor.tag_dir} (actor)")
    if critic is not None and plan.critic is not None:
        weights = _lazy_weights(part_dir(plan.root, "critic"), plan.tag, plan.critic)
        apply_weights(
            hf_module_of(critic), critic_names(weights, plan.critic.tag_dir), f"{plan.critic.tag_dir} (critic)"
        )
    parts = "actor and critic" if plan.critic is not None else "actor"
    if plan.actor.zero_stage == 0 and any(
        t.is_floating_point() and t.dtype != torch.float32 for t in plan.actor.meta["module"].values()
    ):
        parts += " (ZeRO-0 in 16 bits: the checkpoint has no fp32 master weights; its 16-bit copy is used)"
    return (
        f"initialised the {parts} from OpenRLHF checkpoint {plan.root} tag {plan.tag} "
        f"(ZeRO-{plan.actor.zero_stage}, "
        f"{plan.actor.dp_world_size} ranks; OpenRLHF global_step {plan.global_step}); steps count from 0 here. "
        + OPTIMIZER_NOTE
    )
