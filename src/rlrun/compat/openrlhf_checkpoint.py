"""Write an OpenRLHF DeepSpeed checkpoint's weights into HF models, and the offline converter CLI.

The checkpoint is read by rlrun.compat.openrlhf_reader (HF-named fp32 weights). `apply_weights` copies such
weights into a (possibly FSDP2- or DeepSpeed-wrapped) HF model after checking every name and shape. Two ways in:
- `rlrun.ppo --load_openrlhf_checkpoint ROOT` (rlrun.compat.openrlhf_init: `plan_init` on every rank before the
  first collective, then `init_from_openrlhf` after the roles are built): every actor/critic rank reads the files
  itself and writes the full weights into its FSDP2 shard / DeepSpeed ZeRO-0/1/2 partition; no collective, no temp
  files.
- `python -m rlrun.compat.openrlhf_checkpoint ROOT OUT --pretrain HF_DIR [--critic_pretrain DIR] [--tag T]`
  (`convert`) writes `OUT/actor` and `OUT/critic` (HF directories for `--pretrain` / `--critic_pretrain`) and
  `OUT/openrlhf_state.json`.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

import torch

from rlrun.checkpoint.store import CheckpointError
from rlrun.compat.openrlhf_reader import OPTIMIZER_NOTE, OpenRLHFCheckpoint, read_openrlhf_checkpoint

STATE_FILE = "openrlhf_state.json"  # beside OUT/actor and OUT/critic: the checkpoint's summary()


# ---- into a model ---------------------------------------------------------------------------------------------


def load_weights(model: torch.nn.Module, state: dict[str, torch.Tensor], what: str) -> None:
    """Copy `state` into an unwrapped HF model (the converter): apply_weights against --pretrain's architecture."""
    apply_weights(model, state, what, target="--pretrain's architecture")


def convert(root: str, out: str, pretrain: str, critic_pretrain: str | None = None, tag: str | None = None,
            value_head_prefix: str = "score") -> OpenRLHFCheckpoint:
    """Write OUT/actor (and OUT/critic) as HF directories built on `pretrain`'s architecture and tokenizer,
    with the checkpoint's fp32 weights, plus OUT/openrlhf_state.json."""
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification, AutoTokenizer  # noqa: PLC0415

    for flag, path in (("--pretrain", pretrain), ("--critic_pretrain", critic_pretrain)):
        if path is not None and not os.path.isdir(path):
            raise CheckpointError(f"{flag} {path}: not a local HF model directory (the architecture and tokenizer "
                                  "come from it; OpenRLHF checkpoints store neither)")
    if os.path.exists(out) and os.listdir(out):
        raise CheckpointError(f"output {out} exists and is not empty; choose a new directory")
    ckpt = read_openrlhf_checkpoint(root, tag, value_head_prefix=value_head_prefix)
    actor = AutoModelForCausalLM.from_pretrained(pretrain, dtype=torch.float32)
    load_weights(actor, ckpt.actor, f"{root} actor ({ckpt.tag})")
    parts: list[tuple[str, torch.nn.Module]] = [("actor", actor)]
    if ckpt.critic is not None:
        critic = AutoModelForSequenceClassification.from_pretrained(critic_pretrain or pretrain, num_labels=1,
                                                                    dtype=torch.float32)
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
        mine = distribute_tensor(full.to(device=target.device, dtype=target.dtype), target.device_mesh,
                                 target.placements, src_data_rank=None)
        target.to_local().copy_(mine.to_local())
        return
    if hasattr(target, "ds_id"):
        raise CheckpointError("--load_openrlhf_checkpoint cannot write into a DeepSpeed ZeRO-3 model; convert the "
                              "checkpoint with `python -m rlrun.compat.openrlhf_checkpoint` and pass --pretrain")
    if hasattr(target, "_hp_mapping"):
        from deepspeed.utils import safe_set_full_fp32_param  # noqa: PLC0415 - only under --strategy deepspeed

        safe_set_full_fp32_param(target, full.to(target.device))
    target.copy_(full.to(device=target.device, dtype=target.dtype))


def apply_weights(hf_model: torch.nn.Module, weights: dict[str, Any], what: str, target: str = "this run's model") -> None:
    """Copy HF-named full weights into a (possibly FSDP2- or DeepSpeed-wrapped) HF model, one tensor at a time.

    Every name and (global) shape is checked before the first write, naming the first difference. A key the
    checkpoint lacks is accepted only when the model ties it to one the checkpoint has (e.g. lm_head.weight
    tied to embed_tokens.weight)."""
    own = hf_model.state_dict(keep_vars=True)
    kind = type(hf_model).__name__
    for name, value in weights.items():
        if name not in own:
            raise CheckpointError(f"{what}: tensor {name!r} has no counterpart in {target} ({kind}); is --pretrain "
                                  "the model the OpenRLHF run started from?")
        if tuple(own[name].shape) != tuple(value.shape):
            raise CheckpointError(f"{what}: tensor {name!r} has shape {tuple(value.shape)} in the checkpoint but "
                                  f"{tuple(own[name].shape)} in {target}; use the model the OpenRLHF run started from "
                                  "as --pretrain (--critic_pretrain)")
    present = {id(own[k]) for k in weights}
    missing = [k for k in own if k not in weights and id(own[k]) not in present]
    if missing:
        raise CheckpointError(f"{what}: the checkpoint has no tensor {missing[0]!r} ({len(missing)} missing) that "
                              f"{target} ({kind}) needs")
    with torch.no_grad():
        for name, value in weights.items():
            _set_full(own[name], _tensor(value).float())


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m rlrun.compat.openrlhf_checkpoint",
                                description="Convert an OpenRLHF DeepSpeed checkpoint (ROOT/_actor, ROOT/_critic) "
                                            "into HF directories OUT/actor and OUT/critic for rlrun's --pretrain "
                                            "and --critic_pretrain. Weights only: " + OPTIMIZER_NOTE)
    p.add_argument("root", help="The OpenRLHF run's --ckpt_path (holds _actor/ and optionally _critic/).")
    p.add_argument("out", help="New output directory.")
    p.add_argument("--pretrain", required=True, help="HF directory of the model the OpenRLHF run started from "
                                                     "(architecture and tokenizer).")
    p.add_argument("--critic_pretrain", default=None, help="HF directory of the critic's starting model "
                                                           "(default: --pretrain).")
    p.add_argument("--tag", default=None, help="Tag to read, e.g. global_step20 (default: _actor/latest).")
    p.add_argument("--value_head_prefix", default="score", help="The OpenRLHF run's --value_head_prefix.")
    args = p.parse_args(argv)
    try:
        ckpt = convert(args.root, args.out, args.pretrain, args.critic_pretrain, args.tag, args.value_head_prefix)
    except CheckpointError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    written = "actor and critic" if ckpt.critic is not None else "actor"
    print(f"wrote {written} of {ckpt.root} tag {ckpt.tag} (ZeRO-{ckpt.zero_stage}, {ckpt.dp_world_size} ranks, "
          f"OpenRLHF global_step {ckpt.global_step}) to {args.out}. Use --pretrain {os.path.join(args.out, 'actor')}"
          + (f" --critic_pretrain {os.path.join(args.out, 'critic')}" if ckpt.critic is not None else "")
          + f". {OPTIMIZER_NOTE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
