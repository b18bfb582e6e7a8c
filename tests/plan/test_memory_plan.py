"""--dry_run's memory plan: exact parameter counts against real HF models built from config, ZeRO's accounting on
the 70B PPO job of USER_COMMANDS (job 1) and what it says would make it fit, a 7B job that fits, the CPU plan, and
--plan_json written by a real `python -m rlrun.ppo --dry_run` for a 40-rank world."""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
import sys

import pytest
import torch
import transformers
from helpers import REPO, subprocess_env
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from rlrun.cli.parser import parse_args
from rlrun.launch.layout import Role
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config_for_size
from rlrun.plan.memory import kv_cache_bytes
from rlrun.plan.shapes import GIB, SupervisedJob, Target, knobs_of
from rlrun.plan.memory import plan_memory
from rlrun.plan.memory_text import (dry_run_memory, format_plan, note_lines, plan_json, problem_lines, read_shapes,
                                  supervised_memory, target_for)
from rlrun.plan.shapes import model_shape
from rlrun.vision.demo import tiny_vl_config
from rlrun.plan.plan import lay_out

SMALL = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             vocab_size=300)
LLAMA_2_70B = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 8192,
               "num_hidden_layers": 80, "intermediate_size": 28672, "num_attention_heads": 64, "num_key_value_heads": 8,
               "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 4096, "rms_norm_eps": 1e-5}
LLAMA_2_7B = {**LLAMA_2_70B, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 11008,
              "num_attention_heads": 32, "num_key_value_heads": 32}
GPU_80 = Target(True, 80 * GIB, "test")
# Job 1 of ../shared/USER_COMMANDS.md (OpenRLHF's 70B PPO), roles on separate nodes of 8; engines as vLLM (what auto
# picks on GPU nodes with vLLM installed).
JOB_1 = ["--ref_num_nodes", "1", "--ref_num_gpus_per_node", "8", "--reward_num_nodes", "1", "--reward_num_gpus_per_node",
         "8", "--critic_num_nodes", "1", "--critic_num_gpus_per_node", "8", "--actor_num_nodes", "1",
         "--actor_num_gpus_per_node", "8", "--vllm_num_engines", "2", "--vllm_tensor_parallel_size", "4",
         "--reward_pretrain", "./reward-model-70b", "--save_steps", "100", "--logging_steps", "1",
         "--micro_train_batch_size", "2", "--train_batch_size", "128", "--micro_rollout_batch_size", "4",
         "--rollout_batch_size", "1024", "--max_epochs", "1", "--prompt_max_len", "1024", "--generate_max_len", "1024",
         "--zero_stage", "3", "--bf16", "--actor_learning_rate", "5e-7", "--critic_learning_rate", "9e-6",
         "--init_kl_coef", "0.01", "--normalize_reward", "--gradient_checkpointing", "--flash_attn"]


def _model_dir(path, config: dict):
    path.mkdir(exist_ok=True)
    build_byte_tokenizer().save_pretrained(path)  # the dry run's preflight renders a prompt with it
    (path / "config.json").write_text(json.dumps(config))
    return path


def _counts(config) -> tuple[int, int]:
    with torch.device("meta"):
        lm = AutoModelForCausalLM.from_config(config)
        config.num_labels = 1
        scalar = AutoModelForSequenceClassification.from_config(config)
    return sum(p.numel() for p in lm.parameters()), sum(p.numel() for p in scalar.parameters())


@pytest.mark.parametrize("config", [
    transformers.LlamaConfig(**SMALL),
    transformers.LlamaConfig(**SMALL, tie_word_embeddings=True, attention_bias=True, mlp_bias=True, head_dim=24),
    transformers.Qwen2Config(**SMALL),
    transformers.Qwen3Config(**SMALL, head_dim=32),
    transformers.MistralConfig(**SMALL),
    transformers.MixtralConfig(**SMALL, num_local_experts=4, num_experts_per_tok=2),
    transformers.Qwen2MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32, shared_expert_intermediate_size=48,
                                decoder_sparse_step=2, mlp_only_layers=[0]),
    transformers.Qwen3MoeConfig(**SMALL, num_experts=4, moe_intermediate_size=32, num_experts_per_tok=2,
                                mlp_only_layers=[1]),
    tiny_model_config_for_size("tiny"),
    tiny_model_config_for_size("3m"),
], ids=lambda c: c.model_type)
def test_parameter_counts_are_exact_for_the_causal_lm_and_its_score_head_body(config):
    shape = model_shape(config)
    causal, scalar = _counts(config)
    assert shape.parameters == causal
    assert shape.scalar().parameters == scalar  # critic / reward model: the body and a [hidden, 1] head


@pytest.mark.parametrize("config", [
    tiny_vl_config(),
    transformers.Qwen2VLConfig(vision_config={"depth": 2, "embed_dim": 32, "hidden_size": 64, "num_heads": 2,
                                              "mlp_ratio": 2}, **{**SMALL, "vocab_size": 300}),
], ids=lambda c: c.model_type)
def test_vision_language_parameter_counts_include_the_vision_tower(config):
    """Qwen2.5-VL (SwiGLU blocks, RMSNorm) and Qwen2-VL (fc1/fc2, LayerNorm): text model + vision tower + merger."""
    model = build_causal_lm(config, seed=0)
    assert model_shape(config).parameters == sum(p.numel() for p in model.parameters())
    assert model_shape(config).vision == sum(p.numel() for n, p in model.named_parameters() if ".visual." in n)


def _job(tmp_path, *flags: str, world: int = 40, config: dict = LLAMA_2_70B):
    model = _model_dir(tmp_path / "model", config)
    cfg = parse_args(["--pretrain", str(model), "--generation_backend", "vllm", *flags]).config
    layout = lay_out(cfg, world, 8).layout
    shapes, notes = read_shapes(cfg, layout)
    assert shapes is not None
    return cfg, layout, plan_memory(cfg, layout, shapes, GPU_80), notes


def test_the_70b_actor_at_zero3_needs_zeros_16_bytes_per_parameter_and_fits_with_adam_offload(tmp_path):
    cfg, layout, memory, notes = _job(tmp_path, *JOB_1)
    actor = memory.ranks[layout.ranks_of(Role.ACTOR)[0]]
    n = memory.shapes[Role.ACTOR].parameters
    assert n == 68_976_648_192  # Llama-2-70b's sum(p.numel())
    assert actor.gpu["params"] + actor.gpu["grads"] + actor.gpu["optimizer"] == 16 * n // 8  # 128.5 GiB
    # ZeRO's 128.5 GiB of states plus the working sets: FSDP2's three gathered 1.6 GiB blocks, a block's gradients and
    # fp32 reduce-scatter buffer, the checkpointed activations (145.9 GiB)
    assert 140 * GIB < actor.gpu_total < 150 * GIB and actor.fits is False
    assert {"gathered", "activations", "logits"} <= set(actor.gpu)
    # the HF export streams one unit at a time: global rank 0's host holds one fp32 tensor (the embedding), not the
    # 276 GB policy
    assert actor.host["export"] == 4 * 32000 * 8192 and "export" not in memory.ranks[1].host
    assert any("not on this machine, planned with the policy's shape" in note for note in notes)  # ./reward-model-70b
    lines = problem_lines(memory)
    # weight sync from many senders: every actor rank's two stripe buffers, each an eighth of the largest bucket (bf16,
    # the 500 MiB embedding alone)
    bucket = 2 * 32000 * 8192
    assert all(memory.ranks[r].gpu["sync"] == 2 * bucket // 8 for r in layout.ranks_of(Role.ACTOR))
    actor_line = next(line for line in lines if "actor on ranks 0-7:" in line)  # every actor rank alike
    assert "--adam_offload" in actor_line and "24 actor ranks (--actor_num_nodes 3" in actor_line
    # The two engines of tensor parallel 4 keep no copy of the policy (weight sync streams to vLLM): each rank holds
    # vLLM's share only; each engine's first rank also the two bucket-sized buffers it receives into, and on its
    # node's host the /dev/shm file its workers read (the bf16 policy)
    assert len(layout.engines) == 2
    for engine in layout.engines:
        leader, *others = (memory.ranks[r] for r in engine)
        share = leader.gpu["vllm"]
        assert 70 * GIB < share < 80 * GIB and leader.fits and all(r.fits for r in others)
        # (vLLM's share is fitted to what the rank leaves it: the leader's is smaller by its buffers: the two it hands
        # on from and the two it takes the actor ranks' stripes into)
        assert leader.gpu == {"vllm": share, "sync": 4 * bucket}
        assert all(r.gpu == {"vllm": share + 4 * bucket} for r in others)
        assert leader.host["sync"] == 2 * n and all("sync" not in r.host for r in others)
    assert not [line for line in lines if "engine on ranks" in line]

    _, _, offloaded, _ = _job(tmp_path, *JOB_1, "--adam_offload")
    actor = offloaded.ranks[0]
    assert actor.gpu_total < 80 * GIB and actor.fits
    assert actor.host["optimizer"] == 8 * n // 8 and actor.host["params"] == 4 * n // 8  # FSDP2's CPUOffloadPolicy
    assert offloaded.node_host()[0]["optimizer"] == 8 * n  # the actor's node holds every rank's share


def test_deepspeed_accounting_per_stage(tmp_path):
    """ZeRO's bytes per parameter with --bf16: params 2, grads 2, fp32 master + Adam 12; stage 1 shards the
    optimizer, 2 also the grads, 3 everything (8 ranks)."""
    model = _model_dir(tmp_path / "model", LLAMA_2_7B)
    cfg = parse_args(["--pretrain", str(model), "--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8",
                      "--remote_rm_url", "demo", "--init_kl_coef", "0", "--advantage_estimator", "group_norm",
                      "--n_samples_per_prompt", "8", "--bf16", "--train_batch_size", "128", "--rollout_batch_size",
                      "128", "--vllm_num_engines", "8"]).config
    layout = lay_out(cfg, 16, 8).layout  # planned as fsdp: the deepspeed extra need not be installed for the estimate
    shapes, _ = read_shapes(cfg, layout)
    n = shapes[Role.ACTOR].parameters
    for stage, per_param in {0: (2, 2, 12), 1: (2, 2, 12 / 8), 2: (2, 2 / 8, 12 / 8), 3: (2 / 8, 2 / 8, 12 / 8)}.items():
        train = dataclasses.replace(cfg.train, strategy="deepspeed", zero_stage=stage)
        actor = plan_memory(dataclasses.replace(cfg, train=train), layout, shapes, GPU_80).ranks[0].gpu
        assert (actor["params"], actor["grads"], actor["optimizer"]) == tuple(int(b * n) for b in per_param), stage
    # --adam_offload: the optimizer (fp32 master included) moves to host memory (ZeRO-Offload)
    train = dataclasses.replace(cfg.train, strategy="deepspeed", zero_stage=3, adam_offload=True)
    actor = plan_memory(dataclasses.replace(cfg, train=train), layout, shapes, GPU_80).ranks[0]
    assert "optimizer" not in actor.gpu and actor.host["optimizer"] == 12 * n // 8


def test_a_7b_grpo_job_on_8_gpus_fits_and_colocated_vllm_at_095_does_not(tmp_path):
    grpo = ["--actor_num_nodes", "1", "--actor_num_gpus_per_node", "8", "--ref_num_nodes", "1", "--ref_num_gpus_per_node",
            "8", "--colocate_actor_ref", "--remote_rm_url", "demo", "--advantage_estimator", "group_norm",
            "--n_samples_per_prompt", "8", "--rollout_batch_size", "128", "--train_batch_size", "128",
            "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "8", "--bf16", "--zero_stage", "3",
            "--gradient_checkpointing", "--prompt_max_len", "1024", "--generate_max_len", "2048"]
    _, _, memory, _ = _job(tmp_path, *grpo, "--vllm_num_engines", "8", world=16, config=LLAMA_2_7B)
    assert memory.fits and not memory.problems
    assert all(r.gpu_total < 40 * GIB for r in memory.ranks[:8])  # 6.7B: 16 B x n / 8 ~ 12.6 GiB + work
    # vLLM on the actor's ranks at its default 0.95 of the GPU: the rank overflows; the plan says how to fit it
    _, _, colocated, _ = _job(tmp_path, *grpo, world=8, config=LLAMA_2_7B)
    assert colocated.fits is False
    advice = " ".join(problem_lines(colocated))
    assert re.search(r"fits with --vllm_gpu_memory_utilization 0\.[3-8]\d \(", advice), advice
    assert "actor,ref,engine" in format_plan(colocated)
    # no engine rank keeps a copy of the policy: the in-process engines (this layout's host) take the gathered
    # tensors; child hosts stream through two staging buffers of --weight_sync_bucket_mb (256 MiB) each
    _, _, child, _ = _job(tmp_path, *grpo, "--vllm_engine_host", "child", world=8, config=LLAMA_2_7B)
    assert child.ranks[0].gpu["params"] == colocated.ranks[0].gpu["params"]
    assert child.ranks[0].gpu["sync"] == 2 * 256 * 2**20 and "sync" not in colocated.ranks[0].gpu
    # the 8 disaggregated engines are children at tensor parallel 1: each keeps a host copy of every sync (the bf16
    # policy) to restart a failed child with, none with --max_engine_restarts 0 (and none at all in-process)
    n = memory.shapes[Role.ACTOR].parameters
    assert all(memory.ranks[r].host["sync"] == 2 * n for r in range(8, 16)) and "sync" not in memory.ranks[0].host
    _, _, no_restarts, _ = _job(tmp_path, *grpo, "--vllm_num_engines", "8", "--max_engine_restarts", "0", world=16,
                                config=LLAMA_2_7B)
    assert all("sync" not in r.host for r in no_restarts.ranks) and "sync" not in colocated.ranks[0].host
    # OpenRLHF's colocated recipe: vLLM frees its memory outside generation, the models park theirs during it
    _, _, asleep, _ = _job(tmp_path, *grpo, "--vllm_enable_sleep", "--deepspeed_enable_sleep", world=8, config=LLAMA_2_7B)
    assert asleep.fits and asleep.ranks[0].phase == "generate" and asleep.ranks[0].host["params"] > 0


def test_a_cpu_plan_puts_every_byte_in_host_memory(tmp_path):
    cfg = parse_args(["--remote_rm_url", "demo", "--model_preset", "3m", "--device", "cpu", "--zero_stage", "3",
                      "--actor_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "2", "--colocate_actor_ref",
                      "--rollout_batch_size", "4", "--train_batch_size", "4", "--micro_train_batch_size", "2",
                      "--micro_rollout_batch_size", "2", "--critic_num_gpus_per_node", "2",
                      "--colocate_all_models"]).config
    layout = lay_out(cfg, 2, 2).layout
    shapes, _ = read_shapes(cfg, layout)
    memory = plan_memory(cfg, layout, shapes, Target(False, 0, "--device cpu"))
    n = shapes[Role.ACTOR].parameters
    rank = memory.ranks[0]
    assert rank.gpu == {} and rank.fits is None and memory.fits is None
    assert rank.host["optimizer"] >= 8 * n // 2 and rank.host["runtime"] > 0  # fp32 Adam moments, sharded over 2
    assert "every byte is host memory" in format_plan(memory)
    # the native engine's KV budget caps its cache (generation in batches); unchunked logits cost a whole response
    native = dataclasses.replace(cfg, generation=dataclasses.replace(cfg.generation, generation_backend="native"))
    capped = dataclasses.replace(native, generation=dataclasses.replace(native.generation, native_kv_cache_mb=1),
                                 train=dataclasses.replace(cfg.train, logits_chunk_size=0))
    before = plan_memory(native, layout, shapes, Target(False, 0, "--device cpu")).ranks[0].phases
    after = plan_memory(capped, layout, shapes, Target(False, 0, "--device cpu")).ranks[0].phases
    kv = kv_cache_bytes(shapes[Role.ACTOR], knobs_of(native, Target(False, 0, "")), 2)  # 4 rollouts over 2 engine ranks
    assert before["generate"] - after["generate"] == kv - (1 << 20)
    rows, response, vocab = 2, cfg.generation.generate_max_len, shapes[Role.ACTOR].vocab
    assert after["train_actor"] - before["train_actor"] == (rows * response - 1024) * vocab * 4 * 3
    # --partial_rollout: the engines keep --max_staleness steps' rows in flight, and their KV cache holds them all
    partial = dataclasses.replace(native, train=dataclasses.replace(native.train, partial_rollout=True, max_staleness=3))
    assert knobs_of(partial, Target(False, 0, "")).rollouts == 3 * knobs_of(native, Target(False, 0, "")).rollouts


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the plan's target on a machine without a GPU")
def test_without_a_gpu_here_the_plan_is_a_cpu_runs_unless_gpus_are_named():
    def target(*flags: str) -> Target:
        return target_for(parse_args(["--remote_rm_url", "demo", *flags]).config.runtime)

    assert not target().gpu and not target("--device", "cpu", "--gpu_memory_gb", "80").gpu  # what auto runs here
    assert target("--gpu_memory_gb", "141").gpu_bytes == 141 * GIB
    assert target("--device", "cuda").gpu_bytes == 80 * GIB


def test_a_model_on_another_machine_skips_the_plan_and_says_why(tmp_path):
    cfg = parse_args(["--pretrain", "/nonexistent/llama", "--remote_rm_url", "demo", "--plan_json",
                      str(tmp_path / "plan.json")]).config
    lines, problems = dry_run_memory(cfg, lay_out(cfg, 1, 1).layout, write_json=True)
    assert lines == ["memory plan skipped: --pretrain /nonexistent/llama is not on this machine (the plan reads its "
                     "config.json)"] and problems == []
    assert json.loads((tmp_path / "plan.json").read_text())["skipped"] == lines[0]


def test_plan_json_from_a_real_dry_run_of_the_70b_job(tmp_path):
    model = _model_dir(tmp_path / "llama-2-70b", LLAMA_2_70B)
    out = tmp_path / "plan.json"
    env = subprocess_env(RANK="0", LOCAL_RANK="0", WORLD_SIZE="40", LOCAL_WORLD_SIZE="8")
    cmd = [sys.executable, "-m", "rlrun.ppo", "--dry_run", "--pretrain", str(model), *JOB_1, "--save_path",
           str(tmp_path / "save"), "--ckpt_path", str(tmp_path / "ckpt"), "--plan_json", str(out), "--gpu_memory_gb", "80"]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    log = proc.stdout + proc.stderr
    assert "memory plan, GiB per rank" in log and "does not fit: actor on ranks 0-7:" in log
    plan_doc = json.loads(out.read_text())
    assert len(plan_doc["ranks"]) == 40 and plan_doc["fits"] is False
    first = plan_doc["ranks"][0]
    assert (first["rank"], first["node"], first["roles"]) == (0, 0, ["actor"])
    gpu = first["memory"]["gpu_bytes"]
    assert gpu["total"] == sum(v for k, v in gpu.items() if k != "total")
    assert 140 * GIB < gpu["total"] < 150 * GIB and {"params", "grads", "optimizer"} <= set(gpu)
    assert first["memory"]["host_bytes"]["total"] > 0
    assert plan_doc["model"]["parameters"] == 68_976_648_192
    assert any("--adam_offload" in line for line in plan_doc["advice"])
    assert [n["node"] for n in plan_doc["nodes"]] == [0, 1, 2, 3, 4]


def _supervised(module: str, argv: list[str]):
    import importlib

    return parse_args(argv, importlib.import_module(module).CLI).config


DPO_7B = ["--dataset", "pairs.jsonl", "--bf16", "--zero_stage", "3", "--gradient_checkpointing", "--flash_attn",
          "--micro_train_batch_size", "1", "--max_len", "4096"]


def test_dpo_scores_its_reference_inside_the_training_step_and_ref_offload_moves_it_to_host(tmp_path):
    model = _model_dir(tmp_path / "llama-2-7b", LLAMA_2_7B)
    cfg = _supervised("rlrun.dpo", ["--pretrain", str(model), *DPO_7B])
    job = SupervisedJob(pairs=True, reference=True)
    layout = job.layout(8, 8)
    shapes, notes = read_shapes(cfg, layout, job)
    assert notes == [] and shapes[Role.REF] == shapes[Role.ACTOR]
    memory = plan_memory(cfg, layout, shapes, GPU_80, job)
    n, rank = shapes[Role.ACTOR].parameters, memory.ranks[1]
    assert rank.roles == (Role.ACTOR, Role.REF) and rank.phase == "train_actor" and memory.fits
    assert memory.knobs.micro_train == 2 and memory.knobs.seq == 4096  # a pair is two rows of up to --max_len
    assert rank.gpu["params"] == 4 * n // 8 + 2 * n // 8  # fp32 policy shards + the bf16 reference's (ZeRO-3)
    alone = SupervisedJob(pairs=True)
    sft = plan_memory(cfg, alone.layout(8, 8), shapes, GPU_80, alone).ranks[1]
    extra = {k: rank.gpu.get(k, 0) - sft.gpu.get(k, 0) for k in rank.gpu}
    # the reference's no-grad forward runs before each micro-batch's policy forward, its working set freed first: only
    # its shards come on top of the policy's training
    assert extra == {"params": 2 * n // 8, "grads": 0, "optimizer": 0, "gathered": 0, "activations": 0, "logits": 0}
    offloaded = plan_memory(dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, ref_offload=True)), layout,
                            shapes, GPU_80, job).ranks[1]
    assert offloaded.gpu["params"] == 4 * n // 8 and offloaded.host["params"] == 2 * n // 8
    text = format_plan(memory)
    assert re.search(r"^1-7 +\| 0 +\| policy,ref \| train +\|", text, re.M), text
    assert "policy: 6.74B parameters (32 layers, hidden 4096, 32 heads, 32 KV heads, vocab 32000)" in text
    assert "ref:" not in text  # the reference is the policy's shape


def test_a_dpo_rank_that_does_not_fit_is_told_the_flags_that_would_fit_it(tmp_path):
    model = _model_dir(tmp_path / "llama-2-7b", LLAMA_2_7B)
    job = SupervisedJob(pairs=True, reference=True)
    layout = job.layout(8, 8)

    def advice(micro: str) -> str:
        cfg = _supervised("rlrun.dpo", ["--pretrain", str(model), *DPO_7B, "--zero_stage", "2", "--max_len", "8192",
                                        "--micro_train_batch_size", micro])
        [line] = problem_lines(plan_memory(cfg, layout, read_shapes(cfg, layout, job)[0], GPU_80, job))
        assert line.startswith("does not fit: policy,ref on ranks 0-7: "), line
        return line

    line = advice("6")
    assert re.search(r"fits with --adam_offload \([\d.]+ GiB\), or --zero_stage 3 \([\d.]+ GiB\), or --zero_stage 3 "
                     r"--ref_offload \([\d.]+ GiB\), or a world of 16 ranks \([\d.]+ GiB\)$", line), line
    # no single change is enough: all together, each flag once
    assert re.search(r"fits with --adam_offload --zero_stage 3 --ref_offload \([\d.]+ GiB\)$", advice("10")), advice("10")


def test_rm_trains_a_score_head_model_without_logits(tmp_path):
    model = _model_dir(tmp_path / "llama-2-7b", LLAMA_2_7B)
    cfg = _supervised("rlrun.rm", ["--pretrain", str(model), "--dataset", "pairs.jsonl", "--bf16", "--zero_stage", "3",
                                   "--micro_train_batch_size", "2"])
    job = SupervisedJob(pairs=True, scalar=True)
    layout = job.layout(8, 8)
    shapes, _ = read_shapes(cfg, layout, job)
    memory = plan_memory(cfg, layout, shapes, GPU_80, job)
    scalar = shapes[Role.CRITIC].parameters
    assert scalar == shapes[Role.ACTOR].parameters - 32000 * 4096 + 4096  # the LM head becomes [hidden, 1]
    first = memory.ranks[0]
    assert first.roles == (Role.CRITIC,) and "logits" not in first.gpu and memory.knobs.micro_train == 4
    assert first.host["export"] == 4 * 32000 * 4096 and "export" not in memory.ranks[1].host  # the writer, rank 0
    text = format_plan(memory)
    assert re.search(r"^0 +\| 0 +\| model \| train +\|", text, re.M), text
    assert "model: 6.61B parameters (32 layers, hidden 4096, 32 heads, 32 KV heads, vocab 32000; a [hidden, 1] score " \
           "head in place of the LM head)" in text


def test_supervised_dry_run_memory_prints_writes_json_and_skips_what_is_not_here(tmp_path):
    model = _model_dir(tmp_path / "llama-2-7b", LLAMA_2_7B)
    plan_file = tmp_path / "plan.json"
    cfg = _supervised("rlrun.sft", ["--pretrain", str(model), "--dataset", "sft.jsonl", "--bf16", "--gpu_memory_gb", "80",
                                    "--plan_json", str(plan_file)])
    lines, problems = supervised_memory(cfg, SupervisedJob(), 4, 2, True)
    assert lines[0].startswith("memory plan, GiB per rank at its peak phase, for GPUs of 80.0 GiB (--gpu_memory_gb)")
    assert "| model | train |" in lines[0] and "model: 6.74B parameters" in lines[0]
    assert problems == [] or all(p.startswith("does not fit: model on rank") for p in problems)
    doc = json.loads(plan_file.read_text())
    assert [r["roles"] for r in doc["ranks"]] == [["actor"]] * 4 and [n["node"] for n in doc["nodes"]] == [0, 1]
    cfg = _supervised("rlrun.dpo", ["--pretrain", "out/sft", "--dataset", "pairs.jsonl"])
    assert supervised_memory(cfg, SupervisedJob(pairs=True, reference=True), 8, 8, False) == (
        ["memory plan skipped: --pretrain out/sft is not on this machine (the plan reads its config.json)"], [])
    cfg = _supervised("rlrun.dpo", ["--pretrain", str(model), "--ref_pretrain", "/elsewhere/ref", "--dataset", "p.jsonl"])
    lines, _ = supervised_memory(cfg, SupervisedJob(pairs=True, reference=True), 8, 8, False)
    assert "ref (--ref_pretrain /elsewhere/ref): not on this machine, planned with the policy's shape" in lines


def test_sequence_parallelism_divides_the_per_token_work_and_lengthens_what_fits(tmp_path):
    """--sequence_parallel_size N: activations and logits per rank / N, the all-to-all buffers (and the mask of rows
    up to DENSE_MASK_COLUMNS) in their own column; the longest --generate_max_len that fits grows about N-fold."""
    from rlrun.plan.memory import activation_bytes, ulysses_bytes
    from rlrun.strategies.ulysses import DENSE_MASK_COLUMNS

    grpo = ["--colocate_all_models", "--remote_rm_url", "demo", "--advantage_estimator", "group_norm", "--use_kl_loss",
            "--n_samples_per_prompt", "8", "--rollout_batch_size", "16", "--train_batch_size", "128",
            "--micro_train_batch_size", "1", "--micro_rollout_batch_size", "1", "--bf16", "--zero_stage", "3",
            "--gradient_checkpointing", "--prompt_max_len", "1024", "--generate_max_len", "15360",
            "--logits_chunk_size", "0", "--vllm_gpu_memory_utilization", "0.3", "--vllm_enable_sleep"]
    plans = {sp: _job(tmp_path, *grpo, "--sequence_parallel_size", str(sp), world=8, config=LLAMA_2_7B)
             for sp in (1, 2, 4)}
    shape, k = plans[1][2].shapes[Role.ACTOR], plans[1][2].knobs
    assert plans[2][2].knobs.sp_of(Role.ACTOR) == 2 and plans[2][2].knobs.sp_of(Role.REF) == 2
    # the actor's training forward at sp 4 keeps a quarter of the activations, projects a quarter of the positions
    assert activation_bytes(shape, k, 1, True, 4) == pytest.approx(activation_bytes(shape, k, 1, True) / 4, rel=1e-3)
    assert "ulysses" not in plans[1][2].ranks[0].gpu
    phases = {sp: m.ranks[0].phases["train_actor"] for sp, (_, _, m, _) in plans.items()}
    assert phases[4] < phases[2] < phases[1]
    # rows over DENSE_MASK_COLUMNS attend sequence by sequence: no [L, L] mask is counted
    assert k.seq > DENSE_MASK_COLUMNS
    assert ulysses_bytes(shape, k, 1, 2) < 2 * k.seq * shape.hidden * 2  # a layer's q/k/v in two layouts, no mask
    short = dataclasses.replace(k, seq=4096, response=3072)
    assert ulysses_bytes(shape, short, 1, 2) >= 4096 * 4096 * 3  # the cached mask and sdpa's bf16 copy
    longest = {sp: plans[sp][2].longest for sp in plans}
    assert all(len(runs) == 1 and runs[0][0] == tuple(range(8)) for runs in longest.values())
    tokens = {sp: runs[0][1] for sp, runs in longest.items()}
    assert tokens[1] < tokens[2] < tokens[4] and tokens[4] > 3 * tokens[1], tokens
    line = next(line for line in note_lines(plans[4][2]) if line.startswith("longest --generate_max_len"))
    assert "(sequence parallelism: actor 4, ref 4)" in line and f"ranks 0-7 (actor,ref,engine) {tokens[4]:,} tokens" in line
    assert plan_json(plans[4][2], [])["longest_response"] == [{"ranks": list(range(8)), "tokens": tokens[4]}]


def test_supervised_plans_say_the_longest_max_len_and_count_the_blocks(tmp_path):
    model = _model_dir(tmp_path / "llama-2-7b", LLAMA_2_7B)
    lengths = {}
    for sp in (1, 4):
        cfg = _supervised("rlrun.sft", ["--pretrain", str(model), "--dataset", "sft.jsonl", "--bf16", "--gpu_memory_gb",
                                        "80", "--gradient_checkpointing", "--zero_stage", "3", "--micro_train_batch_size",
                                        "1", "--max_len", "8192", "--sequence_parallel_size", str(sp)])
        lines, _ = supervised_memory(cfg, SupervisedJob(), 8, 8, False)
        line = next(line for line in lines if line.startswith("longest --max_len"))
        lengths[sp] = int(re.search(r"ranks 0-7 \(model\) ([\d,]+) tokens", line).group(1).replace(",", ""))
    assert lengths[4] > 3 * lengths[1], lengths


def test_the_gateway_s_records_are_in_an_engine_rank_s_host_memory():
    """An engine rank of a gateway source holds, per row, each call's context (up to prompt + response ids) and the
    sampled ids with their log-probs: 4 rollouts over 2 engine ranks, 3 calls (--max_turns), 64 + 16 tokens:
    2 x (3 x 80 x 36 + 16 x 68) bytes. Without a gateway source, none."""
    flags = ["--model_preset", "3m", "--device", "cpu", "--rollout_batch_size", "4", "--train_batch_size", "4",
             "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2", "--prompt_max_len", "64",
             "--generate_max_len", "16", "--generation_backend", "native"]
    cfg = parse_args([*flags, "--agent_command", "python agent.py", "--max_turns", "3"]).config
    layout = lay_out(cfg, 2, 2).layout
    shapes, _ = read_shapes(cfg, layout)
    memory = plan_memory(cfg, layout, shapes, Target(False, 0, "--device cpu"))
    assert [r.host["gateway"] for r in memory.ranks] == [2 * (3 * 80 * 36 + 16 * 68)] * 2
    per_turn = parse_args([*flags, "--env_id", "chars_taskset", "--max_tokens_per_turn", "5"]).config  # 4 calls
    assert plan_memory(per_turn, layout, shapes, Target(False, 0, "")).ranks[0].host["gateway"] == \
        2 * (4 * 80 * 36 + 16 * 68)
    plain = parse_args([*flags, "--remote_rm_url", "demo"]).config
    assert all("gateway" not in r.host for r in plan_memory(plain, layout, shapes, Target(False, 0, "")).ranks)


@pytest.mark.parametrize(("actors", "engines"), [(4, 4), (6, 2)])
def test_the_plan_counts_weight_syncs_buffers_from_many_senders_within_5_percent(tmp_path, actors, engines):
    """Llama-2-7B's shapes (untied 500 MiB embedding and head, bf16 on the wire, 256 MiB buckets), native engines on
    ranks of their own, --weight_sync_delta: the plan's sync bytes per rank against the buffers rlrun.weight_sync.senders
    allocates for the same parameters (its own bucket and stripe plan over FSDP2's dim-0 shards): each actor rank's
    two stripe buffers plus its shard's last sync, each engine rank's two receive buffers."""
    from rlrun.engines.receivers import pack_buckets
    from rlrun.strategies.blocks import dim0_spans
    from rlrun.weight_sync.senders import plan_stripes, receive_staging, stripe_buffers

    model = _model_dir(tmp_path / "model", LLAMA_2_7B)
    cfg = parse_args(["--pretrain", str(model), "--generation_backend", "native", "--bf16", "--weight_sync_delta",
                      "--actor_num_gpus_per_node", str(actors), "--vllm_num_engines", str(engines),
                      "--remote_rm_url", "demo", "--init_kl_coef", "0", "--rollout_batch_size", "96",
                      "--train_batch_size", "96", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2"]).config
    layout = lay_out(cfg, actors + engines, actors + engines).layout
    shapes, _ = read_shapes(cfg, layout)
    memory = plan_memory(cfg, layout, shapes, GPU_80)
    actor_ranks = layout.ranks_of(Role.ACTOR)
    assert len(actor_ranks) == actors and len(layout.ranks_of(Role.ENGINE)) == engines
    with torch.device("meta"):
        params = list(AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model)).named_parameters())
    buckets = pack_buckets([(n, p.shape, torch.bfloat16) for n, p in params], 256 * 2**20)
    stripes = plan_stripes(buckets, {n: list(dim0_spans(p.shape, actor_ranks)) for n, p in params}, actor_ranks)
    for rank in actor_ranks:
        shard = sum(end - begin for n, p in params for r, begin, end in dim0_spans(p.shape, actor_ranks) if r == rank)
        measured = 2 * (sum(stripe_buffers(stripes, rank)) + shard)
        assert memory.ranks[rank].gpu["sync"] == pytest.approx(measured, rel=0.05), rank
    for rank in layout.ranks_of(Role.ENGINE):
        received = 2 * min(2, len(buckets)) * receive_staging(stripes)  # two receive buffers
        assert memory.ranks[rank].gpu["sync"] == pytest.approx(received, rel=0.05), rank
