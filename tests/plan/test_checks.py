"""Tests for rlrun.plan.checks: every value check and batch-divisibility rule, and what its message names."""

from __future__ import annotations

import re

import pytest

from rlrun.cli.parser import parse_args
from rlrun.config.tree import Config
from rlrun.plan.checks import check_batches, check_values
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError


def cfg_of(*argv: str) -> Config:
    return parse_args(list(argv)).config


def assert_names(message: str, *parts: str) -> None:
    for part in parts:
        if re.fullmatch(r"-?[\d.e+-]+", part):  # a number: a whole token, not a digit inside another number
            assert re.search(rf"(?<![\w.]){re.escape(part)}(?![\w.])", message), (part, message)
        else:
            assert part in message, (part, message)


# (flags that break exactly one rule, parts the message must name: the flag and the value)
BAD_VALUES: list[tuple[list[str], list[str]]] = [
    (["--rollout_batch_size", "0"], ["--rollout_batch_size", "0"]),
    (["--rollout_batch_size", "-8"], ["--rollout_batch_size", "-8"]),
    (["--micro_rollout_batch_size", "0"], ["--micro_rollout_batch_size", "0"]),
    (["--train_batch_size", "-4"], ["--train_batch_size", "-4"]),
    (["--micro_train_batch_size", "0"], ["--micro_train_batch_size", "0"]),
    (["--n_samples_per_prompt", "0"], ["--n_samples_per_prompt", "0"]),
    (["--max_epochs", "0"], ["--max_epochs", "0"]),
    (["--num_episodes", "-1"], ["--num_episodes", "-1"]),
    (["--max_samples", "0"], ["--max_samples", "0"]),
    (["--max_steps", "0"], ["--max_steps", "0"]),
    (["--prompt_max_len", "0"], ["--prompt_max_len", "0"]),
    (["--generate_max_len", "-1"], ["--generate_max_len", "-1"]),
    (["--weight_sync_bucket_mb", "0"], ["--weight_sync_bucket_mb", "0"]),
    (["--actor_learning_rate=-1e-6"], ["--actor_learning_rate", "-1e-06"]),
    (["--critic_learning_rate", "-0.5"], ["--critic_learning_rate", "-0.5"]),
    (["--lr_warmup_ratio", "1.5"], ["--lr_warmup_ratio", "1.5"]),
    (["--lr_warmup_ratio", "-0.1"], ["--lr_warmup_ratio", "-0.1"]),
    (["--max_norm", "-1"], ["--max_norm", "-1.0"]),
    (["--l2", "-0.1"], ["--l2", "-0.1"]),
    (["--zero_stage", "4"], ["--zero_stage", "4"]),
    (["--zero_stage", "-1"], ["--zero_stage", "-1"]),
    (["--temperature", "0"], ["--temperature", "0.0"]),
    (["--temperature", "-1"], ["--temperature", "-1.0"]),
    (["--top_p", "0"], ["--top_p", "0.0"]),
    (["--top_p", "1.1"], ["--top_p", "1.1"]),
    (["--top_p", "-0.5"], ["--top_p", "-0.5"]),
    (["--is_correction_level", "token", "--generation_backend", "hf"], ["--is_correction_level token", "hf"]),
    (["--vllm_gpu_memory_utilization", "0"], ["--vllm_gpu_memory_utilization", "0.0"]),
    (["--vllm_gpu_memory_utilization", "1.5"], ["--vllm_gpu_memory_utilization", "1.5"]),
    (["--eps_clip", "0"], ["--eps_clip", "0.0"]),
    (["--eps_clip", "-0.2"], ["--eps_clip", "-0.2"]),
    (["--dual_clip", "1"], ["--dual_clip", "1.0"]),
    (["--dual_clip", "0.5"], ["--dual_clip", "0.5"]),
    (["--value_clip", "0"], ["--value_clip", "0.0"]),
    (["--value_clip", "-0.5"], ["--value_clip", "-0.5"]),
    (["--gamma", "1.1"], ["--gamma", "1.1"]),
    (["--lambd", "-0.1"], ["--lambd", "-0.1"]),
    (["--init_kl_coef", "-0.01"], ["--init_kl_coef", "-0.01"]),
    (["--kl_target", "0"], ["--kl_target", "0.0"]),
    (["--kl_target", "-1"], ["--kl_target", "-1.0"]),
    (["--kl_horizon", "0"], ["--kl_horizon", "0"]),
    (["--reward_clip_range", "5", "5"], ["--reward_clip_range", "5.0 5.0"]),
    (["--reward_clip_range", "5", "-5"], ["--reward_clip_range", "5.0 -5.0"]),
    (["--entropy_loss_coef", "-0.1"], ["--entropy_loss_coef", "-0.1"]),
    (["--advantage_estimator", "group_norm"], ["--advantage_estimator group_norm", "--n_samples_per_prompt", "1"]),
    (["--advantage_estimator", "dr_grpo"], ["--advantage_estimator dr_grpo", "--n_samples_per_prompt", "1"]),
    (["--advantage_estimator", "rloo"], ["--advantage_estimator rloo", "--n_samples_per_prompt", "1"]),
    (["--advantage_estimator", "reinforce_baseline"],
     ["--advantage_estimator reinforce_baseline", "--n_samples_per_prompt", "1"]),
    (["--input_template", "User: <prompt>"], ["--input_template", "'User: <prompt>'", "{}"]),
    (["--input_template", ""], ["--input_template", "''"]),
    (["--save_steps", "0"], ["--save_steps", "0"]),
    (["--save_steps", "-2"], ["--save_steps", "-2"]),
    (["--max_ckpt_num", "0"], ["--max_ckpt_num", "0"]),
    (["--logging_steps", "0"], ["--logging_steps", "0"]),
    (["--dist_timeout", "0"], ["--dist_timeout", "0.0"]),
    (["--dist_timeout", "-5"], ["--dist_timeout", "-5.0"]),
    (["--remote_rm_url", "reward.py", "--reward_pretrain", "/models/rm"], ["--remote_rm_url", "--reward_pretrain"]),
    (["--flash_attn"], ["--flash_attn needs --bf16"]),
    # policy losses and the rollout correction (rlrun.algo.policy_losses, rlrun.algo.rollout_correction)
    (["--policy_loss_type", "dro"], ["--policy_loss_type dro", "--dro_beta"]),
    (["--policy_loss_type", "clip_cov", "--clip_cov_bounds", "5", "1"], ["clip_cov", "lb < ub"]),
    (["--policy_loss_type", "sapo", "--sapo_tau_neg", "0"], ["sapo", "--sapo_tau_pos/--sapo_tau_neg"]),
    (["--rollout_is", "token", "--generation_backend", "hf"], ["--rollout_is token", "hf"]),
    (["--rollout_correction", "bypass_pg_is", "--generation_backend", "hf"], ["--rollout_correction bypass_pg_is"]),
    (["--rollout_is", "token", "--rollout_is_threshold", "two", "--generation_backend", "native"],
     ["--rollout_is token --rollout_is_threshold two", "LOW_HIGH"]),
    (["--rollout_rs", "token_k2", "--generation_backend", "native"], ["--rollout_rs token_k2", "rollout_rs_threshold"]),
    (["--rollout_correction", "decoupled_seq_is", "--rollout_is", "token", "--generation_backend", "native"],
     ["--rollout_correction decoupled_seq_is", "a whole verl preset", "--rollout_is token"]),
    (["--rollout_correction", "no_such", "--generation_backend", "native"], ["no_such", "decoupled_token_is"]),
    (["--is_correction_level", "token", "--rollout_is", "token", "--generation_backend", "native"],
     ["--is_correction_level token", "--rollout_is token", "keep one"]),
    (["--enable_vllm_is_correction", "--is_correction_level", "seq", "--generation_backend", "native"],
     ["--enable_vllm_is_correction", "--is_correction_level seq", "keep one"]),
    # on-policy distillation
    (["--teacher_pretrain", "/t", "--teacher_kl_coef", "0"], ["--teacher_kl_coef", "drop --teacher_pretrain"]),
    (["--teacher_pretrain", "/t", "--teacher_kl_loss"], ["--teacher_kl_loss", "k1", "k3"]),
    (["--teacher_pretrain", "/t", "--teacher_temperature", "0"], ["--teacher_temperature", "0.0"]),
]


@pytest.mark.parametrize("argv, parts", BAD_VALUES, ids=[" ".join(a) for a, _ in BAD_VALUES])
def test_check_values_rejects(argv, parts):
    cfg = cfg_of(*argv)
    with pytest.raises(ConfigError) as exc:
        check_values(cfg)
    assert_names(str(exc.value), *parts)


@pytest.mark.parametrize("argv, parts", BAD_VALUES[:6], ids=[" ".join(a) for a, _ in BAD_VALUES[:6]])
def test_plan_runs_check_values_first(argv, parts):
    # plan() is what every rank calls before any process group exists.
    with pytest.raises(ConfigError):
        lay_out(cfg_of(*argv), 1, 1)


GOOD_VALUES: list[list[str]] = [
    [],
    ["--top_p", "1"],
    ["--top_p", "0.01"],
    ["--lr_warmup_ratio", "0"],
    ["--lr_warmup_ratio", "1"],
    ["--temperature", "0.01"],
    ["--actor_learning_rate", "0"],
    ["--max_norm", "0", "--l2", "0"],
    ["--zero_stage", "0"],
    ["--zero_stage", "3"],
    ["--vllm_gpu_memory_utilization", "1"],
    ["--dual_clip", "3"],
    ["--value_clip", "none"],
    ["--gamma", "0", "--lambd", "1"],
    ["--init_kl_coef", "0"],
    ["--kl_target", "0.1"],
    ["--reward_clip_range", "-1", "1"],
    ["--entropy_loss_coef", "0"],
    ["--advantage_estimator", "reinforce"],  # REINFORCE++ needs no groups
    ["--advantage_estimator", "group_norm", "--n_samples_per_prompt", "2"],
    ["--advantage_estimator", "rloo", "--n_samples_per_prompt", "8"],
    ["--input_template", "User: {}\nAssistant:"],
    ["--save_steps", "-1"],
    ["--save_steps", "1"],
    ["--max_steps", "1"],
    ["--remote_rm_url", "reward.py"],
    ["--reward_pretrain", "/models/rm"],
]


@pytest.mark.parametrize("argv", GOOD_VALUES, ids=[" ".join(a) or "defaults" for a in GOOD_VALUES])
def test_check_values_accepts(argv):
    check_values(cfg_of(*argv))


def test_demo_config_is_valid():
    check_values(cfg_of("--config", "configs/demo.yaml"))


# --- batch divisibility ----------------------------------------------------------------------------------------

# (flags, role sizes, every number and name the message must contain)
BAD_BATCHES: list[tuple[list[str], dict[str, int], list[str]]] = [
    # rollouts per step do not split over a role's ranks
    (["--rollout_batch_size", "10"], {"actor": 4},
     ["10 rollouts", "--rollout_batch_size 10", "--n_samples_per_prompt 1", "4 actor ranks"]),
    (["--rollout_batch_size", "5", "--n_samples_per_prompt", "3", "--train_batch_size", "15",
      "--micro_train_batch_size", "1"], {"actor": 1, "critic": 2},
     ["15 rollouts", "--rollout_batch_size 5", "--n_samples_per_prompt 3", "2 critic ranks", "multiple of 2"]),
    (["--rollout_batch_size", "64"], {"actor": 4, "ref": 3},
     ["64 rollouts", "--rollout_batch_size 64", "3 ref ranks"]),
    (["--rollout_batch_size", "64"], {"actor": 4, "reward": 6}, ["64 rollouts", "6 reward ranks"]),
    (["--rollout_batch_size", "64"], {"actor": 4, "engine": 5}, ["64 rollouts", "5 engine ranks"]),
    # train_batch_size does not divide the rollouts
    (["--rollout_batch_size", "64", "--train_batch_size", "48"], {"actor": 4},
     ["--train_batch_size 48", "64 rollouts", "--rollout_batch_size 64", "--n_samples_per_prompt 1"]),
    (["--rollout_batch_size", "16", "--n_samples_per_prompt", "4", "--train_batch_size", "256"], {"actor": 1},
     ["--train_batch_size 256", "64 rollouts", "--rollout_batch_size 16", "--n_samples_per_prompt 4"]),
    # micro_train_batch_size x ranks does not divide train_batch_size
    (["--rollout_batch_size", "96", "--train_batch_size", "48", "--micro_train_batch_size", "5"], {"actor": 2},
     ["--train_batch_size 48", "--micro_train_batch_size 5", "2 actor ranks", "= 10"]),
    (["--rollout_batch_size", "96", "--train_batch_size", "48", "--micro_train_batch_size", "4"],
     {"actor": 4, "critic": 8},
     ["--train_batch_size 48", "--micro_train_batch_size 4", "8 critic ranks", "= 32"]),
    (["--rollout_batch_size", "64", "--train_batch_size", "64", "--micro_train_batch_size", "32"], {"actor": 4},
     ["--train_batch_size 64", "--micro_train_batch_size 32", "4 actor ranks", "= 128"]),
]


@pytest.mark.parametrize("argv, sizes, parts", BAD_BATCHES, ids=[str(i) for i in range(len(BAD_BATCHES))])
def test_check_batches_rejects(argv, sizes, parts):
    cfg = cfg_of(*argv)
    check_values(cfg)  # each case breaks only a batch rule
    with pytest.raises(ConfigError) as exc:
        check_batches(cfg, sizes)
    assert_names(str(exc.value), *parts)


GOOD_BATCHES: list[tuple[list[str], dict[str, int]]] = [
    ([], {"actor": 1, "critic": 1, "ref": 1, "engine": 1}),
    ([], {"actor": 8, "critic": 8, "ref": 8, "reward": 8, "engine": 8}),
    # ref/reward only score rollouts: the micro-batch rule is for trained roles
    (["--rollout_batch_size", "96", "--train_batch_size", "48", "--micro_train_batch_size", "4"],
     {"actor": 4, "ref": 3, "reward": 6, "engine": 2}),
    (["--rollout_batch_size", "16", "--n_samples_per_prompt", "4", "--train_batch_size", "32",
      "--micro_train_batch_size", "8"], {"actor": 2, "engine": 2}),
    (["--rollout_batch_size", "8", "--train_batch_size", "8", "--micro_train_batch_size", "1"], {"actor": 8}),
]


@pytest.mark.parametrize("argv, sizes", GOOD_BATCHES, ids=[str(i) for i in range(len(GOOD_BATCHES))])
def test_check_batches_accepts(argv, sizes):
    check_batches(cfg_of(*argv), sizes)


def test_plan_checks_batches_against_the_layout():
    # Defaults on 3 ranks: 1024 rollouts do not split over 3 hybrid-engine ranks.
    with pytest.raises(ConfigError) as exc:
        lay_out(cfg_of(), 3, 3)
    assert_names(str(exc.value), "1024 rollouts", "3 actor ranks")
    # Disaggregated: the critic's 2 ranks x micro 4 = 8 must divide 12.
    cfg = cfg_of("--rollout_batch_size", "24", "--train_batch_size", "12", "--micro_train_batch_size", "4",
                 "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "2", "--ref_num_gpus_per_node", "1",
                 "--vllm_num_engines", "1")
    with pytest.raises(ConfigError) as exc:
        lay_out(cfg, 5, 5)
    assert_names(str(exc.value), "--train_batch_size 12", "--micro_train_batch_size 4", "2 critic ranks", "= 8")
    # The same batch on a layout that fits.
    the_plan = lay_out(cfg_of("--rollout_batch_size", "24", "--train_batch_size", "12", "--micro_train_batch_size", "4",
                           "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1",
                           "--ref_num_gpus_per_node", "1", "--vllm_num_engines", "1"), 4, 4)
    assert the_plan.layout.world_size == 4


# ---- a reward source is never guessed (issue 24) ---------------------------------------------------------------

@pytest.mark.parametrize("argv, named", [
    (["--prompt_data", "p.jsonl", "--label_key", "answer"], "--prompt_data p.jsonl"),
    (["--pretrain", "Qwen/Qwen2.5-7B"], "--pretrain Qwen/Qwen2.5-7B"),
])
def test_real_data_or_model_without_a_reward_source_is_refused(argv, named):
    with pytest.raises(ConfigError) as err:
        check_values(cfg_of(*argv))
    message = str(err.value)
    assert message.startswith(f"no reward source for {named}: pass --reward_pretrain")
    for way in ("--remote_rm_url", "--compute_score", "--agent_func_path", "--retriever_url", "--remote_rm_url demo"):
        assert way in message


@pytest.mark.parametrize("argv", [
    [],  # the demo itself
    ["--prompt_data", "p.jsonl", "--remote_rm_url", "demo"],  # named, so not guessed
    ["--prompt_data", "p.jsonl", "--compute_score", "builtin"],
    ["--pretrain", "/m", "--reward_pretrain", "/rm"],
    ["--pretrain", "/m", "--retriever_url", "http://h/retrieve"],
])
def test_a_named_reward_source_passes(argv):
    check_values(cfg_of(*argv))


def test_two_reward_sources_are_refused():
    with pytest.raises(ConfigError, match=r"--remote_rm_url r.py and --compute_score builtin are all reward sources"):
        check_values(cfg_of("--remote_rm_url", "r.py", "--compute_score", "builtin"))
    with pytest.raises(ConfigError, match=r"--compute_score builtin with an agent"):
        check_values(cfg_of("--compute_score", "builtin", "--retriever_url", "http://h/retrieve"))


# --- LoRA (issue 28): rlrun.ppo and the supervised trainers share the checks ------------------------------------

LORA_BAD: list[tuple[list[str], list[str]]] = [
    (["--lora_rank=-1"], ["--lora_rank must be >= 0", "-1"]),
    (["--lora_rank", "8", "--lora_alpha", "0"], ["--lora_alpha must be > 0", "--lora_rank 8", "0"]),
    (["--lora_rank", "8", "--lora_alpha=-16"], ["--lora_alpha must be > 0", "-16"]),
    (["--lora_dropout", "1"], ["--lora_dropout must be in [0, 1)", "1.0"]),
    (["--lora_dropout=-0.1"], ["--lora_dropout must be in [0, 1)", "-0.1"]),
    (["--target_modules", "q_proj,"], ["--target_modules", "'q_proj', ''", "empty module name"]),
    (["--target_modules", "q_proj", ""], ["--target_modules", "empty module name"]),
    (["--target_modules", "all-linear", "q_proj"], ["--target_modules all-linear q_proj", "stands alone"]),
    (["--save_merged"], ["--save_merged", "add --lora_rank N"]),
]


@pytest.mark.parametrize("argv, parts", LORA_BAD, ids=[" ".join(a) for a, _ in LORA_BAD])
def test_lora_values_are_checked_in_one_line(argv, parts):
    with pytest.raises(ConfigError) as exc:
        check_values(cfg_of(*argv, "--remote_rm_url", "demo"))
    assert "\n" not in str(exc.value)
    assert_names(str(exc.value), *parts)


@pytest.mark.parametrize("argv, parts", LORA_BAD, ids=[" ".join(a) for a, _ in LORA_BAD])
def test_lora_values_are_checked_for_the_supervised_trainers(argv, parts):
    from rlrun.sft import CLI as SFT_CLI
    from rlrun.plan.checks import check_supervised

    with pytest.raises(ConfigError) as exc:
        check_supervised(parse_args([*argv, "--dataset", "d.jsonl"], SFT_CLI).config, 1, SFT_CLI.prog)
    assert_names(str(exc.value), *parts)


@pytest.mark.parametrize("argv", [
    ["--lora_rank", "8", "--lora_alpha", "16", "--target_modules", "q_proj", "v_proj", "--lora_dropout", "0.05"],
    ["--lora_rank", "8", "--save_merged"],
    ["--lora_alpha", "0"],  # no adapters: alpha means nothing
    ["--lora_rank", "64", "--lora_alpha", "32", "--target_modules", "all-linear", "--lora_dropout", "0"],
])
def test_good_lora_values_pass(argv):
    check_values(cfg_of(*argv, "--remote_rm_url", "demo"))


def test_save_merged_with_an_adapter_directory_as_pretrain_passes(tmp_path):
    """A saved PEFT adapter as --pretrain trains LoRA without --lora_rank (its adapter_config.json has the rank)."""
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA", "r": 8, "base_model_name_or_path": "/base"}')
    check_values(cfg_of("--pretrain", str(tmp_path), "--save_merged", "--remote_rm_url", "demo"))
