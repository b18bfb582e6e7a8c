"""Model and tokenizer construction: HF directories, or the embedded tiny model when offline.

A saved PEFT LoRA adapter directory stands for its base wherever a model path is read (models/adapter_pretrain.py):
the config, weights and (lacking its own) tokenizer are the base's, the frozen copies read base + adapter merged, and
the trained policy (`trained_policy`) gets the saved adapters back on the unmerged base.
"""

from __future__ import annotations

import copy
import dataclasses
import json
import os
from typing import TypedDict

import torch
from torch import nn
from transformers import (
    AutoConfig,
    AutoModelForSequenceClassification,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)
from transformers import PretrainedConfig as HFConfig

from rlrun.config.model import PretrainedConfig
from rlrun.models.adapter_pretrain import (
    REWARD_NORM_FILE,
    AdapterMerged,
    base_folder,
    base_here,
    base_source,
    check_fits,
    checked_adapter,
    lora_settings,
    model_folder,
    resolve_adapter_pretrain,
    saved_mean_std,
    saved_shapes,
)
from rlrun.models.architecture import AutoClass, policy_auto_class
from rlrun.models.conversions import Converted, conversions
from rlrun.models.lora import adapter_dir, adapter_weights, add_adapters, is_adapter, saved_adapter_name
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config_for_size
from rlrun.models.weights import (
    Chained,
    FileWeights,
    MemoryWeights,
    Unfilled,
    WeightSource,
    missing,
    open_weights,
    params_on_meta,
    state_dict_weights,
)
from rlrun.runtime.errors import ConfigError, MissingExtraError

__all__ = [
    "TOKENIZER_FILES",
    "tokenizer_missing",
    "load_tokenizer",
    "load_model_config",
    "policy_weights",
    "unfilled_causal_lm",
    "trained_policy",
    "unfilled_trained_policy",
    "unfilled_policy",
    "load_causal_lm",
    "scalar_model_from",
    "unfilled_scalar_model",
    "ScalarHeadModel",
    "config_mean_std",
    "load_critic",
    "seeded_head",
    "init_score_head",
    "load_reward_model",
    "score_head",
    "position_ids_from",
    # the adapter-directory part (models/adapter_pretrain.py), importable from here with the loaders that use it
    "REWARD_NORM_FILE",
    "AdapterMerged",
    "base_source",
    "lora_settings",
    "resolve_adapter_pretrain",
]


def _check_dir(flag: str, path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError(
            f"--{flag} {path}: not a local directory (rlrun loads models from local paths; "
            f"download the model first, e.g. with `huggingface-cli download`)"
        )


class _AttnKwargs(TypedDict, total=False):
    """The attention keyword from_pretrained/from_config take (absent: transformers' default for the model)."""

    attn_implementation: str


def _attn_kwargs(model: PretrainedConfig) -> _AttnKwargs:
    if model.flash_attn:
        try:
            import flash_attn  # noqa: F401, PLC0415 - optional extra (rlrun[flash-attn]), GPU only
        except ImportError:
            raise MissingExtraError("flash-attn", "flash-attn", "--flash_attn") from None
        return {"attn_implementation": "flash_attention_2"}
    if model.attn_implementation:
        return {"attn_implementation": model.attn_implementation}
    return {}


# What any saved HF tokenizer has at least one of (fast: tokenizer.json; slow: vocab files, sentencepiece models).
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "tokenizer.model",
    "vocab.json",
    "vocab.txt",
    "spiece.model",
)


def _has_tokenizer(folder: str) -> bool:
    return any(os.path.exists(os.path.join(folder, name)) for name in TOKENIZER_FILES)


def tokenizer_missing(model: PretrainedConfig) -> str | None:
    """Why the policy's tokenizer cannot be read on this machine, or None when it can. A --dry_run on a login node
    may see no folder at all, or one with config.json alone (enough to plan layout and memory). An adapter
    directory's own tokenizer files win (a fine-tune may add tokens); lacking them, its base's are read."""
    if model.pretrain is None:
        return None
    if not os.path.isdir(model.pretrain):
        return f"--pretrain {model.pretrain} is not on this machine"
    if _has_tokenizer(model.pretrain):
        return None
    if (adapter := adapter_dir(model.pretrain)) is None:
        return f"--pretrain {model.pretrain} holds no tokenizer files (a config-only copy)"
    if (base := base_here(adapter)) is None:
        return (
            f"--pretrain {model.pretrain} is a LoRA adapter without tokenizer files, and its base {adapter.base} "
            f"is "
            "not on this machine"
        )
    if not _has_tokenizer(base):
        return (
            f"--pretrain {model.pretrain} is a LoRA adapter without tokenizer files, and its base {base} holds "
            f"none "
            "(a config-only copy)"
        )
    return None


def teacher_source(model: PretrainedConfig, teacher: str | None) -> PretrainedConfig:
    """Where --teacher_pretrain's model comes from, run as the policy (`model`) runs (dtype, attention), without
    adapters."""
    return dataclasses.replace(model, pretrain=teacher, lora_rank=0)


def check_teacher_tokenizer(model: PretrainedConfig, teacher: str, tokenizer: PreTrainedTokenizerBase) -> None:
    """The teacher scores the policy's token ids, so it must read every id the policy can sample as the same token,
    and end and pad responses alike. Not the configs' vocab_size, which pads differently across one family's sizes
    (Qwen2.5-1.5B 151936, 7B 152064) with the same tokenizer; tokens past the policy's embedding rows (a tokenizer's
    added unk, say) are never sampled and do not matter."""
    source = teacher_source(model, teacher)
    theirs = load_tokenizer(source)
    sampled = load_model_config(model).get_text_config().vocab_size
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
            f"--teacher_pretrain {teacher}'s tokenizer is not the policy's ({what}); the teacher scores the policy's "
            "token ids, so it needs the same tokenizer (distillation across tokenizers is not implemented)"
        )
    rows = load_model_config(source).get_text_config().vocab_size
    if rows < sampled:
        raise ConfigError(
            f"--teacher_pretrain {teacher} has {rows} embedding rows for the policy's {sampled}; "
            "it cannot score every id the policy may sample"
        )


def load_tokenizer(model: PretrainedConfig, chat_template: str | None = None) -> PreTrainedTokenizerBase:
    """--pretrain's tokenizer (the embedded byte tokenizer without one); `chat_template`: a Jinja template replacing
    its own (rlrun.sft/rm/dpo's --tokenizer_chat_template)."""
    tok = _load_tokenizer(model)
    if chat_template is not None:
        tok.chat_template = chat_template
    return tok


def _load_tokenizer(model: PretrainedConfig) -> PreTrainedTokenizerBase:
    if model.pretrain is None:
        return build_byte_tokenizer()
    _check_dir("pretrain", model.pretrain)
    folder = model.pretrain if _has_tokenizer(model.pretrain) else model_folder(model.pretrain, "pretrain")
    tok = AutoTokenizer.from_pretrained(folder)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def response_end_ids(model: PretrainedConfig, tokenizer: PreTrainedTokenizerBase) -> tuple[int, ...]:
    """The token ids that end a response: the tokenizer's EOS first, then the others the model's
    generation_config.json lists. A chat model often ends turns with one token and documents with another (Qwen2.5
    and Qwen3: `<|im_end|>` and `<|endoftext|>`; a base model's tokenizer names only the second), and vLLM and HF
    generate stop on every id listed there; so do rlrun's engines."""
    ids = [int(tokenizer.eos_token_id)]
    if model.pretrain is not None:
        path = os.path.join(model_folder(model.pretrain, "pretrain"), "generation_config.json")
        listed = _listed_eos(path)
        ids += [i for i in listed if i not in ids]
    return tuple(ids)


def _listed_eos(path: str) -> list[int]:
    """generation_config.json's eos_token_id (an int or a list), [] when the file or the key is absent."""
    if not os.path.isfile(path):
        return []
    try:
        with open(path) as f:
            value = json.load(f).get("eos_token_id")
    except (OSError, ValueError) as e:
        raise ValueError(f"{path}: not readable JSON ({e}); fix or remove the file") from e
    if value is None:
        return []
    values = value if isinstance(value, list) else [value]
    if not all(isinstance(v, int) and not isinstance(v, bool) for v in values):
        raise ValueError(f"{path}: eos_token_id must be a token id or a list of them, not {value!r}")
    return [int(v) for v in values]


def load_model_config(source: PretrainedConfig) -> HFConfig:
    """The policy's HF config (config.json only, no weights; an adapter directory's base's)."""
    if source.pretrain is None:
        return tiny_model_config_for_size(source.model_preset)
    _check_dir("pretrain", source.pretrain)
    return AutoConfig.from_pretrained(model_folder(source.pretrain, "pretrain"))


def policy_weights(source: PretrainedConfig, seed: int) -> WeightSource | None:
    """The policy's initial weights, opened once per rank and shared by its roles (the embedded tiny model is built
    here, small by construction); an adapter directory's base with the adapter merged on read (what the engines and
    the reference start from). None: a checkpoint only `from_pretrained` reads."""
    if source.pretrain is None:
        return state_dict_weights(_tiny_policy(source, seed))
    _check_dir("pretrain", source.pretrain)
    if (adapter := checked_adapter(source.pretrain, "pretrain", policy=True)) is None:
        return open_weights(source.pretrain)
    base = open_weights(base_folder(adapter, "pretrain"))
    return None if base is None else AdapterMerged(base, adapter)


def _tiny_policy(source: PretrainedConfig, seed: int) -> PreTrainedModel:
    vocab = len(build_byte_tokenizer())
    model = build_causal_lm(tiny_model_config_for_size(source.model_preset), seed=seed)
    assert model.config.vocab_size >= vocab
    return model


def _skeleton(auto: AutoClass, config: HFConfig, source: PretrainedConfig, attn: bool) -> PreTrainedModel:
    """The architecture with its parameters on the meta device, in eval mode as `from_pretrained` leaves it."""
    with params_on_meta():
        model = auto.from_config(config, dtype=torch.float32, **(_attn_kwargs(source) if attn else {}))
    return model.eval()


def _name_base(model: PreTrainedModel, folder: str) -> None:
    """The folder holding `model`'s base weights, as PEFT records it (base_model_name_or_path) when adapters are
    added and export names it; "" for a body merged from an adapter, which no folder holds (export then writes it
    beside the adapters rather than naming the unmerged base)."""
    model.config.name_or_path = folder
    model.name_or_path = folder


def unfilled_causal_lm(source: PretrainedConfig, seed: int, weights: WeightSource | None) -> Unfilled[PreTrainedModel]:
    """The policy, unallocated, with where its weights are (`policy_weights`): a strategy places it, whole or
    sharded, then fills it. Names transformers renames, and MoE experts it stacks, are read by its own rules
    (rlrun.models.conversions); a checkpoint converted otherwise is loaded whole by `from_pretrained` first
    and `note` says so."""
    config = load_model_config(source)
    auto = policy_auto_class(config)
    model = _skeleton(auto, config, source, attn=source.pretrain is not None)
    note = None
    if isinstance(weights, FileWeights) and missing(model, weights):  # names transformers converts on load
        converted = Converted(weights, conversions(model, weights.names()))
        weights = weights if missing(model, converted) else converted
    if weights is None or missing(model, weights):
        assert source.pretrain is not None
        adapter = checked_adapter(source.pretrain, "pretrain", policy=True)
        folder = source.pretrain if adapter is None else base_folder(adapter, "pretrain")
        lacking = "" if weights is None else f" ({', '.join(missing(model, weights)[:3])} not found under these names)"
        full = auto.from_pretrained(folder, dtype=torch.float32, **_attn_kwargs(source))
        weights = state_dict_weights(full) if adapter is None else AdapterMerged(state_dict_weights(full), adapter)
        note = f"{folder}: its weights are read whole on every rank before sharding{lacking}"
    if isinstance(weights, AdapterMerged):
        _name_base(model, "")
    return Unfilled(model, weights, note=note)


def trained_policy(unfilled: Unfilled[PreTrainedModel], source: PretrainedConfig, seed: int) -> Unfilled:
    """The policy as the actor trains it: `unfilled` itself without LoRA, with fresh adapters for --lora_rank, and
    with an adapter directory as --pretrain its saved adapters on the unmerged base (training goes on from the
    model that was saved; its export names that base), after checking they are exactly the adapters this model
    gets (an adapter of another model would otherwise load partly)."""
    if (settings := lora_settings(source)) is None:
        return unfilled
    if (adapter := checked_adapter(source.pretrain, "pretrain", policy=True)) is None:
        return add_adapters(unfilled, settings, seed)
    _name_base(unfilled.model, base_folder(adapter, "pretrain"))
    saved = adapter_weights(adapter.path)
    policy = add_adapters(
        dataclasses.replace(unfilled, weights=base_source(unfilled.weights)), settings, seed, adapter=saved
    )
    expected = {
        saved_adapter_name(name.removeprefix(policy.prefix)): tuple(p.shape)
        for name, p in policy.model.named_parameters()
        if is_adapter(name)
    }
    check_fits(adapter, "pretrain", expected, saved_shapes(adapter.path, saved))
    return policy


def unfilled_trained_policy(source: PretrainedConfig, seed: int, weights: WeightSource | None) -> Unfilled:
    """`trained_policy` of the policy from `policy_weights`."""
    return trained_policy(unfilled_causal_lm(source, seed, weights), source, seed)


def unfilled_policy(source: PretrainedConfig, seed: int) -> Unfilled[PreTrainedModel]:
    """`unfilled_causal_lm` with its own weight source (a rank that builds one policy)."""
    return unfilled_causal_lm(source, seed, policy_weights(source, seed))


def load_causal_lm(source: PretrainedConfig, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The policy architecture with its initial weights (identical on every rank), whole on the CPU."""
    # the ignore: transformers types PreTrainedModel.to through functools.wraps, which mypy does not bind
    return unfilled_policy(source, seed).fill(torch.device("cpu")).to(dtype)  # type: ignore[arg-type]


def scalar_model_from(path: str | None, source: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """A sequence-classification model with one output (score head over every position), from `path`
    (a causal LM directory gets a fresh head), else the tiny policy's body with a fresh head."""
    if path is not None:
        # the ignore: as load_causal_lm's
        return unfilled_scalar_model(path, source, seed).fill(torch.device("cpu")).to(dtype)  # type: ignore[arg-type]
    # Offline default: the tiny policy's body with a fresh scalar head.
    policy = load_causal_lm(source, seed, dtype)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = AutoModelForSequenceClassification.from_config(config).to(dtype)
    model.base_model.load_state_dict(policy.base_model.state_dict())
    return model


def unfilled_scalar_model(
    path: str | None, source: PretrainedConfig, seed: int, *, fresh_head: bool = False, flag: str = "pretrain"
) -> Unfilled[PreTrainedModel]:
    """A one-output sequence-classification model, unallocated: the body from `path` (a causal LM or a
    classifier), the head from `path` unless `fresh_head` or it has none (then seeded, `init_score_head`'s values).
    None: the tiny policy's body (built whole: it is small). An adapter directory (`flag` names it in errors): its
    base with the adapter merged on read, and the head and --normalize_reward mean/std it saved, if any."""
    if path is None:
        model = scalar_model_from(None, source, seed, torch.float32)
        if fresh_head:
            init_score_head(model, seed)
        return Unfilled(
            _skeleton(AutoModelForSequenceClassification, model.config, source, attn=False), state_dict_weights(model)
        )
    adapter = checked_adapter(path, flag, policy=False)
    folder = path if adapter is None else base_folder(adapter, flag)
    config = AutoConfig.from_pretrained(folder, num_labels=1)
    if adapter is not None and (norm := saved_mean_std(path)) is not None:
        config.mean, config.std = norm  # where ScalarHeadModel reads a reward model's mean/std (config_mean_std)
    model = _skeleton(AutoModelForSequenceClassification, config, source, attn=True)
    head_name = next(n for n, p in model.named_parameters() if p is score_head(model).weight)
    weights: WeightSource | None = open_weights(folder)
    if weights is None:
        full = AutoModelForSequenceClassification.from_pretrained(
            folder, num_labels=1, dtype=torch.float32, **_attn_kwargs(source)
        )
        weights = state_dict_weights(full)
    if adapter is not None:
        weights = AdapterMerged(weights, adapter, whole_modules=True, flag=flag)
        _name_base(model, "")
    if fresh_head or weights.shape(head_name) is None:
        weights = Chained(MemoryWeights({head_name: seeded_head(config.hidden_size, seed)}), weights)
    if lacking := missing(model, weights):
        raise ConfigError(
            f"{path}: the checkpoint lacks {', '.join(lacking[:5])} (or holds them in another shape) "
            f"for a {type(model).__name__}; pass a causal LM or a one-output classifier"
        )
    return Unfilled(model, weights)


class ScalarHeadModel(nn.Module):
    """A sequence-classification model read at EVERY position: [B, L] ids -> [B, L] values.

    Its own forward (rather than calling the HF body and head separately) keeps FSDP's root
    hooks in charge of gathering the embedding and head parameters."""

    def __init__(self, hf_model: PreTrainedModel, normalize: bool = False) -> None:
        super().__init__()
        self.hf = hf_model
        self._no_split_modules = getattr(hf_model, "_no_split_modules", None)
        # OpenRLHF --normalize_reward: outputs become (x - mean) / std with the mean/std a reward-model
        # trainer stored in config.json (openrlhf/models/model.py); a config without them leaves outputs as they are.
        self.output_norm = config_mean_std(hf_model.config) if normalize else None

    def gradient_checkpointing_enable(self, **kwargs: object) -> None:
        self.hf.gradient_checkpointing_enable(**kwargs)

    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        position_ids: torch.Tensor | None = None,
        **attention: object,
    ) -> torch.Tensor:
        """Padded rows: attention_mask (positions derived from it). Packed rows (rlrun.data.packing):
        position_ids restarting per sequence and no mask. No KV cache: nothing reads it. `attention`: keywords the
        model hands to its attention layers (rlrun.strategies.ulysses's `ulysses`)."""
        if position_ids is None:
            assert attention_mask is not None, "pass attention_mask (padded rows) or position_ids (packed rows)"
            position_ids = position_ids_from(attention_mask)
        hidden = self.hf.base_model(
            input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids, use_cache=False, **attention
        ).last_hidden_state
        out = score_head(self.hf)(hidden).squeeze(-1).float()
        if self.output_norm is not None:
            mean, std = self.output_norm
            return (out - mean) / std
        # A fresh tensor, not a view: FSDP2 hooks its backward on the module output.
        return out.clone()


def config_mean_std(config: object) -> tuple[float, float] | None:
    """(mean, std) stored in a reward model's config (OpenRLHF's `mean`/`std` keys), else None."""
    if not hasattr(config, "mean"):
        return None
    mean, std = float(config.mean), float(getattr(config, "std", 1.0))
    if not std > 0:
        raise ConfigError(
            f"--normalize_reward: the model config stores std={std}; it must be > 0 "
            "(fix config.json or drop --normalize_reward)"
        )
    return mean, std


def load_critic(
    model: PretrainedConfig, critic_pretrain: str | None, reward_pretrain: str | None, seed: int, *, normalize: bool
) -> Unfilled[ScalarHeadModel]:
    """The critic, unallocated: --critic_pretrain, else --reward_pretrain, else the policy's (`model`) body. A body
    that is the policy's gets a fresh seeded head (OpenRLHF initialises the head only when the critic starts from the
    actor's model); a reward model or a saved critic keeps its own. `normalize`: --normalize_reward."""
    sources = (("critic_pretrain", critic_pretrain), ("reward_pretrain", reward_pretrain), ("pretrain", model.pretrain))
    flag, path = next(((f, p) for f, p in sources if p), sources[-1])
    if path is not None:
        _check_dir(flag, path)
    fresh = path is None or path == model.pretrain
    hf = unfilled_scalar_model(path, model, seed, fresh_head=fresh, flag=flag)
    return Unfilled(ScalarHeadModel(hf.model, normalize=normalize), hf.weights, prefix="hf.")


def seeded_head(hidden_size: int, seed: int) -> torch.Tensor:
    """[1, hidden] fp32: a small seeded head (the same on every rank): early values/rewards start near zero."""
    head = torch.empty(1, hidden_size)
    return head.normal_(0.0, 1.0 / (hidden_size + 1), generator=torch.Generator().manual_seed(seed))


def init_score_head(model: PreTrainedModel, seed: int) -> None:
    """`seeded_head` written into a built model's head."""
    with torch.no_grad():
        head = score_head(model)
        head.weight.copy_(seeded_head(model.config.hidden_size, seed).expand_as(head.weight))


def load_reward_model(
    model: PretrainedConfig, reward_pretrain: str, seed: int, *, normalize: bool
) -> Unfilled[ScalarHeadModel]:
    """The reward model (--reward_pretrain), unallocated, run like the policy (`model`: precision, attention);
    `normalize`: --normalize_reward (its config's mean/std)."""
    _check_dir("reward_pretrain", reward_pretrain)
    hf = unfilled_scalar_model(reward_pretrain, model, seed, flag="reward_pretrain")
    return Unfilled(ScalarHeadModel(hf.model, normalize=normalize), hf.weights, prefix="hf.")


def score_head(model: PreTrainedModel) -> nn.Linear:
    for name in ("score", "classifier", "value_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ConfigError(
        f"{type(model).__name__} has no scalar head named score/classifier/value_head; "
        "use a sequence-classification model with num_labels=1"
    )


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: positions count real tokens only, as HF generate does with left padding."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)
