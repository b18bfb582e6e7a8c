"""GRPO on a vision-language policy end to end: a tiny Qwen2.5-VL saved as save_pretrained lays it out, a generated
image task whose answer only the picture gives (red: write digits, blue: letters; the prompt text is the same for
every record), OpenRLHF-M's data layout and flags. The reward rises when the model sees the pictures and stays at
chance when they are blank (so it really reads the image); the vision tower stays as it was under
--freeze_visual_encoder; the export loads as the VLM it is. Disaggregated (engine on its own rank, verl's parquet
layout, packed rows): the images reach the learner and an interrupted run resumes exactly."""

from __future__ import annotations

import shutil

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_rlrun, subprocess_env, untimed
from rlrun.checkpoint import store
from rlrun.vision.demo import write_colour_task
from rlrun.vision.demo import save_tiny_vl

GRPO = ["--advantage_estimator", "group_norm", "--init_kl_coef", "0", "--remote_rm_url", "demo",
        "--rollout_batch_size", "16", "--n_samples_per_prompt", "4", "--micro_rollout_batch_size", "16",
        "--train_batch_size", "32", "--micro_train_batch_size", "8", "--actor_learning_rate", "0.01",
        "--lr_warmup_ratio", "0", "--prompt_max_len", "64", "--generate_max_len", "16", "--num_episodes", "50"]


@pytest.fixture(scope="module")
def task(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("vlm")
    return {"model": save_tiny_vl(root / "model", seed=1),
            "blank": write_colour_task(str(root / "blank"), records=32, blank=True),
            "verl": write_colour_task(str(root / "verl"), records=32, layout="verl")}


def _rewards(metrics: list[dict]) -> list[float]:
    return [m["reward"] for m in metrics]


def _tail(values: list[float], n: int = 5) -> float:
    return sum(values[-n:]) / n


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_vlm_demo_learns_what_only_the_image_says_and_not_from_blank_images(task, tmp_path):
    """configs/vlm_demo.yaml as docs/features.md runs it (--model_preset tiny-vl: model and data built into RLRUN_CACHE), with
    --freeze_visual_encoder; then the same model on the same task with blank pictures."""
    env = subprocess_env(RLRUN_CACHE=str(tmp_path / "cache"))
    seen = run_rlrun(0, ["--config", "configs/vlm_demo.yaml", "--freeze_visual_encoder"], tmp_path / "seen",
                     timeout=300, env=env)
    assert seen.returncode == 0, seen.output[-3000:]
    assert "generation backend hf (auto: the native engine cannot run this policy ('qwen2_5_vl' is a vision-language" \
           in seen.output
    assert "read whole" not in seen.output  # hub-format names read through transformers' renamings, a slice a time
    model = next((tmp_path / "cache").glob("tiny-vl-v*/model-seed42"))
    blank = run_rlrun(0, ["--config", "configs/vlm_demo.yaml", "--pretrain", str(model), "--prompt_data",
                          task["blank"]], tmp_path / "blank", timeout=300, env=env)
    assert blank.returncode == 0, blank.output[-3000:]
    with_images, without = _rewards(seen.metrics), _rewards(blank.metrics)
    assert with_images[0] < 0.3 and _tail(with_images) > 0.85, with_images
    # Blank pictures: half the prompts want digits, half letters, nothing tells them apart: ~0.5 at best.
    assert _tail(without) < 0.65 and _tail(with_images) - _tail(without) > 0.25, (with_images, without)

    # --freeze_visual_encoder: the vision tower and its projector are as saved; the language model trained.
    from transformers import AutoImageProcessor, AutoModelForImageTextToText

    before = AutoModelForImageTextToText.from_pretrained(model).state_dict()
    exported = AutoModelForImageTextToText.from_pretrained(tmp_path / "seen")  # the export loads as the VLM
    after = exported.state_dict()
    visual = [k for k in before if k.startswith("model.visual.")]
    assert visual and all(torch.equal(before[k], after[k]) for k in visual)
    assert not torch.equal(before["lm_head.weight"], after["lm_head.weight"])
    assert AutoImageProcessor.from_pretrained(tmp_path / "seen").merge_size == 2  # saved beside the weights


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_disaggregated_packed_verl_layout_resumes_exactly(task, tmp_path):
    """Engine on rank 1, actor and reference on rank 0: the images cross to them with the rows (packed there, 3-D
    positions per sequence); a run resumed from its step-3 checkpoint reproduces steps 4-6 bit for bit."""
    args = ["--pretrain", task["model"], "--prompt_data", task["verl"], "--input_key", "prompt",
            "--label_key", "reward_model.ground_truth", "--vllm_num_engines", "1", "--actor_num_gpus_per_node", "1",
            "--packing_samples", "--max_steps", "6", "--save_steps", "3", *GRPO,
            "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "0.001",  # OpenRLHF-M's: a reference scores too
            "--eval_dataset", task["verl"], "--eval_steps", "3", "--save_hf_ckpt"]
    full = run_rlrun(2, args + ["--ckpt_path", str(tmp_path / "a" / "ckpt")], tmp_path / "a", timeout=300)
    assert full.returncode == 0, full.output[-3000:]
    steps = [m for m in full.metrics if "reward" in m]
    assert [m["step"] for m in steps] == list(range(1, 7))
    assert steps[-1]["kl"] > 0  # the reference scored the rows with their images
    assert [m["step"] for m in full.metrics if "eval/reward" in m] == [3, 6]  # evaluation samples with the images
    hf = tmp_path / "a" / "ckpt" / "step_00000003" / "hf"  # --save_hf_ckpt: the whole VLM, image processor included
    assert (hf / "model.safetensors").exists() and (hf / "preprocessor_config.json").exists()
    ckpt = tmp_path / "b" / "ckpt"
    shutil.copytree(store.step_dir(str(tmp_path / "a" / "ckpt"), 3), store.step_dir(str(ckpt), 3))
    resumed = run_rlrun(2, args + ["--ckpt_path", str(ckpt), "--load_checkpoint"], tmp_path / "b", timeout=300)
    assert resumed.returncode == 0, resumed.output[-3000:]
    assert untimed(resumed.metrics) == untimed(full.metrics[full.metrics.index(steps[3]):])
    a, b = load_file(tmp_path / "a" / "model.safetensors"), load_file(tmp_path / "b" / "model.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
