"""Model and tokenizer construction: HF directories, or the embedded tiny model when offline."""

from __future__ import annotations

import copy
import os

import torch
from torch import nn
from transformers import PretrainedConfig as HFConfig
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, PreTrainedModel, PreTrainedTokenizerBase)

from rlrun.config.schema import Config, PretrainedConfig
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config_for_size
from rlrun.models.weights import (Chained, MemoryWeights, Unfilled, WeightSource, missing, open_weights, params_on_meta,
                                  state_dict_weights)
from rlrun.runtime.errors import ConfigError, MissingExtraError


def _check_dir(flag: str, path: str) -> None:
    if not os.path.isdir(path):
        raise ConfigError(f"--{flag} {path}: not a local directory (rlrun loads models from local paths; "
                          f"download the model first, e.g. with `huggingface-cli download`)")


def _attn_kwargs(model: PretrainedConfig) -> dict[str, str]:
    if model.flash_attn:
        try:
            import flash_attn  # noqa: F401
        except ImportError:
            raise MissingExtraError("flash-attn", "flash-attn", "--flash_attn") from None
        return {"attn_implementation": "flash_attention_2"}
    if model.attn_implementation:
        return {"attn_implementation": model.attn_implementation}
    return {}


# What any saved HF tokenizer has at least one of (fast: tokenizer.json; slow: vocab files, sentencepiece models).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")


def tokenizer_missing(model: PretrainedConfig) -> str | None:
    """Why the policy's tokenizer cannot be read on this machine, or None when it can. A --dry_run on a login node
    may see no folder at all, or one with config.json alone (enough to plan layout and memory)."""
    if model.pretrain is None:
        return None
    if not os.path.isdir(model.pretrain):
        return f"--pretrain {model.pretrain} is not on this machine"
    if not any(os.path.exists(os.path.join(model.pretrain, name)) for name in TOKENIZER_FILES):
        return f"--pretrain {model.pretrain} holds no tokenizer files (a config-only copy)"
    return None


def load_tokenizer(model: PretrainedConfig) -> PreTrainedTokenizerBase:
    if model.pretrain is None:
        return build_byte_tokenizer()
    _check_dir("pretrain", model.pretrain)
    tok = AutoTokenizer.from_pretrained(model.pretrain)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def load_model_config(source: PretrainedConfig) -> HFConfig:
    """The policy's HF config (config.json only, no weights)."""
    if source.pretrain is None:
        return tiny_model_config_for_size(source.model_preset)
    _check_dir("pretrain", source.pretrain)
    return AutoConfig.from_pretrained(source.pretrain)


def policy_weights(source: PretrainedConfig, seed: int) -> WeightSource | None:
    """The policy's initial weights, opened once per rank and shared by its roles (the embedded tiny model is built
    here, small by construction). None: a checkpoint only `from_pretrained` reads."""
    if source.pretrain is None:
        return state_dict_weights(_tiny_policy(source, seed))
    _check_dir("pretrain", source.pretrain)
    return open_weights(source.pretrain)


def _tiny_policy(source: PretrainedConfig, seed: int) -> PreTrainedModel:
    vocab = len(build_byte_tokenizer())
    model = build_causal_lm(tiny_model_config_for_size(source.model_preset), seed=seed)
    assert model.config.vocab_size >= vocab
    return model


def _skeleton(auto: type, config: HFConfig, source: PretrainedConfig, attn: bool) -> PreTrainedModel:
    """The architecture with its parameters on the meta device, in eval mode as `from_pretrained` leaves it."""
    with params_on_meta():
        model = auto.from_config(config, dtype=torch.float32, **(_attn_kwargs(source) if attn else {}))
    return model.eval()


def unfilled_causal_lm(source: PretrainedConfig, seed: int, weights: WeightSource | None) -> Unfilled:
    """The policy, unallocated, with where its weights are (`policy_weights`): a strategy places it, whole or
    sharded, then fills it. A checkpoint whose names are not the model's (transformers converts some, e.g. fused
    MoE experts) is loaded whole by `from_pretrained` first (today's cost) and `note` says so."""
    model = _skeleton(AutoModelForCausalLM, load_model_config(source), source, attn=source.pretrain is not None)
    if weights is not None and not missing(model, weights):
        return Unfilled(model, weights)
    assert source.pretrain is not None
    lacking = "" if weights is None else f" ({', '.join(missing(model, weights)[:3])} not found under these names)"
    full = AutoModelForCausalLM.from_pretrained(source.pretrain, dtype=torch.float32, **_attn_kwargs(source))
    return Unfilled(model, state_dict_weights(full),
                    note=f"{source.pretrain}: its weights are read whole on every rank before sharding{lacking}")


def unfilled_policy(source: PretrainedConfig, seed: int) -> Unfilled:
    """`unfilled_causal_lm` with its own weight source (a rank that builds one policy)."""
    return unfilled_causal_lm(source, seed, policy_weights(source, seed))


def load_causal_lm(source: PretrainedConfig, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The policy architecture with its initial weights (identical on every rank), whole on the CPU."""
    return unfilled_policy(source, seed).fill(torch.device("cpu")).to(dtype)


def scalar_model_from(path: str | None, source: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """A sequence-classification model with one output (score head over every position), from `path`
    (a causal LM directory gets a fresh head), else the tiny policy's body with a fresh head."""
    if path is not None:
        return unfilled_scalar_model(path, source, seed).fill(torch.device("cpu")).to(dtype)
    # Offline default: the tiny policy's body with a fresh scalar head.
    policy = load_causal_lm(source, seed, dtype)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = AutoModelForSequenceClassification.from_config(config).to(dtype)
    model.base_model.load_state_dict(policy.base_model.state_dict())
    return model


def unfilled_scalar_model(path: str | None, source: PretrainedConfig, seed: int, *,
                          fresh_head: bool = False) -> Unfilled:
    """A one-output sequence-classification model, unallocated: the body from `path` (a causal LM or a
    classifier), the head from `path` unless `fresh_head` or it has none (then seeded, `init_score_head`'s values).
    None: the tiny policy's body (built whole: it is small)."""
    if path is None:
        model = scalar_model_from(None, source, seed, torch.float32)
        if fresh_head:
            init_score_head(model, seed)
        return Unfilled(_skeleton(AutoModelForSequenceClassification, model.config, source, attn=False),
                        state_dict_weights(model))
    config = AutoConfig.from_pretrained(path, num_labels=1)
    model = _skeleton(AutoModelForSequenceClassification, config, source, attn=True)
    head_name = next(n for n, p in model.named_parameters() if p is score_head(model).weight)
    weights = open_weights(path)
    if weights is None:
        full = AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=torch.float32,
                                                                  **_attn_kwargs(source))
        weights = state_dict_weights(full)
    if fresh_head or weights.shape(head_name) is None:
        weights = Chained(MemoryWeights({head_name: seeded_head(config.hidden_size, seed)}), weights)
    if lacking := missing(model, weights):
        raise ConfigError(f"{path}: the checkpoint lacks {', '.join(lacking[:5])} (or holds them in another shape) "
                          f"for a {type(model).__name__}; pass a causal LM or a one-output classifier")
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
        # trainer stored in config.json (models/model.py); a config without them leaves outputs as they are.
        self.output_norm = config_mean_std(hf_model.config) if normalize else None

    def gradient_checkpointing_enable(self, **kwargs: object) -> None:
        self.hf.gradient_checkpointing_enable(**kwargs)

    def forward(self, input_ids: torch.Tensor, attention_mask: torch.Tensor | None = None,
                position_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Padded rows: attention_mask (positions derived from it). Packed rows (rlrun.data.packing):
        position_ids restarting per sequence and no mask. No KV cache: nothing reads it."""
        if position_ids is None:
            assert attention_mask is not None, "pass attention_mask (padded rows) or position_ids (packed rows)"
            position_ids = position_ids_from(attention_mask)
        hidden = self.hf.base_model(input_ids=input_ids, attention_mask=attention_mask, position_ids=position_ids,
                                    use_cache=False).last_hidden_state
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
    mean, std = float(getattr(config, "mean")), float(getattr(config, "std", 1.0))
    if not std > 0:
        raise ConfigError(f"--normalize_reward: the model config stores std={std}; it must be > 0 "
                          "(fix config.json or drop --normalize_reward)")
    return mean, std


def load_critic(cfg: Config) -> Unfilled:
    """The critic, unallocated: --critic_pretrain, else --reward_pretrain, else the policy's body. A body that is
    the policy's gets a fresh seeded head (OpenRLHF initialises the head only when the critic starts from the
    actor's model); a reward model or a saved critic keeps its own."""
    path = cfg.model.critic_pretrain or cfg.model.reward_pretrain or cfg.model.pretrain
    for flag in ("critic_pretrain", "reward_pretrain", "pretrain"):
        if getattr(cfg.model, flag) == path and path is not None:
            _check_dir(flag, path)
            break
    fresh = path is None or path == cfg.model.pretrain
    hf = unfilled_scalar_model(path, cfg.model, cfg.train.seed, fresh_head=fresh)
    return Unfilled(ScalarHeadModel(hf.model, normalize=cfg.algo.normalize_reward), hf.weights, prefix="hf.")


def seeded_head(hidden_size: int, seed: int) -> torch.Tensor:
    """[1, hidden] fp32: a small seeded head (the same on every rank): early values/rewards start near zero."""
    head = torch.empty(1, hidden_size)
    return head.normal_(0.0, 1.0 / (hidden_size + 1), generator=torch.Generator().manual_seed(seed))


def init_score_head(model: PreTrainedModel, seed: int) -> None:
    """`seeded_head` written into a built model's head."""
    with torch.no_grad():
        head = score_head(model)
        head.weight.copy_(seeded_head(model.config.hidden_size, seed).expand_as(head.weight))


def load_reward_model(cfg: Config) -> Unfilled:
    assert cfg.model.reward_pretrain is not None
    _check_dir("reward_pretrain", cfg.model.reward_pretrain)
    hf = unfilled_scalar_model(cfg.model.reward_pretrain, cfg.model, cfg.train.seed)
    return Unfilled(ScalarHeadModel(hf.model, normalize=cfg.algo.normalize_reward), hf.weights, prefix="hf.")


def score_head(model: PreTrainedModel) -> nn.Linear:
    for name in ("score", "classifier", "value_head"):
        head = getattr(model, name, None)
        if isinstance(head, nn.Linear):
            return head
    raise ConfigError(f"{type(model).__name__} has no scalar head named score/classifier/value_head; "
                      "use a sequence-classification model with num_labels=1")


def position_ids_from(attention_mask: torch.Tensor) -> torch.Tensor:
    """[B, L] -> [B, L]: positions count real tokens only, as HF generate does with left padding."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)
