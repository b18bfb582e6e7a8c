"""Ulysses sequence parallelism end to end (torchrun, gloo, 4 ranks): GRPO with a KL loss (actor and reference both
sequence-parallel) on 2,048-token sequences (1,900-byte prompts of the demo task, 16-token responses, a 4-head
2-KV-head byte model). With the same seed and world, --sequence_parallel_size 2 (2 blocks of 2, KV heads split) and
OpenRLHF's --ring_attn_size 4 (one block, KV heads repeated) train step for step like sp 1 on packed rows; the sp 2
run learns, and resumed from its middle checkpoint it ends bit for bit where it did."""

from __future__ import annotations

import json
import random
import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_rlrun, untimed
from rlrun.checkpoint import store as ckpt

STEPS, SAVE = 4, 2


@pytest.fixture(scope="module")
def long_task(tmp_path_factory) -> list[str]:
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    root = tmp_path_factory.mktemp("long_task")
    config = tiny_model_config()
    config.update({"max_position_embeddings": 4096, "num_attention_heads": 4, "num_key_value_heads": 2,
                   "head_dim": 16})
    build_causal_lm(config, seed=5).save_pretrained(root / "base")
    build_byte_tokenizer().save_pretrained(root / "base")
    rng = random.Random(0)
    words = "the of and a to in is was that for on as with by he at from his it an were are which this be".split()
    with open(root / "prompts.jsonl", "w") as f:
        for i in range(32):
            label = ("digits", "letters")[i % 2]
            filler = " ".join(rng.choice(words) for _ in range(600))[:1900]
            prompt = f"{filler}\nWrite only {label}: "
            assert 1900 < len(build_byte_tokenizer().encode(prompt)) <= 2032  # with the response, 2,048-token rows
            f.write(json.dumps({"prompt": prompt, "label": label}) + "\n")
    return ["--config", "configs/demo.yaml", "--pretrain", str(root / "base"), "--prompt_data",
            str(root / "prompts.jsonl"), "--input_key", "prompt", "--label_key", "label", "--remote_rm_url", "demo",
            "--prompt_max_len", "2032", "--generate_max_len", "16", "--rollout_batch_size", "4",
            "--n_samples_per_prompt", "4", "--train_batch_size", "16", "--micro_train_batch_size", "4",
            "--micro_rollout_batch_size", "4", "--use_kl_loss", "--init_kl_coef", "0.01", "--actor_learning_rate",
            "0.003", "--max_steps", str(STEPS), "--dist_timeout", "60"]



def test_sp_2_and_4_train_like_sp_1_learn_and_resume_exactly(long_task, tmp_path) -> None:
    plain = run_rlrun(4, [*long_task, "--packing_samples"], tmp_path / "sp1", timeout=300)
    assert plain.returncode == 0, plain.output[-3000:]
    split = run_rlrun(4, [*long_task, "--sequence_parallel_size", "2", "--save_steps", str(SAVE), "--ckpt_path",
                          str(tmp_path / "sp2" / "ckpt")], tmp_path / "sp2", timeout=300)
    assert split.returncode == 0, split.output[-3000:]
    assert "sequence parallelism 2: Ulysses" in split.output
    ring = run_rlrun(4, [*long_task, "--ring_attn_size", "4", "--ring_head_stride", "2"], tmp_path / "sp4", timeout=300)
    assert ring.returncode == 0, ring.output[-3000:]
    assert "--ring_head_stride" in ring.output and "not needed" in ring.output
    base = untimed(plain.metrics)
    assert len(base) == STEPS
    for run in (split, ring):
        for want, got in zip(base, untimed(run.metrics), strict=True):
            assert got.keys() == want.keys()
            for key in want.keys() - {"actor/padded_token_frac"}:  # rows are padded to a multiple of sp
                assert got[key] == pytest.approx(want[key], rel=1e-4, abs=1e-5), (key, want, got)
    rewards = [m["reward"] for m in split.metrics]
    assert sum(rewards[-2:]) / 2 > sum(rewards[:2]) / 2 + 0.03, rewards  # it learns the task behind the prompts

    # resumed from the step-2 checkpoint, the sp 2 run's last steps and final weights, bit for bit
    resumed = tmp_path / "resumed"
    (resumed / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(str(tmp_path / "sp2" / "ckpt"), SAVE), ckpt.step_dir(str(resumed / "ckpt"), SAVE))
    again = run_rlrun(4, [*long_task, "--sequence_parallel_size", "2", "--load_checkpoint", "--ckpt_path",
                          str(resumed / "ckpt")], resumed, timeout=300)
    assert again.returncode == 0, again.output[-3000:]
    assert [m["step"] for m in again.metrics] == list(range(SAVE + 1, STEPS + 1))
    assert untimed(again.metrics) == untimed(split.metrics)[SAVE:]
    a, b = load_file(resumed / "model.safetensors"), load_file(tmp_path / "sp2" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
