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


def load_causal_lm(source: PretrainedConfig, seed: int, dtype: torch.dtype = torch.float32) -> PreTrainedModel:
    """The policy architecture with its initial weights (identical on every rank)."""
    if source.pretrain is None:
        vocab = len(build_byte_tokenizer())
        model = build_causal_lm(tiny_model_config_for_size(source.model_preset), seed=seed)
        assert model.config.vocab_size >= vocab
        return model.to(dtype)
    _check_dir("pretrain", source.pretrain)
    return AutoModelForCausalLM.from_pretrained(source.pretrain, dtype=dtype, **_attn_kwargs(source))


def scalar_model_from(path: str | None, source: PretrainedConfig, seed: int, dtype: torch.dtype) -> PreTrainedModel:
    """A sequence-classification model with one output (score head over every position), from `path`
    (a causal LM directory gets a fresh head), else the tiny policy's body with a fresh head."""
    if path is not None:
        return AutoModelForSequenceClassification.from_pretrained(path, num_labels=1, dtype=dtype, **_attn_kwargs(source))
    # Offline default: the tiny policy's body with a fresh scalar head.
    policy = load_causal_lm(source, seed, dtype)
    config = copy.deepcopy(policy.config)
    config.num_labels = 1
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed + 1)
        model = AutoModelForSequenceClassification.from_config(config).to(dtype)
    model.base_model.load_state_dict(policy.base_model.state_dict())
    return model


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


def load_critic(cfg: Config, dtype: torch.dtype = torch.float32) -> ScalarHeadModel:
    path = cfg.model.critic_pretrain or cfg.model.reward_pretrain or cfg.model.pretrain
    for flag in ("critic_pretrain", "reward_pretrain", "pretrain"):
        if getattr(cfg.model, flag) == path and path is not None:
            _check_dir(flag, path)
            break
    model = scalar_model_from(path, cfg.model, cfg.train.seed, dtype)
    if path is None or path == cfg.model.pretrain:
        # The policy's body has no value head yet. A reward model or a saved critic keeps its own (OpenRLHF
        # initialises the head only when the critic starts from the actor's model).
        init_score_head(model, cfg.train.seed)
    return ScalarHeadModel(model, normalize=cfg.algo.normalize_reward)


def init_score_head(model: PreTrainedModel, seed: int) -> None:
    """A small seeded head (the same on every rank): early values/rewards start near zero."""
    with torch.no_grad():
        head = score_head(model)
        head.weight.normal_(0.0, 1.0 / (model.config.hidden_size + 1), generator=torch.Generator().manual_seed(seed))


def load_reward_model(cfg: Config, dtype: torch.dtype = torch.float32) -> ScalarHeadModel:
    assert cfg.model.reward_pretrain is not None
    _check_dir("reward_pretrain", cfg.model.reward_pretrain)
    return ScalarHeadModel(scalar_model_from(cfg.model.reward_pretrain, cfg.model, cfg.train.seed, dtype),
                           normalize=cfg.algo.normalize_reward)


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
