"""The memory plan's activation bytes against what real HF decoder layers hold, measured on the CPU.

Training: the bytes of every tensor autograd saves for backward (torch.autograd.graph.saved_tensors_hooks, each
storage once, parameters left out) in a forward of real transformers Llama and Qwen2 models built from a config.
That is what a GPU's allocator holds between forward and backward, whatever the device; on an H200 the plan of the
0.5B throughput run was 14% under its measured peak with Megatron's 34*b*L*h, the gap being these activations.
A no-grad forward (scoring): the peak of the bytes of op outputs alive at once (a TorchDispatchMode that counts each
new storage until its tensor is freed), against which the plan's working set must be an upper bound.
"""

from __future__ import annotations


import pytest
import torch
import transformers

from rlrun.plan.memory import activation_bytes
from rlrun.runtime.memory import LiveTensorBytes
from rlrun.plan.shapes import Knobs
from rlrun.plan.shapes import model_shape

ROWS, SEQ = 2, 64
# (config class, hidden, MLP width, heads, KV heads): a Qwen2-0.5B-like wide MLP with few KV heads, a narrow one,
# and full multi-head attention
SHAPES = [(transformers.Qwen2Config, 256, 1376, 4, 1), (transformers.LlamaConfig, 256, 704, 4, 2),
          (transformers.LlamaConfig, 384, 1024, 6, 6)]


def _model(config_class, hidden: int, mlp: int, heads: int, kv: int, layers: int, dtype: torch.dtype):
    config = config_class(hidden_size=hidden, intermediate_size=mlp, num_attention_heads=heads,
                          num_key_value_heads=kv, num_hidden_layers=layers, vocab_size=300,
                          max_position_embeddings=256, attn_implementation="sdpa")
    torch.manual_seed(0)
    return config, transformers.AutoModelForCausalLM.from_config(config).to(dtype)


def _knobs(bf16: bool) -> Knobs:
    return Knobs(gpu=True, bf16=bf16, strategy="fsdp", zero_stage=0, adam_offload=False, checkpointing=False,
                 attention_scores=False, micro_train=ROWS, micro_rollout=ROWS, seq=SEQ, response=SEQ // 2,
                 logits_chunk=0, model_sleep=False, engine_sleep=False, backend="native", vllm_util=0.9,
                 vllm_kv_bytes=None, rollouts=ROWS, kv_budget=None)


def _saved_bytes(model, ids: torch.Tensor) -> int:
    """Bytes of the tensors a training forward saves for backward (each storage once, parameters left out)."""
    params = {p.untyped_storage().data_ptr() for p in model.parameters()}
    saved: dict[int, int] = {}

    def pack(t: torch.Tensor) -> torch.Tensor:
        storage = t.untyped_storage()
        if storage.data_ptr() not in params:
            saved[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        model(input_ids=ids, use_cache=False)
    return sum(saved.values())


def _no_grad_working_set(model, seq: int) -> int:
    """Peak bytes alive in a no-grad forward of the decoder body over ROWS rows of `seq` tokens (its input included)."""
    ids = torch.randint(0, 300, (ROWS, seq))
    with torch.no_grad():
        x = model.model.embed_tokens(ids)
        with LiveTensorBytes() as live:
            model.model(inputs_embeds=x, use_cache=False)
    return live.peak + x.nbytes


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32], ids=["bf16", "fp32"])
@pytest.mark.parametrize("shape", SHAPES, ids=["qwen2_wide_mlp", "llama_narrow", "llama_mha"])
def test_planned_activations_match_what_hf_layers_keep_and_bound_a_no_grad_forward(shape, dtype):
    config_class, hidden, mlp, heads, kv = shape
    config, model = _model(config_class, hidden, mlp, heads, kv, 3, dtype)
    knobs, planned_shape = _knobs(dtype == torch.bfloat16), model_shape(config)
    ids = torch.randint(0, 300, (ROWS, SEQ))

    saved = _saved_bytes(model.train(), ids)
    planned = activation_bytes(planned_shape, knobs, ROWS, train=True)
    # the plan leaves out only the embedding's saved ids (8 bytes a token)
    assert abs(planned - saved) / saved < 0.02, (planned, saved)

    # a no-grad forward: the working set's growth per token (two lengths: the CPU's fixed costs, a packed copy of a
    # weight and attention's per-thread blocks, cancel), under the plan's bound and not far under it
    model.eval()
    grown = (_no_grad_working_set(model, 2 * SEQ) - _no_grad_working_set(model, SEQ)) / (ROWS * SEQ)
    bound = activation_bytes(planned_shape, knobs, ROWS, train=False) / (ROWS * SEQ)
    assert grown <= bound <= 1.4 * grown, (bound, grown)
    # Megatron's 34*b*L*h (16-bit), what the plan used before: under what the wide-MLP model keeps
    if mlp / hidden > 5:
        assert ROWS * SEQ * hidden * 34 * 3 * dtype.itemsize // 2 < 0.75 * saved
