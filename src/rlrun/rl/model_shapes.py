"""What the memory plan (rlrun.rl.memory_plan) needs of each model, read from its HF config.json alone (no
weights): hidden size, layers, heads, KV heads, head size, vocabulary and the parameter counts by part (embedding,
all blocks, the largest block, final norm, head), and each role's shape (critic and reward models: the body with a
[hidden, 1] score head).

Parameter counts are exact for Llama, Qwen2, Qwen3, Mistral and their MoE kin (Mixtral, Qwen2-MoE, Qwen3-MoE);
other decoders are read through the same config fields (approximate); vision towers are not counted.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from rlrun.launch.layout import Role
from rlrun.runtime.errors import ConfigError


@dataclass(frozen=True)
class ModelShape:
    """What the estimate needs of one model; parameter counts exact for Llama/Qwen2/Qwen3/Mistral (and their MoE)."""

    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    embedding: int  # token embedding parameters
    blocks: int  # all transformer blocks
    largest_block: int
    final_norm: int
    head: int  # LM head (0 when tied to the embedding), or the [hidden, 1] score head of a critic/reward model

    @property
    def parameters(self) -> int:
        return self.embedding + self.blocks + self.final_norm + self.head

    @property
    def root(self) -> int:
        """FSDP's root unit, gathered for a whole forward and backward: the final norm, and the embedding and head
        when they are tied (an untied embedding and head are units of their own, rlrun.strategies.fsdp.vocab_units)."""
        return self.final_norm + (self.embedding if not self.head else 0)

    @property
    def largest_unit(self) -> int:
        """The largest FSDP unit gathered one at a time: a block, or the untied embedding or head."""
        return max(self.largest_block, self.embedding if self.head else 0, self.head)

    def scalar(self) -> ModelShape:
        """The same body with a [hidden, 1] score head instead of the LM head (AutoModelForSequenceClassification)."""
        return dataclasses.replace(self, head=self.hidden)


def _need(config: Any, name: str) -> int:
    value = getattr(config, name, None)
    if not isinstance(value, int) or value <= 0:
        raise ConfigError(f"config.json has no positive {name} (got {value!r}, model_type "
                          f"{getattr(config, 'model_type', None)!r}): the memory plan reads the architecture from it")
    return value


def _attention_biases(config: Any, kind: str) -> tuple[bool, bool]:
    """(q/k/v biases, o bias): Qwen2-family models hard-code q/k/v biases (Qwen2-MoE: qkv_bias); Llama-style
    configs put one attention_bias on all four."""
    if kind.startswith("qwen2"):
        return bool(getattr(config, "qkv_bias", True)), False
    bias = bool(getattr(config, "attention_bias", False))
    return bias, bias


def _mlp(config: Any, layer: int, hidden: int) -> int:
    """Parameters of one layer's MLP: dense SwiGLU, or routed experts + router (+ Qwen2-MoE's gated shared expert)."""
    experts = getattr(config, "num_local_experts", None) or getattr(config, "num_experts", None)
    sparse = experts and layer not in (getattr(config, "mlp_only_layers", None) or ()) \
        and (layer + 1) % (getattr(config, "decoder_sparse_step", 1) or 1) == 0
    if not sparse:
        inner = _need(config, "intermediate_size")
        return 3 * hidden * inner + (2 * inner + hidden if getattr(config, "mlp_bias", False) else 0)
    inner = getattr(config, "moe_intermediate_size", None) or _need(config, "intermediate_size")
    total = experts * 3 * hidden * inner + experts * hidden
    shared = getattr(config, "shared_expert_intermediate_size", None)
    return total + (3 * hidden * shared + hidden if shared else 0)


def model_shape(config: Any) -> ModelShape:
    """The shape of a causal LM from its HF config (a multimodal config's text model; vision towers not counted)."""
    c = config.get_text_config() if hasattr(config, "get_text_config") else config
    hidden, layers, heads = _need(c, "hidden_size"), _need(c, "num_hidden_layers"), _need(c, "num_attention_heads")
    kv_heads = getattr(c, "num_key_value_heads", None) or heads
    head_dim = getattr(c, "head_dim", None) or hidden // heads
    vocab = _need(c, "vocab_size")
    kind = str(getattr(c, "model_type", ""))
    qkv_bias, o_bias = _attention_biases(c, kind)
    q, kv = heads * head_dim, kv_heads * head_dim
    attention = hidden * (q + 2 * kv) + q * hidden + (q + 2 * kv if qkv_bias else 0) + (hidden if o_bias else 0)
    attention += 2 * head_dim if kind.startswith("qwen3") else 0  # q_norm, k_norm
    sizes = [attention + 2 * hidden + _mlp(c, i, hidden) for i in range(layers)]  # + the two RMSNorms
    head = 0 if getattr(c, "tie_word_embeddings", False) else vocab * hidden
    return ModelShape(hidden, layers, heads, kv_heads, head_dim, vocab, vocab * hidden, sum(sizes), max(sizes),
                      hidden, head)


def role_shapes(policy: ModelShape, critic: ModelShape | None = None, reward: ModelShape | None = None,
                ref: ModelShape | None = None) -> dict[Role, ModelShape]:
    """Each role's shape: the policy's for actor/engines, and for the reference unless it has its own (rlrun.dpo's
    --ref_pretrain); a score-head body for critic/reward (their own config when given, else the policy's body)."""
    return {Role.ACTOR: policy, Role.REF: ref or policy, Role.ENGINE: policy,
            Role.CRITIC: (critic or policy).scalar(), Role.REWARD: (reward or policy).scalar()}
