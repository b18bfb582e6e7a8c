"""A mixture-of-experts policy end to end (torchrun, gloo): GRPO on the demo task with a tiny Qwen3-MoE built from
config with transformers' own classes (2 layers, 8 experts, top-2), --router_replay R3 (the native engine records each
token's experts, the rollout ships them as uint8, the actor's and the reference's forwards replay them) and
--aux_loss_coef. FSDP2 ZeRO-3 on packed rows at 2 ranks reads the per-expert checkpoint a shard at a time, learns,
reports the MoE metrics, streams an export transformers loads, and resumed from its middle checkpoint ends bit for bit where it did; DeepSpeed ZeRO-2 at 4 ranks
trains a tiny Mixtral (4 experts, top-2, every layer sparse) with --router_replay R2 (the actor's scoring pass
records the routing, its 4 ranks' shards are gathered, the training passes replay it) on token-budget micro-batches,
with LoRA on its attention; and rlrun.sft trains the Qwen3-MoE with the aux loss (here, beside the shared tiny MoE
checkpoints)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_rlrun, untimed
from rlrun.checkpoint import store as ckpt

STEPS, SAVE = 6, 3
MOE = ("actor/moe/aux_loss", "actor/moe/max_expert_load", "actor/moe/router_mismatch_frac")


@pytest.fixture(scope="module")
def moe_task(tmp_path_factory) -> list[str]:
    from transformers import MixtralConfig, Qwen3MoeConfig

    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    root = tmp_path_factory.mktemp("moe")
    dense = tiny_model_config().to_dict()
    config = Qwen3MoeConfig(
        **{k: dense[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")},
        hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2,
        norm_topk_prob=True, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
        max_position_embeddings=512, tie_word_embeddings=False,
    )
    build_causal_lm(config, seed=3).save_pretrained(root / "base")
    build_byte_tokenizer().save_pretrained(root / "base")
    mixtral = MixtralConfig(
        **{k: dense[k] for k in ("vocab_size", "bos_token_id", "eos_token_id", "pad_token_id")},
        hidden_size=64, intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=512,
        tie_word_embeddings=False,
    )
    build_causal_lm(mixtral, seed=4).save_pretrained(root / "mixtral")
    build_byte_tokenizer().save_pretrained(root / "mixtral")
    return ["--config", "configs/demo.yaml", "--pretrain", str(root / "base"), "--remote_rm_url", "demo",
            "--router_replay", "R3", "--aux_loss_coef", "0.01", "--use_kl_loss", "--init_kl_coef", "0.01",
            "--dist_timeout", "60"]



def test_fsdp_zero3_learns_with_replay_exports_and_resumes_exactly(moe_task, tmp_path) -> None:
    from transformers import AutoModelForCausalLM

    args = [*moe_task, "--zero_stage", "3", "--packing_samples", "--max_steps", str(STEPS)]
    run = run_rlrun(2, [*args, "--save_steps", str(SAVE), "--ckpt_path", str(tmp_path / "run" / "ckpt")],
                    tmp_path / "run", timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    assert "read whole on every rank" not in run.output  # the per-expert checkpoint is read a shard at a time
    assert len(run.metrics) == STEPS
    for m in run.metrics:
        assert all(key in m for key in (*MOE, "actor/moe/max_expert_load/sparse_layer_1")), sorted(m)
        assert 0 <= m["actor/moe/router_mismatch_frac"] <= 1 and m["actor/moe/aux_loss"] > 0
        assert m["rollout/engine_vs_actor_logprob_diff"] < 1e-4  # old log-probs replay the engine's routing
    rewards = [m["reward"] for m in run.metrics]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.03, rewards

    exported = AutoModelForCausalLM.from_pretrained(tmp_path / "run")
    assert type(exported).__name__ == "Qwen3MoeForCausalLM"
    saved = load_file(tmp_path / "run" / "model.safetensors")
    base = AutoModelForCausalLM.from_pretrained(moe_task[moe_task.index("--pretrain") + 1])
    ids = torch.tensor([[72, 101, 108, 108, 111]])
    assert not torch.allclose(exported(ids).logits, base(ids).logits)  # trained, experts included

    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(str(tmp_path / "run" / "ckpt"), SAVE), ckpt.step_dir(str(resumed / "ckpt"), SAVE))
    again = run_rlrun(2, [*args, "--load_checkpoint", "--ckpt_path", str(resumed / "ckpt")], resumed, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert [m["step"] for m in again.metrics] == list(range(SAVE + 1, STEPS + 1))
    assert untimed(again.metrics) == untimed(run.metrics)[SAVE:]
    final = load_file(resumed / "model.safetensors")
    assert final.keys() == saved.keys() and all(torch.equal(final[k], saved[k]) for k in saved)


def test_deepspeed_zero2_trains_a_mixtral_at_4_ranks_with_r2(moe_task, tmp_path) -> None:
    """Also packed rows under DeepSpeed: its engine's model attends each packed sequence by itself (the GPU
    default's path, found through the engine's `module`). R2's mismatch metric exists only where the training pass
    had recorded routing to replay, i.e. the gather reached the actor."""
    mixtral = str(Path(moe_task[moe_task.index("--pretrain") + 1]).parent / "mixtral")
    run = run_rlrun(4, [*moe_task, "--pretrain", mixtral, "--strategy", "deepspeed", "--zero_stage", "2",
                        "--packing_samples", "--router_replay", "R2", "--dynamic_batch", "--train_batch_size", "64",
                        "--lora_rank", "8", "--lora_alpha", "16", "--actor_learning_rate", "0.05", "--max_steps", "3"],
                    tmp_path / "ds", timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    assert len(run.metrics) == 3 and all(all(key in m for key in MOE) for m in run.metrics)
    assert run.metrics[-1]["actor/moe/aux_loss"] > 0
    assert all(m["actor/moe/router_mismatch_frac"] < 0.1 for m in run.metrics), [(m["actor/moe/router_mismatch_frac"], m.get("kl")) for m in run.metrics]


def test_sft_trains_a_moe_with_the_aux_loss_at_2_ranks(moe_task, tmp_path) -> None:
    """rlrun.sft with OpenRLHF's --aux_loss_coef on the tiny Qwen3-MoE (FSDP2, its per-expert checkpoint read a
    shard at a time): the flag reaches the loss (moe/aux_loss and moe/max_expert_load in the metrics) and the NLL
    falls."""
    from rlrun.supervised.datasets import write_all

    data = write_all(str(tmp_path / "data"), sft=32, pairs=8, eval_pairs=8)
    base = moe_task[moe_task.index("--pretrain") + 1]
    run = run_rlrun(2, ["--pretrain", base, "--dataset", data["sft"], "--output_key", "output", "--input_template",
                        "{}", "--micro_train_batch_size", "4", "--train_batch_size", "8", "--learning_rate", "1e-2",
                        "--aux_loss_coef", "0.01", "--max_epochs", "2"], tmp_path / "sft", module="rlrun.sft",
                    timeout=300)
    assert run.returncode == 0, run.output[-3000:]
    assert "read whole on every rank" not in run.output
    train = [m for m in run.metrics if any(k.endswith("moe/aux_loss") for k in m)]
    assert len(train) >= 4, run.metrics[:2]
    key = next(k for k in train[0] if k.endswith("moe/aux_loss"))
    assert all(m[key] > 0 and 0 < m[key.replace("aux_loss", "max_expert_load")] <= 1 for m in train)
    losses = [m[key.replace("moe/aux_loss", "loss")] for m in train]
    assert losses[-1] < losses[0], losses



def test_moe_engines_on_their_own_rank_train_alike_from_many_senders_with_delta_and_from_the_root(moe_task, tmp_path):
    """2 FSDP2 actor ranks + 1 native engine rank: the experts' 3-D weights, sharded on their first dimension, sent
    by both actor ranks (with --weight_sync_delta after the first sync) give every step the numbers the root path's
    syncs give, R3's replay included."""
    layout = ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--max_steps", "3"]
    many = run_rlrun(3, [*moe_task, *layout, "--weight_sync_delta"], tmp_path / "many", timeout=300)
    root = run_rlrun(3, [*moe_task, *layout, "--weight_sync_senders", "root"], tmp_path / "root", timeout=300)
    assert many.returncode == 0 and root.returncode == 0, many.output[-3000:] + root.output[-3000:]
    assert "each of the 2 actor ranks sends its own shard" in many.output and "delta: only the elements" in many.output
    assert len(many.metrics) == 3 and untimed(many.metrics) == untimed(root.metrics)
