"""Ulysses sequence parallelism end to end (torchrun, gloo, 4 ranks): GRPO with a KL loss (actor and reference both
sequence-parallel) on 2,048-token sequences (1,900-byte prompts of the demo task, 16-token responses, a 4-head
2-KV-head byte model). With the same seed and world, --sequence_parallel_size 2 (2 blocks of 2, KV heads split)
trains step for step like sp 1 on packed rows, learns, and resumed from its middle checkpoint ends bit for bit where
it did. Size 4 (KV heads repeated) is checked where it is cheaper: every rank's forward and gradients against the
unsplit model at sp 2 and 4 (tests/strategies/test_ulysses.py), and OpenRLHF's --ring_attn_size 4 spelling below."""

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



def test_openrlhfs_ring_flags_set_the_sequence_parallel_size_and_say_what_runs() -> None:
    from rlrun.cli.parser import parse_args
    from rlrun.plan.sequence_parallel import packed_for_sequence_parallel

    cfg = parse_args(["--ring_attn_size", "4", "--ring_head_stride", "2"]).config
    assert cfg.train.sequence_parallel_size == 4
    train, lines = packed_for_sequence_parallel(cfg.train, 4, flash_attn=False)
    assert train.packing_samples and "--ring_head_stride is not needed" in lines[0]


def test_sp_2_trains_like_sp_1_learns_and_resumes_exactly(long_task, tmp_path) -> None:
    plain = run_rlrun(4, [*long_task, "--packing_samples"], tmp_path / "sp1", timeout=300)
    assert plain.returncode == 0, plain.output[-3000:]
    split = run_rlrun(4, [*long_task, "--sequence_parallel_size", "2", "--save_steps", str(SAVE), "--ckpt_path",
                          str(tmp_path / "sp2" / "ckpt")], tmp_path / "sp2", timeout=300)
    assert split.returncode == 0, split.output[-3000:]
    assert "sequence parallelism 2: Ulysses" in split.output
    base = untimed(plain.metrics)
    assert len(base) == STEPS
    for want, got in zip(base, untimed(split.metrics), strict=True):
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
