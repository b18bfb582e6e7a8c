"""LoRA adapters (--lora_rank): the one module that talks to PEFT.

A trained model gets PEFT LoRA layers while it is still on the meta device (`add_adapters`), so the strategy shards
and fills it like any other model: `LoraWeights` answers for every parameter of the PEFT model, base weights from
the checkpoint under their HF names (PEFT adds `base_model.model.` and `.base_layer`), adapter weights from an
adapter directory or from PEFT's own initialisation (A: kaiming-uniform, B: zeros, so the model starts equal to its
base), seeded per tensor so that every rank draws the same values.

Names: PEFT's in-memory names (`...q_proj.lora_A.default.weight`) are `peft names`; the base model's are `hf names`
(`...q_proj.weight`); PEFT's saved adapter files drop the adapter name (`...q_proj.lora_A.weight`).
"""

from __future__ import annotations

import copy
import json
import math
import os
import warnings
import zlib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
from torch import nn

from rlrun.config.model import PretrainedConfig
from rlrun.models.conversions import per_expert_names
from rlrun.models.moe import routers
from rlrun.models.weights import Unfilled, WeightSource, open_weights
from rlrun.runtime.errors import ConfigError, MissingExtraError

if TYPE_CHECKING:  # peft is imported when LoRA is asked for (_peft)
    from peft import LoraConfig, PeftModel

ADAPTER = "default"  # PEFT's adapter name; rlrun trains one adapter per model
PEFT_PREFIX = "base_model.model."
_A, _B = f".lora_A.{ADAPTER}.weight", f".lora_B.{ADAPTER}.weight"

ADAPTER_CONFIG = "adapter_config.json"  # PEFT's adapter directory marks itself with this file


def _peft():
    try:
        import peft  # noqa: PLC0415 - install_requires, imported only when LoRA is asked for
    except ImportError:
        raise MissingExtraError("peft", "peft", "--lora_rank") from None
    return peft


@dataclass(frozen=True)
class LoraSettings:
    rank: int
    alpha: float
    target_modules: tuple[str, ...]
    dropout: float = 0.0

    @classmethod
    def of(cls, model: PretrainedConfig) -> LoraSettings | None:
        """The settings --lora_rank and its companions ask for; None without --lora_rank."""
        if model.lora_rank <= 0:
            return None
        return cls(model.lora_rank, float(model.lora_alpha), tuple(model.target_modules), model.lora_dropout)

    @property
    def scaling(self) -> float:
        """PEFT's: the adapter's product B @ A is scaled by alpha / rank."""
        return self.alpha / self.rank

    def peft_config(self, model: nn.Module | None = None) -> LoraConfig:
        """PEFT's config. On a MoE `model`, all-linear names its nn.Linear layers but the output head and those named
        as a checkpoint names one expert's projections (gate_proj, up_proj, down_proj; w1-w3): PEFT reads those
        names, and its own all-linear, as the routed experts' fused parameters, which rlrun's weight loading and
        sync do not read (add_adapters refuses adapters there)."""
        targets: str | list[str] = "all-linear" if self.target_modules == ("all-linear",) else list(self.target_modules)
        if targets == "all-linear" and model is not None and routers(model):
            head = getattr(model, "get_output_embeddings", None)
            output = head() if callable(head) else None
            linear = {
                n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear) and m is not output
            }
            targets = sorted(linear - _read_as_experts(model, linear & per_expert_names(model)))
        return _peft().LoraConfig(
            r=self.rank, lora_alpha=self.alpha, target_modules=targets, lora_dropout=self.dropout, bias="none"
        )


# ---- names ---------------------------------------------------------------------------------------------------


def is_adapter(name: str) -> bool:
    return ".lora_A." in name or ".lora_B." in name


def hf_name(peft_name: str) -> str:
    """`base_model.model.model.layers.0.self_attn.q_proj.base_layer.weight` -> `model.layers.0.self_attn.q_proj.weight`
    (a name inside an outer module keeps its outer prefix: `hf.base_model.model.x` -> `hf.x`)."""
    head, sep, tail = peft_name.partition(PEFT_PREFIX)
    name = head + tail if sep else peft_name
    return name.replace(".base_layer.", ".")


def saved_adapter_name(peft_name: str) -> str:
    """The name PEFT's save_pretrained gives an adapter tensor (the adapter name dropped)."""
    return peft_name.replace(f".{ADAPTER}.", ".")


def lora_pairs(names: list[str]) -> dict[str, tuple[str, str]]:
    """base-layer weight (peft name) -> its (lora_A, lora_B) peft names, for every adapted linear layer in `names`."""
    present = set(names)
    out = {}
    for name in names:
        if name.endswith(_A):
            module = name[: -len(_A)]
            if module + _B in present:
                out[module + ".base_layer.weight"] = (name, module + _B)
    return out


# ---- building ------------------------------------------------------------------------------------------------


def lora_init(name: str, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    """PEFT's default initialisation, the same on every rank: A [r, in] uniform in +-1/sqrt(in) (kaiming-uniform with
    a=sqrt(5)), B zeros (so the adapted model starts as its base)."""
    if ".lora_B." in name:
        return torch.zeros(shape)
    bound = 1.0 / math.sqrt(shape[1])
    gen = torch.Generator().manual_seed(seed * 1_000_003 + zlib.crc32(name.encode()))
    return torch.empty(shape).uniform_(-bound, bound, generator=gen)


class LoraWeights:
    """A weight source for a PEFT-wrapped model: base tensors from `base` under their HF names, adapters from
    `adapter` (a saved adapter directory, PEFT's saved names) or freshly initialised (`lora_init`)."""

    def __init__(
        self,
        base: WeightSource,
        adapter_shapes: Mapping[str, tuple[int, ...]],
        seed: int,
        adapter: WeightSource | None = None,
    ) -> None:
        self.base, self.adapter_shapes, self.seed, self.adapter = base, dict(adapter_shapes), seed, adapter

    def shape(self, name: str) -> tuple[int, ...] | None:
        if is_adapter(name):
            return self.adapter_shapes.get(name)
        return self.base.shape(hf_name(name))

    def read(self, name: str, rows: tuple[int, int] | None) -> torch.Tensor:
        if not is_adapter(name):
            return self.base.read(hf_name(name), rows)
        if self.adapter is not None:
            full = self.adapter.read(saved_adapter_name(name), None)
        else:
            full = lora_init(name, self.adapter_shapes[name], self.seed)
        return full if rows is None else full[rows[0] : rows[1]]


def add_adapters(
    unfilled: Unfilled,
    settings: LoraSettings,
    seed: int,
    *,
    inner: str = "",
    adapter: WeightSource | None = None,
    trainable: tuple[str, ...] = (),
) -> Unfilled:
    """`unfilled`'s model with LoRA layers on `settings.target_modules`, still on the meta device, and a weight
    source that fills it. `inner`: the attribute holding the HF model when `unfilled.model` wraps one (a critic's
    `hf`). `trainable`: names of modules that stay trained whole (a critic's value head). Only adapter parameters
    (and those) require grad afterwards."""
    peft = _peft()
    outer = unfilled.model
    parent_path, _, attr = inner.rpartition(".")
    parent = outer
    for part in filter(None, parent_path.split(".")):
        parent = getattr(parent, part)
    hf = getattr(parent, attr) if inner else outer
    found = routers(hf)
    moe = {name for name, m in hf.named_modules() if any(m is r for r in found) or name.endswith(".experts")}
    try:
        with warnings.catch_warnings():  # PEFT asks transformers a deprecated question; not the user's concern
            warnings.simplefilter("ignore", FutureWarning)
            wrapped = peft.get_peft_model(hf, settings.peft_config(hf))
    except ValueError as exc:
        linear = sorted({n.rsplit(".", 1)[-1] for n, m in hf.named_modules() if isinstance(m, nn.Linear)})
        raise ConfigError(
            f"--target_modules {' '.join(settings.target_modules)}: {exc} (this model's linear "
            f"layers: {', '.join(linear)}; or use all-linear)"
        ) from None
    if routed := sorted({n for n, _ in wrapped.named_parameters() if is_adapter(n) and _under(n, moe)}):
        raise ConfigError(
            f"--target_modules {' '.join(settings.target_modules)} puts LoRA on MoE routers or routed experts "
            f"({routed[0]}; PEFT reads {', '.join(sorted(per_expert_names(hf)))} as the fused experts): rlrun's weight "
            "loading and sync do not read PEFT's adapters on fused experts yet; target the attention layers "
            "(all-linear does)"
        )
    if inner:
        setattr(parent, attr, wrapped)
    else:
        outer = wrapped
    for name, module in outer.named_modules():
        if any(name == t or name.endswith("." + t) for t in trainable):
            module.requires_grad_(True)
    shapes = {n: tuple(p.shape) for n, p in outer.named_parameters() if is_adapter(n)}
    if unfilled.prefix:
        shapes = {n.removeprefix(unfilled.prefix): s for n, s in shapes.items()}
    return Unfilled(
        outer, LoraWeights(unfilled.weights, shapes, seed, adapter), prefix=unfilled.prefix, note=unfilled.note
    )


def _read_as_experts(model: nn.Module, names: set[str]) -> set[str]:
    """The LoRA target names among `names` that PEFT applies to the fused routed experts (its transformers-5 mapping
    of per-expert checkpoint names; e.g. Qwen3-MoE's gate_proj, not Qwen2-MoE's), found by adapting a copy."""
    out = set()
    for name in names:
        probe = copy.deepcopy(model)
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                _peft().get_peft_model(probe, _peft().LoraConfig(r=1, target_modules=[name]))
        except ValueError:  # "cannot convert up_proj without gate_proj": fused into the experts' gate_up_proj
            out.add(name)
            continue
        if any(is_adapter(n) and ".experts." in n for n, _ in probe.named_parameters()):
            out.add(name)
    return out


def _under(name: str, modules: set[str]) -> bool:
    """Whether PEFT parameter `name` (base_model.model.<module>...) belongs to one of `modules` (HF names)."""
    return any(name.removeprefix(PEFT_PREFIX).startswith(m + ".") for m in modules)


def add_scalar_adapters(unfilled: Unfilled, settings: LoraSettings, seed: int) -> Unfilled:
    """A ScalarHeadModel (critic, reward model; its HF model at `.hf`) with LoRA on its transformer body only: the
    value/score head stays outside the adapters, trained whole (a LoRA on a freshly initialised one-row head would
    be a rank-r update of a random vector), and the body keeps the call ScalarHeadModel makes
    (`hf.base_model(...).last_hidden_state`)."""
    # the ignore: ScalarHeadModel's `hf` is a PreTrainedModel (its module imports this one, so not named here)
    hf = unfilled.model.hf
    return add_adapters(unfilled, settings, seed, inner=f"hf.{hf.base_model_prefix}")  # type: ignore[union-attr]


def peft_model_of(model: nn.Module) -> PeftModel | None:
    """The PEFT model in `model` (itself, a DeepSpeed engine's module, or a submodule), None when it has none."""
    peft_model_cls: type[PeftModel] = _peft().PeftModel
    return next((m for m in model.modules() if isinstance(m, peft_model_cls)), None)


@contextmanager
def adapters_disabled(model: nn.Module) -> Iterator[None]:
    """While open, `model` computes as its base model (PEFT's disable_adapter): the LoRA actor's reference."""
    peft_model = peft_model_of(model)
    assert peft_model is not None, "adapters_disabled needs a model with LoRA adapters"
    with peft_model.disable_adapter():
        yield


# ---- merging -------------------------------------------------------------------------------------------------


def merged_weight(base: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """[out, in] base + scaling * (B [out, r] @ A [r, in]), in base's dtype (`merge_into` on a copy of base)."""
    return merge_into(base.clone(), a, b, scaling)


def merge_into(dest: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scaling: float) -> torch.Tensor:
    """dest (holding the base weight) += scaling * B @ A, in place, in dest's dtype: one fused matmul-add and no
    [out, in] temporary (the weight sync merges every adapted layer at every sync)."""
    return dest.addmm_(b.to(dest.dtype), a.to(dest.dtype), alpha=scaling)


def merged_state_dict(state: Mapping[str, torch.Tensor], scaling: float) -> dict[str, torch.Tensor]:
    """A PEFT model's full state (peft names) -> the merged base model's (hf names, adapters folded in)."""
    pairs = lora_pairs(list(state))
    out = {}
    for name, tensor in state.items():
        if is_adapter(name):
            continue
        if name in pairs:
            a, b = pairs[name]
            tensor = merged_weight(tensor, state[a], state[b], scaling)
        out[hf_name(name)] = tensor
    return out


# ---- adapter directories as --pretrain ------------------------------------------------------------------------


@dataclass(frozen=True)
class AdapterDir:
    path: str
    base: str  # the base model the adapter was trained on (PEFT's base_model_name_or_path)
    settings: LoraSettings


def adapter_dir(path: str | None) -> AdapterDir | None:
    """A saved PEFT LoRA adapter at `path` (its adapter_config.json), None when `path` is not one."""
    if path is None or not os.path.isfile(os.path.join(path, ADAPTER_CONFIG)):
        return None
    with open(os.path.join(path, ADAPTER_CONFIG)) as f:
        config = json.load(f)
    if str(config.get("peft_type", "LORA")).upper() != "LORA":
        raise ConfigError(f"{path}: a {config.get('peft_type')} adapter; rlrun trains LoRA adapters only")
    base = config.get("base_model_name_or_path")
    if not base:
        raise ConfigError(
            f"{path}/{ADAPTER_CONFIG} names no base_model_name_or_path; set it to the base model's directory or hub id"
        )
    targets = config.get("target_modules") or ["all-linear"]
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    settings = LoraSettings(
        int(config["r"]),
        float(config.get("lora_alpha", config["r"])),
        targets,
        float(config.get("lora_dropout") or 0.0),
    )
    return AdapterDir(path, str(base), settings)


def refuse_adapter_as_reference(pretrain: str | None, why: str, alternative: str = "") -> None:
    """The LoRA policy's adapters-off forward is its reference (PPO's KL term, DPO). With an adapter directory as
    --pretrain that forward is the adapter's base model, not the policy the run starts from: refused."""
    if adapter_dir(pretrain) is not None:
        raise ConfigError(
            f"--pretrain {pretrain} is a LoRA adapter directory: {why}, and with its adapters disabled "
            f"the "
            "policy is that adapter's base model, not the initial policy the reference must be; pass the "
            f"merged model as --pretrain (what --save_merged writes to <save_path>/merged){alternative}"
        )


def adapter_weights(path: str) -> WeightSource:
    weights = open_weights(path)
    if weights is None:
        raise ConfigError(f"{path}: no adapter_model.safetensors or adapter_model.bin readable")
    return weights
