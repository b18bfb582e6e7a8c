"""--dry_run's memory plan with --lora_rank (issue 28): PEFT's adapter count from config.json alone, checked against
PEFT on real (meta-device) models; a 7B GRPO job with a KL term planned with and without LoRA (adapter-only
gradients and Adam states, a bf16 frozen base, no reference role, the same --plan_json schema); a LoRA critic; DPO
whose reference becomes the policy's base."""

from __future__ import annotations

import importlib
import json
import warnings

import pytest
import torch
import transformers
from transformers import AutoModelForCausalLM

from rlrun.cli.parser import parse_args
from rlrun.launch.layout import Role
from rlrun.plan.shapes import GIB, SupervisedJob, Target
from rlrun.plan.memory import plan_memory
from rlrun.plan.memory_text import dry_run_memory, format_plan, note_lines, read_shapes, supervised_memory
from rlrun.plan.shapes import lora_parameters, model_shape, unknown_targets
from rlrun.plan.plan import lay_out

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300)
LLAMA_2_7B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096,
              "num_hidden_layers": 32, "intermediate_size": 11008, "num_attention_heads": 32, "num_key_value_heads": 32,
              "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
GPU_80 = Target(True, 80 * GIB, "test")
# A 7B GRPO job with a KL term on 8 actor GPUs (+ 8 vLLM engine GPUs): without LoRA it has a reference on the actor's
# ranks; with LoRA the reference is the actor's base.
GRPO_7B = ["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8", "--ref_num_nodes", "1",
           "--ref_num_gpus_per_node", "8", "--colocate_actor_ref", "--remote_rm_url", "demo", "--advantage_estimator",
           "group_norm", "--n_samples_per_prompt", "8", "--rollout_batch_size", "128", "--train_batch_size", "128",
           "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8", "--bf16", "--zero_stage", "3",
           "--gradient_checkpointing", "--prompt_max_len", "1024", "--generate_max_len", "2048", "--init_kl_coef",
           "0.01", "--generation_backend", "vllm", "--vllm_num_engines", "8", "--gpu_memory_gb", "80"]


def _hand_count(rank: int, layers: int, hidden: int, q: int, kv: int, inner: int, names: set[str]) -> int:
    """r * (in + out) per adapted projection of a Llama-style block, written out per projection."""
    sizes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden),
             "gate_proj": (hidden, inner), "up_proj": (hidden, inner), "down_proj": (inner, hidden)}
    return layers * sum(rank * (fan_in + fan_out) for name, (fan_in, fan_out) in sizes.items() if name in names)


def _peft_count(model: torch.nn.Module, rank: int, targets: str | list[str]) -> int:
    from peft import LoraConfig, get_peft_model

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        wrapped = get_peft_model(model, LoraConfig(r=rank, target_modules=targets, bias="none"))
    return sum(p.numel() for p in wrapped.parameters() if p.requires_grad)


@pytest.mark.parametrize("config", [
    transformers.Qwen2Config(**SMALL),
    transformers.Qwen2Config(**SMALL, tie_word_embeddings=True),
    transformers.LlamaConfig(**SMALL, attention_bias=True, head_dim=24),
    transformers.Qwen3Config(**SMALL, head_dim=32),
    transformers.MistralConfig(**SMALL),
    transformers.Qwen2MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                decoder_sparse_step=2, mlp_only_layers=[0]),
], ids=lambda c: c.model_type + ("_tied" if c.tie_word_embeddings else ""))
@pytest.mark.parametrize("targets", [("all-linear",), ("q_proj", "v_proj"), ("self_attn.o_proj", "down_proj")],
                         ids=" ".join)
def test_lora_parameter_count_equals_peft_on_a_real_model(config, targets):
    """The formula against PEFT's own adapters on the causal LM (all-linear leaves the LM head out) and on the body a
    critic's adapters go on (rlrun.models.lora.add_scalar_adapters)."""
    peft_targets: str | list[str] = targets[0] if targets == ("all-linear",) else list(targets)
    with torch.device("meta"):
        causal = AutoModelForCausalLM.from_config(config)
        body = AutoModelForCausalLM.from_config(config).model
    expected = lora_parameters(model_shape(config), 8, targets)
    assert expected > 0
    assert _peft_count(causal, 8, peft_targets) == expected
    assert _peft_count(body, 8, peft_targets) == expected


def test_the_7b_count_by_hand_and_unknown_names():
    shape = model_shape(transformers.LlamaConfig(**LLAMA_2_7B))
    every = {"q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"}
    assert lora_parameters(shape, 8, ("all-linear",)) == _hand_count(8, 32, 4096, 4096, 4096, 11008, every) \
        == 32 * 8 * (7 * 4096 + 2 * 4096 + 2 * 4096 + 3 * 11008) == 19_988_480  # PEFT's count for Llama-2-7b
    assert lora_parameters(shape, 8, ("q_proj", "v_proj")) == _hand_count(8, 32, 4096, 4096, 4096, 11008,
                                                                          {"q_proj", "v_proj"}) == 4_194_304
    assert lora_parameters(shape, 16, ("q_proj", "c_attn")) == 2 * 32 * 8 * 8192  # c_attn: GPT-2's; counted as none
    assert unknown_targets(shape, ("q_proj", "c_attn", "lm_head")) == ("c_attn", "lm_head")
    assert unknown_targets(shape, ("all-linear",)) == () and lora_parameters(shape, 0, ("all-linear",)) == 0


def _ppo(tmp_path, *flags: str, world: int = 16):
    model = tmp_path / "llama-2-7b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_2_7B))
    cfg = parse_args(["--pretrain", str(model), *GRPO_7B, *flags]).config
    layout = lay_out(cfg, world, 8).layout
    shapes, _ = read_shapes(cfg, layout)
    return cfg, layout, plan_memory(cfg, layout, shapes, GPU_80)


def test_a_7b_lora_plan_trains_only_the_adapters_and_holds_no_reference(tmp_path):
    _, full_layout, full = _ppo(tmp_path)
    cfg, layout, lora = _ppo(tmp_path, "--lora_rank", "8", "--lora_alpha", "16", "--target_modules", "all-linear")
    assert cfg.ref_is_actor_base and full_layout.has(Role.REF) and not layout.has(Role.REF)
    assert Role.REF not in lora.ranks[0].roles and full.ranks[0].roles == (Role.ACTOR, Role.REF)
    n, t = lora.shapes[Role.ACTOR].parameters, 19_988_480
    before, after = full.ranks[0].gpu, lora.ranks[0].gpu
    # the adapters' fp32 parameters, gradients and Adam moments, and the bf16 frozen base, all over the 8 ranks
    assert after["params"] == (2 * n + 4 * t) // 8 and after["grads"] == 4 * t // 8 and after["optimizer"] == 8 * t // 8
    assert after["grads"] + after["optimizer"] < 0.01 * (before["grads"] + before["optimizer"])
    assert after["params"] < before["params"]  # 4 B/param fp32 actor shards and the reference's, against 2 B/param
    assert lora.ranks[0].gpu_total < full.ranks[0].gpu_total and lora.fits
    text = format_plan(lora)
    assert "LoRA rank 8 on all-linear: actor: 19.99M trainable parameters of 6.76B (0.30%); the reference is the " \
           "actor's base (adapters off), no reference model" in text
    assert "ref" not in text.split("\n")[1]  # the roles column: no reference
    assert "LoRA" not in format_plan(full)
    # the host export on rank 0: LoRA keeps its fp32 adapters (with --save_merged the bf16 base too); the full model
    # streams (one fp32 embedding-sized tensor at a time)
    assert lora.ranks[0].host["export"] == 4 * t and full.ranks[0].host["export"] == 4 * 32000 * 4096
    _, _, merged = _ppo(tmp_path, "--lora_rank", "8", "--save_merged")
    assert merged.ranks[0].host["export"] == 2 * n + 4 * t


def test_lora_on_deepspeed_zero2_keeps_the_bf16_base_whole(tmp_path):
    _, _, lora = _ppo(tmp_path, "--lora_rank", "8", "--strategy", "deepspeed", "--zero_stage", "2")
    n, t = lora.shapes[Role.ACTOR].parameters, 19_988_480
    actor = lora.ranks[0].gpu
    assert (actor["params"], actor["grads"], actor["optimizer"]) == (2 * (n + t), 2 * t // 8, 12 * t // 8)


def test_plan_json_keeps_its_schema_with_lora(tmp_path):
    def document(*flags: str) -> dict:
        out = tmp_path / f"plan{len(flags)}.json"
        cfg, layout, _ = _ppo(tmp_path, *flags, "--plan_json", str(out))
        dry_run_memory(cfg, layout, write_json=True)
        return json.loads(out.read_text())

    full, lora = document(), document("--lora_rank", "8", "--target_modules", "q_proj", "v_proj")
    assert lora.keys() == full.keys() and lora["model"].keys() == full["model"].keys()
    assert lora["ranks"][0].keys() == full["ranks"][0].keys() and lora["settings"].keys() == full["settings"].keys()
    assert full["model"]["trainable_parameters"] == full["model"]["parameters"]
    assert lora["model"]["trainable_parameters"] == 4_194_304 and lora["settings"]["lora_rank"] == 8
    assert all(role != "ref" for r in lora["ranks"] for role in r["roles"])
    assert any("ref" in r["roles"] for r in full["ranks"])


def test_a_lora_critic_trains_its_adapters_and_value_head_and_unknown_targets_are_said(tmp_path):
    model = tmp_path / "llama-2-7b"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(LLAMA_2_7B))
    cfg = parse_args(["--pretrain", str(model), "--remote_rm_url", "demo", "--advantage_estimator", "gae", "--bf16",
                      "--init_kl_coef", "0", "--lora_rank", "16", "--target_modules", "q_proj", "v_proj", "c_attn",
                      "--gpu_memory_gb", "80"]).config
    layout = lay_out(cfg, 8, 8).layout
    shapes, _ = read_shapes(cfg, layout)
    memory = plan_memory(cfg, layout, shapes, GPU_80)
    rank = memory.ranks[0]
    assert rank.roles[:2] == (Role.ACTOR, Role.CRITIC)  # colocated on the 8 ranks
    actor, critic = 2 * 4_194_304, 2 * 4_194_304 + 4096  # rank 16 on q_proj, v_proj; the critic's value head whole
    assert rank.gpu["grads"] == 4 * actor // 8 + 4 * critic // 8
    text = format_plan(memory)
    assert "critic: 8.39M trainable parameters of 6.62B (0.13%, its value head included)" in text
    assert "reference" not in text.split("\n")[-1]  # no KL term: no reference at all
    [note, *_] = [line for line in note_lines(memory) if "c_attn" in line]
    assert "matches no linear layer" in note and "counted as no adapters" in note


def _dpo(tmp_path, *flags: str):
    model = tmp_path / "llama-2-7b"
    model.mkdir(exist_ok=True)
    (model / "config.json").write_text(json.dumps(LLAMA_2_7B))
    argv = ["--pretrain", str(model), "--dataset", "pairs.jsonl", "--bf16", "--zero_stage", "3",
            "--gradient_checkpointing", "--flash_attn", "--micro_train_batch_size", "1", "--max_len", "4096",
            "--gpu_memory_gb", "80", *flags]
    return parse_args(argv, importlib.import_module("rlrun.dpo").CLI).config


def test_lora_dpo_scores_its_reference_on_the_policy_base(tmp_path):
    dpo = SupervisedJob(pairs=True, reference=True)
    cfg = _dpo(tmp_path, "--lora_rank", "8")
    job = dpo.for_config(cfg)
    assert job.base_reference and not job.layout(8, 8).has(Role.REF)
    layout = job.layout(8, 8)
    memory = plan_memory(cfg, layout, read_shapes(cfg, layout, job)[0], GPU_80, job)
    rank = memory.ranks[1]
    assert rank.roles == (Role.ACTOR,) and rank.phase == "train_actor"
    # the reference's no-grad forward (the policy's base) runs before the policy's, inside the training step: its
    # working set is freed before the policy's is made, so nothing comes on top of SFT's plan
    sft = SupervisedJob(pairs=True).for_config(cfg)
    alone = plan_memory(cfg, sft.layout(8, 8), memory.shapes, GPU_80, sft).ranks[1].gpu
    extra = {k: rank.gpu.get(k, 0) - alone.get(k, 0) for k in rank.gpu}
    assert extra == {"params": 0, "grads": 0, "optimizer": 0, "gathered": 0, "activations": 0, "logits": 0}
    lines, _ = supervised_memory(cfg, dpo, 8, 8, False)
    assert "the reference is the policy's base (adapters off), no reference model" in lines[0]
    assert "| policy | train" in lines[0] and "policy,ref" not in lines[0]
    # a reference of its own (--ref_pretrain another model) stays a frozen model beside the LoRA policy
    other = _dpo(tmp_path, "--lora_rank", "8", "--ref_pretrain", "/elsewhere/ref")
    assert not dpo.for_config(other).base_reference
    lines, _ = supervised_memory(other, dpo, 8, 8, False)
    assert "policy,ref" in lines[0] and "no reference model" not in lines[0]


def test_lora_on_native_and_vllm_engines_plans_the_sync_of_the_adapters_alone(tmp_path):
    """The 7B LoRA job with native or (tensor parallel 1) vLLM engines on ranks of their own: the actor's first rank
    packs the adapters (bf16) into its send staging and a vLLM child's rank stages nothing; tensor-parallel vLLM
    engines take the merged model, two buckets of it."""
    flags = ("--lora_rank", "8", "--lora_alpha", "16", "--target_modules", "all-linear", "--actor_num_gpus_per_node",
             "8")
    _, _, native = _ppo(tmp_path, *flags, "--vllm_num_engines", "8", "--generation_backend", "native")
    _, _, vllm = _ppo(tmp_path, *flags, "--vllm_num_engines", "8", "--generation_backend", "vllm")
    _, _, vllm_tp = _ppo(tmp_path, *flags, "--vllm_num_engines", "4", "--vllm_tensor_parallel_size", "2",
                         "--generation_backend", "vllm")
    assert native.ranks[0].gpu["sync"] == vllm.ranks[0].gpu["sync"] == 2 * 19_988_480  # the adapters, in bf16
    assert "sync" not in vllm.ranks[8].gpu  # a vLLM child's rank stages nothing: the adapters go to vLLM as a file
    assert vllm_tp.ranks[0].gpu["sync"] == 2 * 256 * 2**20  # two buckets of the merged model
    assert vllm_tp.ranks[8].gpu["sync"] == 2 * 256 * 2**20  # each tensor-parallel child's first rank stages them
