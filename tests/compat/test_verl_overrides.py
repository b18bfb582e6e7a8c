"""verl / Search-R1 Hydra overrides (`python -m rlrun.ppo data.train_batch_size=512 ...`) land on rlrun's fields
with verl's meaning; keys rlrun has no use for are reported; unknown keys fail with a suggestion."""

from __future__ import annotations

import json

import shlex

from pathlib import Path

import pytest

from helpers import run_rlrun, subprocess_env
from rlrun.cli.parser import IGNORED_FLAGS, parse_args
from rlrun.compat.verl_keys import BY_PROVENANCE, VERL_KEYS, GroupInput, To
from rlrun.compat.verl_overrides import parse_value, translate
from rlrun.config.fields import fields_of
from rlrun.config.tree import Config
from rlrun.runtime.errors import ConfigError

FIELDS = fields_of(Config)
PENDING = {"eval_dataset", "eval_steps", "eval_temperature", "eval_n_samples_per_prompt", "eval_before_train",
           "packing_samples", "eps_clip_low_high"}


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    """parse_args reads the launched world size; tests run as a world of one unless they say otherwise."""
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def cfg_of(*argv: str) -> Config:
    return parse_args(list(argv)).config


def test_every_target_is_a_field_a_classic_ignored_flag_or_pending():
    targets = {m.field for m in VERL_KEYS.values() if isinstance(m, To)}
    assert not targets - set(FIELDS) - set(IGNORED_FLAGS) - PENDING


# (override, section, field, expected) -- one key at a time, values chosen to differ from rlrun's defaults.
SIMPLE = [
    ("data.train_files=/d/train.parquet", "data", "prompt_data", "/d/train.parquet"),
    ("data.train_files=[/d/train.parquet]", "data", "prompt_data", "/d/train.parquet"),
    ("data.prompt_key=question", "data", "input_key", "question"),
    ("data.train_batch_size=512", "train", "rollout_batch_size", 512),
    ("data.max_prompt_length=4096", "generation", "prompt_max_len", 4096),
    ("data.max_response_length=500", "generation", "generate_max_len", 500),
    ("data.filter_overlong_prompts=True", "generation", "prompt_overflow", "drop"),
    ("data.max_obs_length=300", "agent", "max_obs_len", 300),
    ("retriever.url=http://h:8000/retrieve", "agent", "retriever_url", "http://h:8000/retrieve"),
    ("retriever.topk=5", "agent", "retriever_topk", 5),
    ("actor_rollout_ref.actor.state_masking=false", "agent", "state_masking", False),
    ("data.train_data_num=1000", "train", "max_samples", 1000),
    ("actor_rollout_ref.model.path=/models/qwen", "model", "pretrain", "/models/qwen"),
    ("actor_rollout_ref.model.enable_gradient_checkpointing=true", "model", "gradient_checkpointing", True),
    ("actor_rollout_ref.nccl_timeout=600", "runtime", "dist_timeout", 600.0),
    ("critic.model.path=/models/critic", "critic", "critic_pretrain", "/models/critic"),
    ("actor_rollout_ref.actor.optim.lr=1e-6", "train", "actor_learning_rate", 1e-6),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285", "train", "lr_warmup_ratio", 0.285),
    ("actor_rollout_ref.actor.optim.weight_decay=0.01", "train", "l2", 0.01),
    ("actor_rollout_ref.actor.optim.betas=[0.9,0.999]", "train", "adam_betas", (0.9, 0.999)),
    ("actor_rollout_ref.actor.grad_clip=0.5", "train", "max_norm", 0.5),
    ("actor_rollout_ref.actor.ppo_epochs=2", "train", "max_epochs", 2),
    ("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16", "train", "micro_train_batch_size", 16),
    ("actor_rollout_ref.actor.clip_ratio_c=3.0", "algo", "dual_clip", 3.0),
    ("actor_rollout_ref.actor.entropy_coeff=0.001", "algo", "entropy_loss_coef", 0.001),
    ("actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-mean", "algo", "loss_agg_mode", "seq-mean-token-mean"),
    ("actor_rollout_ref.rollout.name=hf", "generation", "generation_backend", "hf"),
    ("actor_rollout_ref.rollout.name=vllm", "generation", "generation_backend", "vllm"),
    ("actor_rollout_ref.rollout.temperature=0.7", "generation", "temperature", 0.7),
    ("actor_rollout_ref.rollout.top_p=0.95", "generation", "top_p", 0.95),
    ("actor_rollout_ref.rollout.tensor_model_parallel_size=2", "resources", "vllm_tensor_parallel_size", 2),
    ("actor_rollout_ref.rollout.gpu_memory_utilization=0.6", "generation", "vllm_gpu_memory_utilization", 0.6),
    ("actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32", "train", "micro_rollout_batch_size", 32),
    ("critic.optim.lr=1e-5", "critic", "critic_learning_rate", 1e-5),
    ("critic.cliprange_value=0.2", "critic", "value_clip", 0.2),
    ("algorithm.gamma=0.99", "algo", "gamma", 0.99),
    ("algorithm.lam=0.95", "algo", "lambd", 0.95),
    ("trainer.total_epochs=15", "train", "num_episodes", 15),
    ("trainer.total_training_steps=1005", "train", "max_steps", 1005),
    ("trainer.save_freq=100", "checkpoint", "save_steps", 100),
    ("trainer.default_local_dir=/ckpt/run", "checkpoint", "ckpt_path", "/ckpt/run"),
    ("trainer.resume_mode=auto", "checkpoint", "load_checkpoint", True),
    ("trainer.max_actor_ckpt_to_keep=5", "checkpoint", "max_ckpt_num", 5),
    ("trainer.project_name=Search-R1", "logging", "wandb_project", "Search-R1"),
    ("trainer.experiment_name=nq-ppo", "logging", "wandb_run_name", "nq-ppo"),
    ("trainer.test_freq=50", "logging", "eval_steps", 50),
]


@pytest.mark.parametrize("override, section, field, expected", SIMPLE, ids=[s[0].split("=")[0] for s in SIMPLE])
def test_key_lands_on_its_field(override, section, field, expected):
    parsed = parse_args([override])
    value = getattr(getattr(parsed.config, section), field)
    assert value == expected and type(value) is type(expected)
    assert parsed.explicit == {field}


def test_hydra_values():
    assert parse_value("null") is None and parse_value("True") is True and parse_value("512") == 512
    assert parse_value("['console','wandb']") == ["console", "wandb"]
    assert parse_value('["console","wandb"]') == ["console", "wandb"]
    assert parse_value("[console,wandb]") == ["console", "wandb"]  # bash ate the quotes of ['console','wandb']
    assert parse_value("http://127.0.0.1:8000/retrieve") == "http://127.0.0.1:8000/retrieve"
    assert parse_value("a: {b") == "a: {b"  # not YAML: kept as text


@pytest.mark.parametrize("value, wandb, tensorboard", [
    ("['console','wandb']", "", None),
    ('["console","wandb"]', "", None),
    ("[console,wandb]", "", None),
    ("[wandb]", "", None),
    ("console", None, None),
    ("[console,tensorboard]", None, "tensorboard_log"),
])
def test_logger_list(value, wandb, tensorboard, monkeypatch):
    monkeypatch.delenv("TENSORBOARD_DIR", raising=False)
    cfg = cfg_of(f"trainer.logger={value}")
    assert cfg.logging.use_wandb == wandb and cfg.logging.use_tensorboard == tensorboard


def test_logger_without_wandb_turns_an_earlier_use_wandb_off():
    assert cfg_of("--use_wandb", "KEY", "trainer.logger=[console]").logging.use_wandb is None
    assert cfg_of("trainer.logger=[console]", "--use_wandb", "KEY").logging.use_wandb == "KEY"
    with pytest.raises(ConfigError, match="not mlflow"):
        cfg_of("trainer.logger=[console,mlflow]")


def test_mini_batch_counts_prompts():
    # verl: ppo_mini_batch_size prompts x rollout.n responses = 256 x 5 = 1280 sequences per optimizer step.
    cfg = cfg_of("actor_rollout_ref.actor.ppo_mini_batch_size=256", "actor_rollout_ref.rollout.n=5")
    assert (cfg.train.train_batch_size, cfg.train.n_samples_per_prompt) == (1280, 5)
    # The order of the two keys does not matter.
    cfg = cfg_of("actor_rollout_ref.rollout.n=5", "actor_rollout_ref.actor.ppo_mini_batch_size=256")
    assert (cfg.train.train_batch_size, cfg.train.n_samples_per_prompt) == (1280, 5)
    assert cfg_of("actor_rollout_ref.actor.ppo_mini_batch_size=256").train.train_batch_size == 256  # n defaults to 1


def test_search_r1_n_agent_repeats_prompts_but_not_the_mini_batch():
    # Search-R1 repeats the batch n_agent times before generation; its mini batch is scaled by rollout.n only.
    cfg = cfg_of("actor_rollout_ref.rollout.n_agent=5", "actor_rollout_ref.actor.ppo_mini_batch_size=256")
    assert (cfg.train.n_samples_per_prompt, cfg.train.train_batch_size) == (5, 256)
    cfg = cfg_of("actor_rollout_ref.rollout.n_agent=2", "actor_rollout_ref.rollout.n=3")
    assert cfg.train.n_samples_per_prompt == 6


def test_global_micro_batches_are_split_over_the_launched_ranks(monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", "8")
    cfg = cfg_of("actor_rollout_ref.actor.ppo_micro_batch_size=64", "actor_rollout_ref.rollout.log_prob_micro_batch_size=128")
    assert (cfg.train.micro_train_batch_size, cfg.train.micro_rollout_batch_size) == (8, 16)
    with pytest.raises(ConfigError, match=r"ppo_micro_batch_size=12 is a global micro batch size; .* 8 launched ranks"):
        cfg_of("actor_rollout_ref.actor.ppo_micro_batch_size=12")


@pytest.mark.parametrize("overrides, use_kl_loss, coef, estimator", [
    # verl: KL only where asked for; both off -> none at all.
    (["actor_rollout_ref.actor.use_kl_loss=False", "algorithm.use_kl_in_reward=False"], False, 0.0, "k1"),
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.002",
      "actor_rollout_ref.actor.kl_loss_type=low_var_kl"], True, 0.002, "k3"),
    (["actor_rollout_ref.actor.use_kl_loss=True"], True, 0.001, "k3"),  # verl's defaults: 0.001, low_var_kl
    (["actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=mse"], True, 0.001, "k2"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.kl_coef=0.005"], False, 0.005, "k1"),
    (["algorithm.use_kl_in_reward=True", "algorithm.kl_penalty=low_var_kl"], False, 0.001, "k3"),
    # Search-R1's verl: no use_kl_in_reward key, kl_coef goes into the reward unless use_kl_loss.
    (["algorithm.kl_ctrl.kl_coef=0.001"], False, 0.001, "k1"),
])
def test_kl(overrides, use_kl_loss, coef, estimator):
    cfg = cfg_of(*overrides)
    assert (cfg.algo.use_kl_loss, cfg.algo.init_kl_coef, cfg.algo.kl_estimator) == (use_kl_loss, coef, estimator)


def test_kl_adaptive_and_conflicts():
    cfg = cfg_of("algorithm.use_kl_in_reward=True", "algorithm.kl_ctrl.type=adaptive",
                 "algorithm.kl_ctrl.target_kl=0.05", "algorithm.kl_ctrl.horizon=500")
    assert (cfg.algo.kl_target, cfg.algo.kl_horizon) == (0.05, 500)
    with pytest.raises(ConfigError, match="either in the loss or in the reward"):
        cfg_of("actor_rollout_ref.actor.use_kl_loss=True", "algorithm.use_kl_in_reward=True")
    with pytest.raises(ConfigError, match="kl_loss_type=abs: rlrun's KL estimators"):
        cfg_of("actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_type=abs")


@pytest.mark.parametrize("verl, rlrun", [
    ("gae", "gae"), ("grpo", "group_norm"), ("reinforce_plus_plus", "reinforce"),
    ("reinforce_plus_plus_baseline", "reinforce_baseline"), ("rloo", "rloo")])
def test_estimators(verl, rlrun):
    assert cfg_of(f"algorithm.adv_estimator={verl}").algo.advantage_estimator == rlrun


def test_grpo_without_std_is_dr_grpo_and_unknown_estimators_fail():
    assert cfg_of("algorithm.adv_estimator=grpo", "algorithm.norm_adv_by_std_in_grpo=False").algo.advantage_estimator == "dr_grpo"
    with pytest.raises(ConfigError, match="algorithm.adv_estimator=remax: rlrun implements gae, grpo"):
        cfg_of("algorithm.adv_estimator=remax")


def test_reward_model_only_when_enabled():
    assert cfg_of("reward_model.model.path=/rm").reward.reward_pretrain is None
    assert cfg_of("reward_model.enable=True", "reward_model.model.path=/rm").reward.reward_pretrain == "/rm"


def test_clip_ratios():
    cfg = cfg_of("actor_rollout_ref.actor.clip_ratio=0.3")
    assert cfg.algo.eps_clip == 0.3
    if "eps_clip_low_high" in FIELDS:
        cfg = cfg_of("actor_rollout_ref.actor.clip_ratio_low=0.2", "actor_rollout_ref.actor.clip_ratio_high=0.28")
        assert cfg.algo.eps_clip_low_high == (0.2, 0.28)
        # verl: an unset bound falls back to clip_ratio.
        assert cfg_of("actor_rollout_ref.actor.clip_ratio=0.1",
                      "actor_rollout_ref.actor.clip_ratio_high=0.3").algo.eps_clip_low_high == (0.1, 0.3)


A, REF = "actor_rollout_ref.actor.", "actor_rollout_ref.ref."


@pytest.mark.parametrize("overrides, actor, ref, critic", [
    # verl's remax example (examples/remax_trainer/run_qwen2.5_math_7b_sync_fsdp.sh): the actor's deprecated key;
    # the reference follows it (oc.select), the critic keeps verl's default 1
    ([A + "ulysses_sequence_parallel_size=2"], 2, None, 1),
    ([A + "fsdp_config.ulysses_sequence_parallel_size=4"], 4, None, 1),
    # the deprecated key wins only when > 1 (verl's ActorConfig.__post_init__)
    ([A + "ulysses_sequence_parallel_size=1", A + "fsdp_config.ulysses_sequence_parallel_size=2"], 2, None, 1),
    ([A + "ulysses_sequence_parallel_size=4", REF + "ulysses_sequence_parallel_size=1"], 4, 1, 1),
    ([A + "ulysses_sequence_parallel_size=2", REF + "fsdp_config.ulysses_sequence_parallel_size=4"], 2, 4, 1),
    # verl's ascend PPO example: actor and critic both 2
    ([A + "ulysses_sequence_parallel_size=2", "critic.ulysses_sequence_parallel_size=2"], 2, None, 2),
    (["critic.fsdp.ulysses_sequence_parallel_size=4"], 1, None, 4),
])
def test_ulysses_sizes_follow_verl(overrides, actor, ref, critic):
    cfg = cfg_of(*overrides)
    assert cfg.train.sequence_parallel_size == actor
    assert cfg.resources.ref_sequence_parallel_size == ref
    assert cfg.resources.critic_sequence_parallel_size == critic


def test_null_keeps_rlrun_default_where_a_value_is_needed():
    assert cfg_of("data.train_data_num=null") == Config()
    assert cfg_of("--max_steps", "3", "trainer.total_training_steps=null").train.max_steps is None


def test_skipped_keys_are_reported():
    parsed = parse_args(["algorithm.state_masking.start_state_marker=<information>",
                         "actor_rollout_ref.actor.fsdp_config.param_offload=true",
                         "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                         "+actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache=True",
                         "trainer.n_gpus_per_node=8", "trainer.nnodes=1", "critic.ppo_micro_batch_size_per_gpu=8"])
    assert parsed.config == Config() and parsed.explicit == frozenset()
    keys = [line.split(":")[0] for line in parsed.ignored]
    assert keys == ["algorithm.state_masking.start_state_marker", "actor_rollout_ref.actor.fsdp_config.param_offload",
                    "actor_rollout_ref.actor.megatron.tensor_model_parallel_size",
                    "actor_rollout_ref.rollout.engine_kwargs.vllm.disable_mm_preprocessor_cache",
                    "trainer.n_gpus_per_node", "trainer.nnodes", "critic.ppo_micro_batch_size_per_gpu"]
    assert parsed.ignored[0] == f"algorithm.state_masking.start_state_marker: ignored ({BY_PROVENANCE})"
    assert parsed.ignored[4] == "trainer.n_gpus_per_node: ignored (torchrun/srun set the world size; this run has 1 rank(s))"


@pytest.mark.parametrize("token, message", [
    ("data.train_bach_size=4", "unknown verl key 'data.train_bach_size'; did you mean 'data.train_batch_size'?"),
    ("actor_rollout_ref.actor.optim.lrr=1e-6", "did you mean 'actor_rollout_ref.actor.optim.lr'?"),
    ("~trainer.logger", None),
    ("~trainer.logger=x", "rlrun has no key deletion"),
    ("trainer.resume_mode=resume_path", "use trainer.resume_mode=auto"),
    ("actor_rollout_ref.rollout.name=sglang", "rlrun generates with vllm or hf"),
    ("data.train_files=[]", "give one or more files"),
    ("data.train_batch_size=many", r"rollout_batch_size \(from data.train_batch_size\) must be an integer"),
    ("actor_rollout_ref.actor.ppo_mini_batch_size=many", "ppo_mini_batch_size must be an integer, got 'many'"),
])
def test_rejected(token, message):
    with pytest.raises(ConfigError, match=message or "unexpected argument"):
        parse_args([token])


def test_null_custom_reward_is_verl_default_not_an_error():
    assert parse_args(["custom_reward_function.path=null"]).config == Config()


def test_verl_data_brings_verl_defaults_below_everything_the_user_says():
    """data.train_files names verl's data: prompt column `prompt`, label reward_model.ground_truth, and verl's default
    per-data-source scorer, unless the command line or YAML names something else (issue 24)."""
    cfg = cfg_of("data.train_files=/d/train.parquet")
    assert (cfg.data.input_key, cfg.data.label_key, cfg.reward.compute_score) == ("prompt", "reward_model.ground_truth",
                                                                             "builtin")
    cfg = cfg_of("--label_key", "answer", "data.train_files=/d/t.parquet", "--remote_rm_url", "r.py")
    assert (cfg.data.label_key, cfg.reward.compute_score, cfg.reward.remote_rm_url) == ("answer", None, "r.py")
    cfg = cfg_of("data.train_files=/d/t.parquet", "custom_reward_function.path=/s.py", "custom_reward_function.name=f",
                 "data.reward_fn_key=source")
    assert (cfg.reward.compute_score, cfg.reward.compute_score_name, cfg.data.data_source_key) == ("/s.py", "f", "source")
    cfg = cfg_of("data.train_files=/d/t.parquet", "reward_model.enable=True", "reward_model.model.path=/rm")
    assert (cfg.reward.compute_score, cfg.reward.reward_pretrain) == (None, "/rm")  # the RM's score replaces the rules
    cfg = cfg_of("data.train_files=/d/t.parquet", "retriever.url=http://h/retrieve", "max_turns=2")
    assert cfg.reward.compute_score is None  # Search-R1: the agent's exact match is the reward
    assert cfg_of("data.apply_chat_template_kwargs={enable_thinking: false}").data.apply_chat_template_kwargs == {
        "enable_thinking": False}


def test_overrides_and_flags_later_wins():
    assert cfg_of("data.train_batch_size=8", "--rollout_batch_size", "16").train.rollout_batch_size == 16
    assert cfg_of("--rollout_batch_size", "16", "data.train_batch_size=8").train.rollout_batch_size == 8
    assert cfg_of("--rollout.batch_size", "16", "data.train_batch_size=8").train.rollout_batch_size == 8
    # A group is placed where its last key is.
    cfg = cfg_of("actor_rollout_ref.rollout.n=4", "--n_samples_per_prompt", "2", "actor_rollout_ref.actor.ppo_mini_batch_size=2")
    assert (cfg.train.n_samples_per_prompt, cfg.train.train_batch_size) == (4, 8)


def test_flag_values_are_never_read_as_overrides():
    cfg = cfg_of("--input_template", "Q=x {}", "--bf16", "data.train_batch_size=4", "--use_wandb", "trainer.nnodes=1")
    assert cfg.template.input_template == "Q=x {}" and cfg.model.bf16 is True
    assert cfg.train.rollout_batch_size == 4 and cfg.logging.use_wandb == ""


def test_translate_is_pure():
    arity = {"seed": 1}.get
    out = translate(["--seed", "a=b", "data.train_batch_size=3"], lambda n: arity(n, 0), FIELDS, IGNORED_FLAGS, 1)
    assert out.argv == ["--seed", "a=b", "--rollout_batch_size=3"] and out.ignored == []


def test_turn_lengths_plain_verl_and_search_r1():
    """verl: max_response_length is the response cap. Search-R1: per turn, with K search turns + 1 answer turn."""
    cfg = cfg_of("data.max_prompt_length=512", "data.max_response_length=100")
    assert (cfg.generation.prompt_max_len, cfg.generation.generate_max_len, cfg.agent.max_turns) == (512, 100, None)
    cfg = cfg_of("max_turns=4", "data.max_prompt_length=4096", "data.max_response_length=100",
                 "data.max_obs_length=50", "retriever.url=http://h/retrieve")
    assert (cfg.agent.max_turns, cfg.agent.max_tokens_per_turn, cfg.agent.max_obs_len) == (5, 100, 50)
    assert (cfg.generation.generate_max_len, cfg.generation.prompt_max_len) == (5 * 100 + 4 * 50, 4096)
    with pytest.raises(ConfigError, match="do_search=false"):
        cfg_of("max_turns=2", "do_search=false")


def test_every_group_member_is_listed():
    assert {m.group for m in VERL_KEYS.values() if isinstance(m, GroupInput)} == {"kl", "batch", "micro", "estimator",
                                                                            "data", "clip", "turns", "lora", "cov",
                                                                            "distill", "sp"}


# --- the seed scripts, as published -------------------------------------------------------------------------------

# volcengine/verl examples/ppo_trainer/run_deepseek7b_llm.sh
VERL_PPO = r"""
python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=gae \
    data.train_files=$HOME/data/gsm8k/train.parquet \
    data.val_files=$HOME/data/gsm8k/test.parquet \
    data.train_batch_size=1024 \
    data.max_prompt_length=512 \
    data.max_response_length=512 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=deepseek-ai/deepseek-llm-7b-chat \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=16 \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=False \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=32 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=4 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.4 \
    critic.optim.lr=1e-5 \
    critic.model.use_remove_padding=True \
    critic.model.path=deepseek-ai/deepseek-llm-7b-chat \
    critic.model.enable_gradient_checkpointing=True \
    critic.ppo_micro_batch_size_per_gpu=32 \
    critic.model.fsdp_config.param_offload=False \
    critic.model.fsdp_config.optimizer_offload=False \
    algorithm.use_kl_in_reward=False \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_example_gsm8k' \
    trainer.experiment_name='deepseek_llm_7b_function_rm' \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=20 \
    trainer.test_freq=1 \
    trainer.use_legacy_worker_impl=auto \
    trainer.total_epochs=15 $@
"""

# PeterGriffinJin/Search-R1 train_grpo.sh
SEARCH_R1_GRPO = r"""
PYTHONUNBUFFERED=1 python3 -m verl.trainer.main_ppo \
    data.train_files=$TRAIN_DATA_DIR/train.parquet \
    data.val_files=$TEST_DATA_DIR/test.parquet \
    data.train_data_num=null \
    data.val_data_num=null \
    data.train_batch_size=512 \
    data.val_batch_size=256 \
    data.max_prompt_length=4096 \
    data.max_response_length=500 \
    data.max_start_length=2048 \
    data.max_obs_length=500 \
    data.shuffle_train_dataloader=True \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.model.path=$BASE_MODEL \
    actor_rollout_ref.model.enable_gradient_checkpointing=true \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.optim.lr=1e-6 \
    actor_rollout_ref.actor.optim.lr_warmup_steps_ratio=0.285 \
    actor_rollout_ref.actor.use_kl_loss=true \
    actor_rollout_ref.actor.ppo_mini_batch_size=256 \
    actor_rollout_ref.actor.ppo_micro_batch_size=64 \
    actor_rollout_ref.actor.fsdp_config.param_offload=true \
    actor_rollout_ref.actor.fsdp_config.grad_offload=true \
    actor_rollout_ref.actor.fsdp_config.optimizer_offload=true \
    actor_rollout_ref.rollout.log_prob_micro_batch_size=128 \
    actor_rollout_ref.rollout.tensor_model_parallel_size=1 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.gpu_memory_utilization=0.6 \
    actor_rollout_ref.ref.log_prob_micro_batch_size=128 \
    actor_rollout_ref.ref.fsdp_config.param_offload=True \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=low_var_kl \
    algorithm.no_think_rl=false \
    actor_rollout_ref.rollout.n_agent=5 \
    actor_rollout_ref.rollout.temperature=1 \
    actor_rollout_ref.actor.state_masking=true \
    trainer.logger=['wandb'] \
    +trainer.val_only=false \
    +trainer.val_before_train=true \
    trainer.default_hdfs_dir=null \
    trainer.n_gpus_per_node=8 \
    trainer.nnodes=1 \
    trainer.save_freq=100 \
    trainer.test_freq=50 \
    trainer.project_name=$WAND_PROJECT \
    trainer.experiment_name=$EXPERIMENT_NAME \
    trainer.total_epochs=15 \
    trainer.total_training_steps=1005 \
    trainer.default_hdfs_dir=null \
    trainer.default_local_dir=verl_checkpoints/$EXPERIMENT_NAME \
    max_turns=2 \
    retriever.url="http://127.0.0.1:8000/retrieve" \
    retriever.topk=3 \
    2>&1 | tee $EXPERIMENT_NAME.log
"""

# PeterGriffinJin/Search-R1 train_ppo.sh: the lines that differ from train_grpo.sh.
SEARCH_R1_PPO_KEYS = ["algorithm.adv_estimator=gae", "critic.optim.lr=1e-5", "critic.model.use_remove_padding=True",
                      "critic.optim.lr_warmup_steps_ratio=0.015", "critic.model.path=$BASE_MODEL",
                      "critic.model.enable_gradient_checkpointing=true", "critic.ppo_micro_batch_size=8",
                      "critic.model.fsdp_config.param_offload=true", "critic.model.fsdp_config.grad_offload=true",
                      "critic.model.fsdp_config.optimizer_offload=true", "algorithm.kl_ctrl.kl_coef=0.001",
                      "trainer.critic_warmup=0", "actor_rollout_ref.rollout.n_agent=1"]


def _verl_argv(script: str, **env: str) -> list[str]:
    """The override tokens of a verl launch script as bash would pass them (variables expanded, quotes removed)."""
    text = script.replace("\\\n", " ")
    for name, value in sorted(env.items(), key=lambda kv: -len(kv[0])):
        text = text.replace(f"${name}", value)
    tokens = shlex.split(text)
    tokens = tokens[tokens.index("verl.trainer.main_ppo") + 1:]
    return [t for t in tokens[:tokens.index("2>&1")] if t != "$@"] if "2>&1" in tokens else [t for t in tokens if t != "$@"]


def test_verl_ppo_seed_script():
    parsed = parse_args(_verl_argv(VERL_PPO, HOME="/home/u"))
    cfg = parsed.config
    assert cfg.algo.advantage_estimator == "gae" and cfg.algo.needs_critic
    assert cfg.data.prompt_data == "/home/u/data/gsm8k/train.parquet"
    assert (cfg.train.rollout_batch_size, cfg.train.n_samples_per_prompt, cfg.train.train_batch_size) == (1024, 1, 256)
    assert (cfg.train.micro_train_batch_size, cfg.train.micro_rollout_batch_size) == (16, 32)
    assert (cfg.generation.prompt_max_len, cfg.generation.generate_max_len, cfg.generation.prompt_overflow) == (512, 512, "drop")
    assert cfg.model.pretrain == cfg.critic.critic_pretrain == "deepseek-ai/deepseek-llm-7b-chat"
    assert (cfg.train.actor_learning_rate, cfg.critic.critic_learning_rate) == (1e-6, 1e-5)
    assert cfg.model.gradient_checkpointing and cfg.generation.generation_backend == "vllm"
    assert cfg.resources.vllm_tensor_parallel_size == 4 and cfg.generation.vllm_gpu_memory_utilization == 0.4
    # verl with use_kl_loss=False and use_kl_in_reward=False: no KL, so no reference model.
    assert cfg.algo.init_kl_coef == 0.0 and not cfg.algo.use_kl_loss and not cfg.algo.needs_ref
    assert cfg.logging.use_wandb == "" and cfg.logging.wandb_project == "verl_example_gsm8k"
    assert cfg.logging.wandb_run_name == "deepseek_llm_7b_function_rm"
    assert (cfg.checkpoint.save_steps, cfg.train.num_episodes) == (20, 15)
    ignored = {line.split(":")[0] for line in parsed.ignored}
    assert {"data.truncation", "actor_rollout_ref.actor.fsdp_config.param_offload", "critic.ppo_micro_batch_size_per_gpu",
            "critic.model.enable_gradient_checkpointing", "trainer.n_gpus_per_node", "trainer.nnodes",
            "trainer.use_legacy_worker_impl"} <= ignored


@pytest.mark.parametrize("world", [1, 8])
def test_search_r1_grpo_seed_script(world, monkeypatch):
    monkeypatch.setenv("WORLD_SIZE", str(world))
    parsed = parse_args(_verl_argv(SEARCH_R1_GRPO, TRAIN_DATA_DIR="data/nq_search", TEST_DATA_DIR="data/nq_search",
                                   BASE_MODEL="Qwen/Qwen2.5-3B", WAND_PROJECT="Search-R1",
                                   EXPERIMENT_NAME="nq-search-r1-grpo-qwen2.5-3b-em"))
    cfg = parsed.config
    assert cfg.algo.advantage_estimator == "group_norm" and not cfg.algo.needs_critic
    assert cfg.algo.use_kl_loss and (cfg.algo.init_kl_coef, cfg.algo.kl_estimator) == (0.001, "k3")
    assert (cfg.train.rollout_batch_size, cfg.train.n_samples_per_prompt, cfg.train.train_batch_size) == (512, 5, 256)
    assert (cfg.train.micro_train_batch_size, cfg.train.micro_rollout_batch_size) == (64 // world, 128 // world)
    assert cfg.train.max_samples == Config().train.max_samples  # train_data_num=null
    assert (cfg.train.max_steps, cfg.train.num_episodes, cfg.train.lr_warmup_ratio) == (1005, 15, 0.285)
    assert cfg.checkpoint.ckpt_path == "verl_checkpoints/nq-search-r1-grpo-qwen2.5-3b-em"
    assert cfg.logging.use_wandb == "" and cfg.logging.wandb_project == "Search-R1"
    # Search-R1: max_turns=2 search turns + 1 answer turn of <= 500 tokens, 2 observations of <= 500.
    assert cfg.generation.temperature == 1.0
    assert (cfg.agent.max_turns, cfg.agent.max_tokens_per_turn, cfg.agent.max_obs_len) == (3, 500, 500)
    assert (cfg.generation.generate_max_len, cfg.generation.prompt_max_len) == (500 * 3 + 500 * 2, 2048)
    assert (cfg.agent.retriever_url, cfg.agent.retriever_topk) == ("http://127.0.0.1:8000/retrieve", 3)
    assert cfg.agent.state_masking and cfg.agent.multi_turn
    ignored = [line.split(":")[0] for line in parsed.ignored]
    assert len(ignored) == len(set(ignored))  # trainer.default_hdfs_dir appears twice, reported once
    assert {"algorithm.no_think_rl", "trainer.default_hdfs_dir",
            "actor_rollout_ref.ref.log_prob_micro_batch_size", "actor_rollout_ref.actor.fsdp_config.grad_offload"} <= set(ignored)


def test_search_r1_ppo_seed_script():
    argv = _verl_argv(SEARCH_R1_GRPO, BASE_MODEL="meta-llama/Llama-3.2-3B") + [
        t.replace("$BASE_MODEL", "meta-llama/Llama-3.2-3B") for t in SEARCH_R1_PPO_KEYS]
    argv = [t for t in argv if not t.startswith("actor_rollout_ref.actor.use_kl_loss")
            and not t.startswith("actor_rollout_ref.actor.kl_loss")]
    cfg = parse_args(argv).config
    assert cfg.algo.advantage_estimator == "gae" and cfg.critic.critic_pretrain == "meta-llama/Llama-3.2-3B"
    # Search-R1's verl puts kl_ctrl.kl_coef into the reward when use_kl_loss is off.
    assert not cfg.algo.use_kl_loss and (cfg.algo.init_kl_coef, cfg.algo.kl_estimator) == (0.001, "k1")
    assert cfg.train.n_samples_per_prompt == 1 and cfg.critic.critic_learning_rate == 1e-5


# --- end to end: the seed command lines, trimmed to the tiny model, local data and 2 steps ------------------------

TINY = ["data.train_files=examples/prompts.jsonl", "data.val_files=examples/prompts.jsonl", "data.prompt_key=question",
        "data.max_prompt_length=64", "data.max_response_length=8", "--remote_rm_url", "examples/reward.py",
        "--label_key", "answer"]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_verl_ppo_command_line_runs(tmp_path):
    argv = [t for t in _verl_argv(VERL_PPO, HOME="/nowhere") if not t.startswith(
        ("data.train_files", "data.val_files", "data.max_", "actor_rollout_ref.model.path", "critic.model.path"))]
    argv = [t.replace("tensor_model_parallel_size=4", "tensor_model_parallel_size=2")
             .replace("data.train_batch_size=1024", "data.train_batch_size=4")
             .replace("ppo_mini_batch_size=256", "ppo_mini_batch_size=2")
             .replace("ppo_micro_batch_size_per_gpu=16", "ppo_micro_batch_size_per_gpu=1")
             .replace("rollout.name=vllm", "rollout.name=hf") for t in argv]
    argv += TINY + ["trainer.total_training_steps=2", "trainer.save_freq=100", "trainer.test_freq=100",
                    "trainer.logger=[console]", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
    res = run_rlrun(2, argv, tmp_path / "out")
    assert res.returncode == 0, res.output[-3000:]
    assert [m["step"] for m in res.metrics] == [1, 2]
    assert "critic/value_loss" in res.metrics[-1]  # gae: the critic trained
    assert "trainer.nnodes: ignored (torchrun/srun set the world size; this run has 2 rank(s))" in res.output


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_search_r1_grpo_command_line_runs(tmp_path):
    """Search-R1's own train_grpo.sh keys, trimmed to the tiny model and the offline example written as Search-R1's
    nq_search parquet (message-list prompt, ground truth under reward_model.ground_truth.target: verl's defaults
    find both, no rlrun flag needed), against a live retriever: multi-turn episodes of max_turns + 1 turns (a
    random model never answers, so every episode runs all three, each invalid action answered by Search-R1's
    reminder)."""
    from peer_data import write_search_r1_nq
    from retriever_process import start_retriever, stop_retriever

    records = [json.loads(line) for line in Path("examples/search_r1/train.jsonl").read_text().splitlines() if line.strip()]
    parquet = write_search_r1_nq(tmp_path / "train.parquet", records)

    server = start_retriever(tmp_path)
    try:
        argv = [t for t in _verl_argv(SEARCH_R1_GRPO, EXPERIMENT_NAME="tiny", WAND_PROJECT="Search-R1") if not t.startswith(
            ("data.train_files", "data.val_files", "data.max_", "actor_rollout_ref.model.path", "trainer.logger",
             "+trainer.val_before_train", "trainer.default_local_dir", "retriever.url"))]
        argv = [t.replace("data.train_batch_size=512", "data.train_batch_size=4")
                 .replace("rollout.n_agent=5", "rollout.n_agent=2")
                 .replace("ppo_mini_batch_size=256", "ppo_mini_batch_size=8")
                 .replace("ppo_micro_batch_size=64", "ppo_micro_batch_size=4")
                 .replace("log_prob_micro_batch_size=128", "log_prob_micro_batch_size=4")
                 .replace("total_training_steps=1005", "total_training_steps=2")
                 .replace("rollout.name=vllm", "rollout.name=hf") for t in argv]
        argv += [f"data.train_files={parquet}", "data.max_prompt_length=4096", "data.max_start_length=512", "data.max_response_length=16",
                 "data.max_obs_length=64", f"retriever.url={server.url}", "trainer.logger=[console]",
                 "+trainer.val_before_train=false", f"trainer.default_local_dir={tmp_path / 'ckpt'}"]
        res = run_rlrun(2, argv, tmp_path / "out", env=subprocess_env())
    finally:
        stop_retriever(server.proc)
    assert res.returncode == 0, res.output[-3000:]
    assert [m["step"] for m in res.metrics] == [1, 2]
    assert "actor/kl_loss" in res.metrics[-1]  # use_kl_loss=true
    for m in res.metrics:
        assert m["agent/turns"] == 3.0 and m["agent/obs_truncated"] == 2.0, m  # 2 reminders cut to 64 tokens
        assert m["agent/observation_tokens"] == 128.0 and m["response_length"] <= 16 * 3 + 64 * 2, m
    assert "max_turns: ignored" not in res.output


def test_docs_list_every_verl_key():
    from pathlib import Path

    from rlrun.compat.verl_keys import SKIPPED_SUBTREES

    doc = (Path(__file__).resolve().parents[2] / "docs" / "compat.md").read_text()
    assert not [key for key in VERL_KEYS if f"| `{key}` |" not in doc]
    assert not [part for part in SKIPPED_SUBTREES if f"| any key with a `{part}` part |" not in doc]


def test_a_key_standing_for_a_refused_flag_is_refused_and_the_status_table_says_so():
    """trainer.critic_warmup is --freezing_actor_steps, which rlrun refuses (ignoring it would train the actor from
    step 1): refused under the verl spelling too, its off value accepted, and docs/compat.md's generated row agrees."""
    from compat_report import verl_rows

    with pytest.raises(ConfigError, match=r"^trainer.critic_warmup 5: freezing the actor"):
        parse_args(["trainer.critic_warmup=5", "--remote_rm_url", "demo"])
    parse_args(["trainer.critic_warmup=0", "--remote_rm_url", "demo"])
    rows = dict(verl_rows())
    for key in ("`trainer.critic_warmup`",):
        assert rows[key].startswith("refused at start-up"), (key, rows[key])


# --- verl's 2026 algorithm keys: policy losses, rollout correction, distillation ----------------------------------


def test_policy_loss_keys_set_the_loss_and_its_parameters() -> None:
    a = cfg_of("actor_rollout_ref.actor.policy_loss.loss_mode=vanilla").algo
    assert a.policy_loss_type == "ppo"
    a = cfg_of("actor_rollout_ref.actor.policy_loss.loss_mode=clip_cov", "actor_rollout_ref.actor.policy_loss.clip_cov_ub=4",
               "actor_rollout_ref.actor.policy_loss.clip_cov_ratio=0.001").algo
    assert (a.policy_loss_type, a.clip_cov_bounds, a.clip_cov_ratio) == ("clip_cov", (1.0, 4.0), 0.001)
    a = cfg_of("actor_rollout_ref.actor.policy_loss.loss_mode=kl_cov", "actor_rollout_ref.actor.policy_loss.ppo_kl_coef=0.5",
               "actor_rollout_ref.actor.tau_pos=2", "actor_rollout_ref.actor.policy_loss.dro_beta=0.1").algo
    assert (a.kl_cov_coef, a.sapo_tau_pos, a.dro_beta) == (0.5, 2.0, 0.1)
    for bad, named in (("bypass_mode", "algorithm.rollout_correction.bypass_mode=true"), ("clip-cov", "clip_cov")):
        with pytest.raises(ConfigError, match=named):
            cfg_of(f"actor_rollout_ref.actor.policy_loss.loss_mode={bad}")


def test_rollout_correction_keys_map_one_to_one() -> None:
    a = cfg_of("algorithm.rollout_correction.rollout_is=sequence", "algorithm.rollout_correction.rollout_is_threshold=0.5_5.0",
               "algorithm.rollout_correction.rollout_rs=['seq_mean_k1','seq_max_k3']",
               "algorithm.rollout_correction.rollout_rs_threshold=0.99_1.01,0.1",
               "algorithm.rollout_correction.bypass_mode=true", "algorithm.rollout_correction.loss_type=reinforce",
               "algorithm.rollout_correction.rollout_is_batch_normalize=true").correction
    assert (a.rollout_is, a.rollout_is_threshold, a.rollout_rs, a.rollout_rs_threshold) == (
        "sequence", "0.5_5.0", "seq_mean_k1,seq_max_k3", "0.99_1.01,0.1")
    assert a.rollout_bypass and a.rollout_bypass_loss == "reinforce" and a.rollout_is_batch_normalize
    assert cfg_of("algorithm.rollout_correction.rollout_is=null").correction.rollout_is == "off"  # verl's YAML default
    with pytest.raises(ConfigError, match="rollout_token_veto_threshold: verl removed it"):
        cfg_of("algorithm.rollout_correction.rollout_token_veto_threshold=1e-4")
    ignored = parse_args(["actor_rollout_ref.actor.policy_loss.rollout_correction.rollout_is=token"]).ignored
    assert any("verl writes the actor's copy from algorithm.rollout_correction" in line for line in ignored)


def test_distillation_keys_with_verls_defaults() -> None:
    teacher = "distillation.teacher_models.teacher_model.model_path=/models/teacher"
    cfg = cfg_of("distillation.enabled=true", teacher)  # verl's YAML: k3 as a loss (GKD), task rewards kept
    a = cfg.distill
    assert cfg.distill.teacher_pretrain == "/models/teacher"
    assert (a.teacher_kl_estimator, a.teacher_kl_loss, a.distill_task_reward, a.teacher_kl_coef) == ("k3", True, True, 1.0)
    cfg = cfg_of("distillation.enabled=true", teacher, "distillation.distillation_loss.loss_mode=k1",
                 "distillation.distillation_loss.use_policy_gradient=true",
                 "distillation.distillation_loss.use_task_rewards=false",
                 "distillation.distillation_loss.distillation_loss_coef=0.3",  # verl: used only with task rewards
                 "distillation.distillation_loss.loss_max_clamp=10", "distillation.n_gpus_per_node=2")
    a = cfg.distill
    assert (a.teacher_kl_estimator, a.teacher_kl_loss, a.distill_task_reward, a.teacher_kl_coef, a.teacher_kl_clamp) == (
        "k1", False, False, 1.0, 10.0)
    assert cfg.resources.teacher_num_gpus_per_node == 2
    assert cfg_of(teacher).distill.teacher_pretrain is None  # distillation.enabled is false by default
    with pytest.raises(ConfigError, match="k1's gradient does not involve the teacher"):
        cfg_of("distillation.enabled=true", teacher, "distillation.distillation_loss.loss_mode=kl")
    with pytest.raises(ConfigError, match="top-k forward-KL modes are not implemented"):
        cfg_of("distillation.enabled=true", teacher, "distillation.distillation_loss.loss_mode=forward_kl_topk")
    with pytest.raises(ConfigError, match="rlrun distils from one teacher"):
        cfg_of("distillation.teacher_models.math.model_path=/m")
    with pytest.raises(ConfigError, match="needs distillation.teacher_models.teacher_model.model_path"):
        cfg_of("distillation.enabled=true")
