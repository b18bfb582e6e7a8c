"""A saved PEFT LoRA adapter directory (adapter_config.json + adapter_model.safetensors) as a model path: --pretrain,
and a critic's or reward model's path (models/loading.py follows it through these functions).

The adapter names its base (base_model_name_or_path: a folder, or a hub id and commit, which `resolve_adapter_pretrain`
downloads at start-up like any --pretrain hub id; the loaders then find it in the hub cache and never download). The
config and weights are the base's; a trained policy gets the saved adapters back on the unmerged base (loading.py's
`trained_policy`), every frozen copy reads base + adapter merged (`AdapterMerged`), equal to the merged export. Only
plain LoRA is read: an adapter rlrun's merge would get wrong (DoRA, rslora, per-module ranks, ...) is refused in one
line rather than loaded as something else.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from typing import TypeVar

import torch

from rlrun.config.model import PretrainedConfig
from rlrun.models import hub
from rlrun.models.lora import (
    ADAPTER_CONFIG,
    PEFT_PREFIX,
    AdapterDir,
    LoraSettings,
    adapter_dir,
    adapter_weights,
    is_adapter,
    merged_weight,
)
from rlrun.models.weights import Rows, WeightSource
from rlrun.runtime.errors import ConfigError

Shape = tuple[int, ...]
REWARD_NORM_FILE = "reward_norm.json"  # a LoRA reward model's --normalize_reward mean/std (roles/export.py)
_DEFAULTS = PretrainedConfig()  # a setting still at its default follows the adapter
_MODEL_FLAGS = ("pretrain", "critic_pretrain", "reward_pretrain")
P = TypeVar("P", bound=PretrainedConfig)  # a trainer's model section (PPO's ModelConfig)

# adapter_config.json keys whose (truthy) values make an adapter other than base + alpha/r * B @ A on the modules
# its target_modules name: merging it as plain LoRA would load a different model.
_NOT_PLAIN = (
    ("use_dora", "uses DoRA (use_dora)"),
    ("use_rslora", "uses rank-stabilised scaling (use_rslora)"),
    ("rank_pattern", "gives some modules other ranks (rank_pattern)"),
    ("alpha_pattern", "gives some modules other alphas (alpha_pattern)"),
    ("fan_in_fan_out", "stores its weights transposed (fan_in_fan_out)"),
    ("lora_bias", "trains a bias beside lora_B (lora_bias)"),
    ("layers_to_transform", "adapts some layers only (layers_to_transform)"),
    ("layer_replication", "replicates layers (layer_replication)"),
    ("target_parameters", "adapts parameters rather than modules (target_parameters)"),
    ("trainable_token_indices", "trains some token embeddings (trainable_token_indices)"),
)


# ---- the adapter's config -----------------------------------------------------------------------------------------


def _raw_config(path: str) -> dict:
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        return json.load(f)


def _not_plain(config: Mapping, policy: bool) -> str | None:
    """Why rlrun cannot load this adapter as plain LoRA, None when it can. A policy takes no modules_to_save: those
    modules would have to be trained whole beside the adapters; a scalar model's saved head is one (SEQ_CLS)."""
    for key, what in _NOT_PLAIN:
        if config.get(key):
            return what
    if (bias := config.get("bias") or "none") != "none":
        return f"trains biases (bias: {bias})"
    if policy and config.get("modules_to_save"):
        return f"has whole modules saved with it (modules_to_save: {config['modules_to_save']})"
    return None


def checked_adapter(path: str | None, flag: str, *, policy: bool) -> AdapterDir | None:
    """The adapter at `path` when it is one rlrun loads, None when `path` is no adapter directory."""
    adapter = adapter_dir(path)
    if adapter is None:
        return None
    if (why := _not_plain(_raw_config(adapter.path), policy)) is not None:
        raise ConfigError(
            f"--{flag} {adapter.path}: the adapter {why}; rlrun loads plain LoRA adapters only: merge "
            "it into its base (PEFT's merge_and_unload, then save_pretrained) and pass that folder"
        )
    return adapter


# ---- its base -----------------------------------------------------------------------------------------------------


def _hub_name(adapter: AdapterDir) -> str:
    """The base as a hub name, at the commit the adapter was trained on when its config says (export writes it)."""
    revision = _raw_config(adapter.path).get("revision")
    return f"{adapter.base}@{revision}" if revision else adapter.base


def _not_here(adapter: AdapterDir, flag: str) -> str:
    return (
        f"--{flag} {adapter.path}: its base model {adapter.base} ({ADAPTER_CONFIG}'s base_model_name_or_path) is "
        "not on this machine; copy it here, or set base_model_name_or_path to its folder here or its hub id"
    )


def base_here(adapter: AdapterDir) -> str | None:
    """The base's folder on this machine (the folder named, or its hub snapshot in the cache), None when absent."""
    if os.path.isdir(adapter.base):
        return adapter.base
    return hub.cached(_hub_name(adapter), "model")


def base_folder(adapter: AdapterDir, flag: str) -> str:
    """`base_here`, or ConfigError saying how to get the base here. Never downloads: `resolve_adapter_pretrain`
    does that once at start-up, before any rank loads."""
    if (folder := base_here(adapter)) is not None:
        return folder
    name = _hub_name(adapter)
    if hub.parse_repo_id(name) is None:
        raise ConfigError(_not_here(adapter, flag))
    raise ConfigError(
        f"--{flag} {adapter.path} is a LoRA adapter on {adapter.base}, which cannot be read: it is not "
        f"in this machine's Hugging Face cache ({hub.cache_dir()}); download it (`hf download "
        f"{adapter.base}`) or set {ADAPTER_CONFIG}'s base_model_name_or_path to its folder"
    )


def model_folder(path: str, flag: str) -> str:
    """Where the model at `path` has its config and weights: `path`, or an adapter directory's base."""
    adapter = adapter_dir(path)
    return path if adapter is None else base_folder(adapter, flag)


def _resolve_base(adapter: AdapterDir, flag: str, download: bool) -> None:
    """The base downloaded into the hub cache when it is a hub id (hub.resolve, as for a --pretrain hub id); a dry
    run (not `download`) fails only on what the hub refuses."""
    if os.path.isdir(adapter.base):
        return
    name = _hub_name(adapter)
    if hub.parse_repo_id(name) is None:
        if download:
            raise ConfigError(_not_here(adapter, flag))
        return  # a dry run on a machine without that folder: planning says so
    try:
        hub.resolve(name, "model", flag, download=download)
    except ConfigError as exc:  # its message names the hub id as the flag's value: say it is the adapter's base
        why = str(exc).removeprefix(f"--{flag} {name}: ")
        raise ConfigError(
            f"--{flag} {adapter.path} is a LoRA adapter on {adapter.base}, which cannot be read: {why}"
        ) from None


# ---- settings -----------------------------------------------------------------------------------------------------


def module_kinds(targets: tuple[str, ...]) -> tuple[str, ...]:
    """Target module names as kinds (`model.layers.0.self_attn.q_proj` -> `q_proj`), sorted: PEFT saves all-linear as
    every adapted module's full name, which --target_modules should not have to spell."""
    return tuple(sorted({name.rsplit(".", 1)[-1] for name in targets}))


def _check_agrees(model: PretrainedConfig, adapter: AdapterDir) -> None:
    """A rank, alpha or targets given beside an adapter directory must be the adapter's: it trains further as saved."""
    saved, where = adapter.settings, f"--pretrain {adapter.path}"
    if model.lora_rank not in (_DEFAULTS.lora_rank, saved.rank):
        raise ConfigError(
            f"--lora_rank {model.lora_rank}: {where} is a LoRA adapter of rank {saved.rank} "
            f"({ADAPTER_CONFIG}), trained further as it is; drop --lora_rank or pass --lora_rank "
            f"{saved.rank}"
        )
    if model.lora_alpha not in (_DEFAULTS.lora_alpha, saved.alpha):
        raise ConfigError(
            f"--lora_alpha {model.lora_alpha}: {where} was trained with lora_alpha {saved.alpha:g}; drop "
            "--lora_alpha (alpha / rank scales what the adapter learned)"
        )
    given, kinds = tuple(model.target_modules), module_kinds(saved.target_modules)
    if given != _DEFAULTS.target_modules and set(module_kinds(given)) != set(kinds):
        raise ConfigError(
            f"--target_modules {' '.join(given)}: {where} adapts {' '.join(kinds)}; drop --target_modules"
        )


def _dropout(model: PretrainedConfig, saved: LoraSettings) -> float:
    """Dropout is a training choice, not part of what the adapter computes: a given one wins."""
    return saved.dropout if model.lora_dropout == _DEFAULTS.lora_dropout else model.lora_dropout


def resolve_adapter_pretrain(model: P, *, download: bool = True) -> P:
    """`model` with the LoRA settings of the adapter directory --pretrain names (rank, alpha, targets as module kinds,
    dropout), its base resolved or downloaded; `model` itself when --pretrain is no adapter. --pretrain stays the
    adapter directory: the loaders follow the base themselves. A critic's or reward model's adapter has its base
    resolved too (its settings are its own)."""
    for flag in _MODEL_FLAGS[1:]:
        if (other := checked_adapter(getattr(model, flag, None), flag, policy=False)) is not None:
            _resolve_base(other, flag, download)
    adapter = checked_adapter(model.pretrain, "pretrain", policy=True)
    if adapter is None:
        return model
    _resolve_base(adapter, "pretrain", download)
    _check_agrees(model, adapter)
    saved = adapter.settings
    alpha = int(saved.alpha) if saved.alpha.is_integer() else saved.alpha
    return dataclasses.replace(
        model,
        lora_rank=saved.rank,
        lora_alpha=alpha,  # type: ignore[arg-type]  # an int field; a fractional saved alpha stays a float
        target_modules=module_kinds(saved.target_modules),
        lora_dropout=_dropout(model, saved),
    )


def lora_settings(model: PretrainedConfig) -> LoraSettings | None:
    """The trained policy's LoRA: an adapter directory's exact settings (its targets as saved, so its adapters go
    back on exactly the modules they came from), else --lora_rank's (None without)."""
    adapter = checked_adapter(model.pretrain, "pretrain", policy=True)
    if adapter is None:
        return LoraSettings.of(model)
    _check_agrees(model, adapter)
    return dataclasses.replace(adapter.settings, dropout=_dropout(model, adapter.settings))


# ---- weights ------------------------------------------------------------------------------------------------------


def saved_shapes(path: str, saved: WeightSource) -> dict[str, Shape]:
    """Every tensor in the adapter's weight file, by its saved name (a WeightSource answers by name only)."""
    file = os.path.join(path, "adapter_model.safetensors")
    if os.path.isfile(file):
        from safetensors import safe_open  # noqa: PLC0415 - transformers' own dependency

        with safe_open(file, framework="pt", device="cpu") as handle:
            names = list(handle.keys())
    else:
        names = list(
            torch.load(os.path.join(path, "adapter_model.bin"), map_location="cpu", mmap=True, weights_only=True)
        )
    return {name: shape for name in names if (shape := saved.shape(name)) is not None}


def check_fits(adapter: AdapterDir, flag: str, expected: Mapping[str, Shape], found: Mapping[str, Shape]) -> None:
    """ConfigError unless the adapter's tensors `found` are exactly `expected` (saved names and shapes): an adapter
    trained on another model, or edited, would otherwise load partly or fail mid-fill."""
    where = f"--{flag} {adapter.path}"
    fix = "it does not fit this base (trained on another model, or edited): pass it with the base it was trained on"
    if extra := [name for name in found if name not in expected]:
        raise ConfigError(
            f"{where}: the adapter holds {extra[0]}, which this model has no place for ({len(extra)} "
            f"such tensors); {fix}"
        )
    if wrong := [name for name, shape in expected.items() if found.get(name) != shape]:
        has = found.get(wrong[0])
        raise ConfigError(
            f"{where}: the adapter lacks {wrong[0]} of shape {list(expected[wrong[0]])} (it has "
            f"{list(has) if has is not None else 'none'}; {len(wrong)} tensors differ); {fix}"
        )


class AdapterMerged:
    """A base model's weights with a saved LoRA adapter merged in as they are read: base + alpha/r * B @ A for every
    adapted weight (HF names). A row slice merges only those rows (B's rows @ A), so a sharded rank reads no more
    than its shard. `whole_modules`: tensors the adapter saves whole (PEFT's modules_to_save, a scalar model's
    `base_model.model.score.weight`) replace the base's."""

    def __init__(
        self, base: WeightSource, adapter: AdapterDir, *, whole_modules: bool = False, flag: str = "pretrain"
    ) -> None:
        self.base, self.adapter, self.whole_modules = base, adapter, whole_modules
        self.saved = adapter_weights(adapter.path)
        self.scaling = adapter.settings.scaling
        self._check(saved_shapes(adapter.path, self.saved), flag)

    def _check(self, found: Mapping[str, Shape], flag: str) -> None:
        """Shapes only, before anything is read: each lora_A/lora_B pair over a 2-D base weight, at the saved rank."""
        rank, expected = self.adapter.settings.rank, {}
        for a in (name for name in found if name.endswith(".lora_A.weight")):
            module = a.removesuffix(".lora_A.weight")
            weight = self.base.shape(module.removeprefix(PEFT_PREFIX) + ".weight")
            if module + ".lora_B.weight" in found and weight is not None and len(weight) == 2:
                expected[a], expected[module + ".lora_B.weight"] = (rank, weight[1]), (weight[0], rank)
        check_fits(
            self.adapter,
            flag,
            expected,
            {name: shape for name, shape in found.items() if is_adapter(name) or not self.whole_modules},
        )
        if not expected:
            raise ConfigError(
                f"--{flag} {self.adapter.path}: the adapter holds no LoRA tensors; pass a directory "
                "PEFT's save_pretrained wrote (adapter_model.safetensors with lora_A/lora_B weights)"
            )

    def _whole(self, name: str) -> str | None:
        saved = PEFT_PREFIX + name
        return saved if self.whole_modules and self.saved.shape(saved) is not None else None

    def _pair(self, name: str) -> tuple[str, str] | None:
        module = PEFT_PREFIX + name.removesuffix(".weight")
        a, b = module + ".lora_A.weight", module + ".lora_B.weight"
        return (a, b) if name.endswith(".weight") and self.saved.shape(a) is not None else None

    def shape(self, name: str) -> Shape | None:
        whole = self._whole(name)
        return self.saved.shape(whole) if whole is not None else self.base.shape(name)

    def read(self, name: str, rows: Rows | None) -> torch.Tensor:
        if (whole := self._whole(name)) is not None:
            return self.saved.read(whole, rows)
        base = self.base.read(name, rows)
        if (pair := self._pair(name)) is None:
            return base
        return merged_weight(base, self.saved.read(pair[0], None), self.saved.read(pair[1], rows), self.scaling)


def base_source(source: WeightSource) -> WeightSource:
    """The unmerged base under an AdapterMerged (what a trained policy's saved adapters go back onto), else `source`."""
    return source.base if isinstance(source, AdapterMerged) else source


# ---- what else an adapter directory holds ------------------------------------------------------------------------


def saved_mean_std(path: str) -> tuple[float, float] | None:
    """A LoRA reward model's --normalize_reward mean/std (REWARD_NORM_FILE: an adapter config cannot hold them)."""
    file = os.path.join(path, REWARD_NORM_FILE)
    if not os.path.isfile(file):
        return None
    with open(file) as f:
        norm = json.load(f)
    if not isinstance(norm, dict) or "mean" not in norm or "std" not in norm:
        raise ConfigError(
            f'{file}: expected {{"mean": ..., "std": ...}} (what rlrun\'s export writes), got '
            f"{json.dumps(norm)[:80]}; fix or delete it"
        )
    return float(norm["mean"]), float(norm["std"])
