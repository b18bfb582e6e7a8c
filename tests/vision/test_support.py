"""What a vision-language run accepts before launch: OpenRLHF-M's MathV60K GRPO command line as its users run it
(classic flags, verbatim but for paths) parses and passes the VLM checks; each combination rlrun does not run with a
VLM yet is one error naming it."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from rlrun.cli.parser import parse_args
from rlrun.runtime.errors import ConfigError
from rlrun.plan.generation import check_vision_run, vision_run_problem
from rlrun.vision.demo import save_tiny_vl

# the-laughing-monkey/OpenRLHF-M examples/scripts/tests/train_grpo_ray_qwen2_5_vl_mathv60k.sh, plus lmm-r1's
# --label_key answer and OpenRLHF-M's --freeze_prefix/--min_pixels/--max_pixels
OPENRLHF_M_GRPO = (
    "--ref_num_nodes 1 --ref_num_gpus_per_node 4 --remote_rm_url http://127.0.0.1:5000/get_reward "
    "--actor_num_nodes 1 --actor_num_gpus_per_node 4 --vllm_num_engines 4 --vllm_tensor_parallel_size 1 "
    "--colocate_all_models --vllm_enable_sleep --vllm_gpu_memory_utilization 0.5 --vllm_sync_backend gloo "
    "--enable_prefix_caching --pretrain {model} --save_path out --micro_train_batch_size 1 --train_batch_size 128 "
    "--micro_rollout_batch_size 1 --rollout_batch_size 128 --temperature 1.0 --n_samples_per_prompt 4 --max_epochs 1 "
    "--num_episodes 2 --prompt_max_len 4096 --max_samples 1000 --generate_max_len 8000 --advantage_estimator group_norm "
    "--use_kl_loss --kl_estimator k3 --init_kl_coef 1e-3 --zero_stage 3 --bf16 --actor_learning_rate 5e-7 "
    "--prompt_data mathv60k_message.jsonl --input_key message --label_key answer --normalize_reward --flash_attn "
    "--lambd 1 --gamma 1 --gradient_checkpointing --save_steps 5 --ckpt_path ckpt --save_hf_ckpt --load_checkpoint "
    "--use_tensorboard logs --freeze_prefix visual --min_pixels 3136 --max_pixels 501760"
)


@pytest.fixture(scope="module")
def model(tmp_path_factory) -> str:
    return save_tiny_vl(tmp_path_factory.mktemp("vl"), seed=0)


def test_openrlhf_m_grpo_command_line_parses_and_passes(model):
    cfg = parse_args(shlex.split(OPENRLHF_M_GRPO.format(model=model))).config
    assert (cfg.data.input_key, cfg.data.label_key) == ("message", "answer")
    assert cfg.vision.freeze_prefix == ("visual",) and (cfg.vision.min_pixels, cfg.vision.max_pixels) == (3136, 501760)
    assert vision_run_problem(cfg) is None
    dotted = parse_args(["--actor.freeze_visual_encoder", "--data.image_key", "pictures", "--data.max_images_per_prompt",
                         "2", "--pretrain", model, "--remote_rm_url", "demo"]).config  # OpenRLHF 0.11's spellings
    assert dotted.vision.freeze_visual_encoder and dotted.vision.image_key == "pictures"
    assert dotted.vision.max_images_per_prompt == 2
    verl = parse_args([f"actor_rollout_ref.model.path={model}", "data.image_key=imgs",
                       "actor_rollout_ref.actor.freeze_vision_tower=True", "--remote_rm_url", "demo"]).config
    assert verl.vision.image_key == "imgs" and verl.vision.freeze_visual_encoder


@pytest.mark.parametrize("flags, named", [
    (["--advantage_estimator", "gae"], "a critic"),
    (["--lora_rank", "8"], "--lora_rank"),
    (["--async_train", "--partial_rollout", "--vllm_num_engines", "1"], "--partial_rollout"),
    (["--generation_backend", "vllm", "--vllm_tensor_parallel_size", "2"], "tensor-parallel vLLM engines"),
    (["--reward_pretrain", "rm", "--remote_rm_url", ""], "--reward_pretrain"),
])
def test_what_a_vlm_run_does_not_do_yet_is_refused_by_name(model, flags, named):
    cfg = parse_args(["--pretrain", model, "--remote_rm_url", "demo", "--advantage_estimator", "group_norm",
                      *flags]).config
    if "--reward_pretrain" in flags:  # a reward model scores (no reward function)
        cfg = dataclasses.replace(cfg, reward=dataclasses.replace(cfg.reward, remote_rm_url=None))
    with pytest.raises(ConfigError, match=rf"is a vision-language model, and rlrun does not yet run it with {named}"):
        check_vision_run(cfg)
