"""OpenRLHF train_ppo_ray command lines work unchanged: every flag lands on the field of the same name with the
same meaning; Ray-only and not-yet-supported flags are accepted and reported as ignored."""

from __future__ import annotations

import dataclasses
import shlex

import pytest

from rlrun.cli.parser import IGNORED_FLAGS, LAUNCHER, NOT_YET, RAY_ONLY, RENAMED_FLAGS, build_parser, parse_args, NO_EFFECT_YET
from rlrun.compat.argv import CHANGES_TRAINING
from rlrun.config.fields import fields_of
from rlrun.config.tree import Config
from rlrun.launch.layout import Role
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError

T = True  # a bare store-true flag

# (flag, value tokens after it, expected field value). Values differ from the defaults, so landing is visible.
OPENRLHF_FLAGS: list[tuple[str, list[str], object]] = [
    # models and reward sources
    ("pretrain", ["meta-llama/Llama-3-8b"], "meta-llama/Llama-3-8b"),
    ("reward_pretrain", ["/models/rm"], "/models/rm"),
    ("critic_pretrain", ["/models/critic"], "/models/critic"),
    ("remote_rm_url", ["http://rm:5000/get_reward"], "http://rm:5000/get_reward"),
    # role layout
    ("actor_num_nodes", ["2"], 2),
    ("actor_num_gpus_per_node", ["8"], 8),
    ("critic_num_nodes", ["3"], 3),
    ("critic_num_gpus_per_node", ["4"], 4),
    ("ref_num_nodes", ["1"], 1),
    ("ref_num_gpus_per_node", ["2"], 2),
    ("reward_num_nodes", ["1"], 1),
    ("reward_num_gpus_per_node", ["6"], 6),
    ("vllm_num_engines", ["4"], 4),
    ("vllm_tensor_parallel_size", ["2"], 2),
    ("vllm_gpu_memory_utilization", ["0.5"], 0.5),
    ("vllm_enable_sleep", [], T),
    ("vllm_sync_backend", ["gloo"], "gloo"),
    ("enforce_eager", [], T),
    ("colocate_actor_ref", [], T),
    ("colocate_critic_reward", [], T),
    ("colocate_all_models", [], T),
    # training strategy
    ("zero_stage", ["3"], 3),
    ("bf16", [], T),
    ("adam_offload", [], T),
    ("gradient_checkpointing", [], T),
    ("flash_attn", [], T),
    ("packing_samples", [], T),
    ("deepspeed_enable_sleep", [], T),
    # batches and schedule
    ("rollout_batch_size", ["64"], 64),
    ("micro_rollout_batch_size", ["16"], 16),
    ("train_batch_size", ["32"], 32),
    ("micro_train_batch_size", ["2"], 2),
    ("n_samples_per_prompt", ["8"], 8),
    ("max_epochs", ["2"], 2),
    ("num_episodes", ["3"], 3),
    ("max_samples", ["100000"], 100_000),
    ("prompt_max_len", ["512"], 512),
    ("generate_max_len", ["256"], 256),
    ("temperature", ["0.7"], 0.7),
    ("top_p", ["0.9"], 0.9),
    # optimisation
    ("actor_learning_rate", ["5e-7"], 5e-7),
    ("critic_learning_rate", ["9e-5"], 9e-5),
    ("lr_warmup_ratio", ["0.1"], 0.1),
    ("max_norm", ["0.5"], 0.5),
    ("l2", ["0.01"], 0.01),
    # algorithm
    ("advantage_estimator", ["reinforce_baseline"], "reinforce_baseline"),
    ("init_kl_coef", ["1e-3"], 1e-3),
    ("kl_target", ["0.1"], 0.1),
    ("kl_horizon", ["5000"], 5000),
    ("kl_estimator", ["k3"], "k3"),
    ("use_kl_loss", [], T),
    ("gamma", ["0.99"], 0.99),
    ("lambd", ["0.95"], 0.95),
    ("eps_clip", ["0.1"], 0.1),
    ("value_clip", ["0.2"], 0.2),
    ("normalize_reward", [], T),
    ("reward_clip_range", ["-5", "5"], (-5.0, 5.0)),
    ("entropy_loss_coef", ["0.01"], 0.01),
    ("eps_clip_low_high", ["0.2", "0.28"], (0.2, 0.28)),
    ("policy_loss_type", ["gspo"], "gspo"),
    ("no_advantage_std_norm", [], T),
    ("overlong_buffer_len", ["64"], 64),
    ("overlong_penalty_factor", ["0.5"], 0.5),
    ("dynamic_filtering", [], T),
    ("dynamic_filtering_reward_range", ["0.1", "0.9"], (0.1, 0.9)),
    # data
    ("prompt_data", ["OpenRLHF/prompt-collection-v0.1"], "OpenRLHF/prompt-collection-v0.1"),
    ("input_key", ["context_messages"], "context_messages"),
    ("label_key", ["answer"], "answer"),
    ("input_template", ["User: {}\nAssistant: "], "User: {}\nAssistant: "),
    ("apply_chat_template", [], T),
    # checkpoints
    ("save_path", ["/out/final"], "/out/final"),
    ("ckpt_path", ["/out/ckpt"], "/out/ckpt"),
    ("save_steps", ["20"], 20),
    ("load_checkpoint", [], T),
    ("save_hf_ckpt", [], T),
    ("max_ckpt_num", ["5"], 5),
    ("save_value_network", [], T),
    # logging
    ("logging_steps", ["2"], 2),
    ("eval_steps", ["10"], 10),
    ("use_wandb", ["0123abcd"], "0123abcd"),
    ("wandb_org", ["my-org"], "my-org"),
    ("wandb_project", ["my-proj"], "my-proj"),
    ("wandb_group", ["grp"], "grp"),
    ("wandb_run_name", ["run-1"], "run-1"),
    ("use_tensorboard", ["./tb_logs"], "./tb_logs"),
    ("seed", ["1234"], 1234),
]

RLRUN_FLAGS: list[tuple[str, list[str], object]] = [
    ("max_steps", ["7"], 7),
    ("dry_run", [], T),
    ("device", ["cpu"], "cpu"),
    ("generation_backend", ["hf"], "hf"),
    ("dist_timeout", ["60"], 60.0),
]

ALL_FLAGS = OPENRLHF_FLAGS + RLRUN_FLAGS
BOOL_FIELDS = sorted(name for name, info in fields_of(Config).items() if info.type is bool)


def _defaults_except(cfg: Config, name: str) -> None:
    """Every field but `name` still has its default: the flag landed on one field only."""
    for other, info in fields_of(Config).items():
        if other != name:
            assert getattr(getattr(cfg, info.section), other) == info.default, (name, other)


def test_flag_table_has_no_duplicates():
    names = [name for name, _, _ in ALL_FLAGS]
    assert len(names) == len(set(names))


def test_every_listed_flag_is_supported():
    """A field removed or renamed (and not moved to IGNORED_FLAGS) fails here."""
    supported = set(fields_of(Config)) | set(IGNORED_FLAGS) | set(RENAMED_FLAGS)
    missing = [name for name, _, _ in ALL_FLAGS if name not in supported]
    assert not missing
    # And the parser really has a --flag for every field.
    parser_flags = {opt for action in build_parser()._actions for opt in action.option_strings}
    assert {f"--{name}" for name in fields_of(Config)} <= parser_flags


def test_ignored_flags_are_not_fields():
    # A name in both would be stripped before parsing, so the field could never be set.
    assert not set(IGNORED_FLAGS) & set(fields_of(Config))


@pytest.mark.parametrize("name, values, expected", ALL_FLAGS, ids=[name for name, _, _ in ALL_FLAGS])
def test_flag_lands_on_its_field(name, values, expected):
    parsed = parse_args([f"--{name}", *values])
    if name in IGNORED_FLAGS:
        assert parsed.config == Config()
        assert parsed.explicit == frozenset()
        assert len(parsed.ignored) == 1 and parsed.ignored[0].startswith(f"--{name}: ignored (")
        return
    field = RENAMED_FLAGS.get(name, name)  # an OpenRLHF name rlrun spells otherwise (--deepspeed_enable_sleep)
    info = fields_of(Config)[field]
    value = getattr(getattr(parsed.config, info.section), field)
    assert value == expected
    assert type(value) is type(expected)
    assert parsed.explicit == {field}
    if name in NO_EFFECT_YET:  # kept in the config, but reported: nothing acts on it in this release
        assert parsed.ignored == (f"--{name}: has no effect ({NO_EFFECT_YET[name]})",)
    else:
        assert parsed.ignored == ()
    _defaults_except(parsed.config, field)


SINGLE_VALUE = [f for f in ALL_FLAGS if len(f[1]) == 1 and f[0] not in IGNORED_FLAGS]


@pytest.mark.parametrize("name, values, expected", SINGLE_VALUE, ids=[f[0] for f in SINGLE_VALUE])
def test_flag_equals_form(name, values, expected):
    field = RENAMED_FLAGS.get(name, name)
    info = fields_of(Config)[field]
    assert getattr(getattr(parse_args([f"--{name}={values[0]}"]).config, info.section), field) == expected


@pytest.mark.parametrize("name", BOOL_FIELDS)
def test_bool_flags_bare_or_with_value(name):
    section = fields_of(Config)[name].section
    get = lambda argv: getattr(getattr(parse_args(argv).config, section), name)  # noqa: E731
    assert get([f"--{name}"]) is True
    assert get([f"--{name}", "--seed", "3"]) is True  # a bare flag does not swallow the next flag
    assert get([f"--{name}", "false"]) is False
    assert get([f"--{name}=true"]) is True
    assert get([f"--{name}=0"]) is False
    assert get([]) is fields_of(Config)[name].default


def test_bare_use_wandb_is_on_with_key_from_environment():
    assert parse_args(["--use_wandb", "--bf16"]).config.logging.use_wandb == ""
    assert parse_args([]).config.logging.use_wandb is None


def test_openrlhf_scientific_notation_for_integers():
    # OpenRLHF example scripts write e.g. --max_samples 1e8.
    assert parse_args(["--max_samples", "1e8"]).config.train.max_samples == 100_000_000


def test_negative_values_parse():
    cfg = parse_args(["--save_steps", "-1", "--eval_steps", "-1", "--reward_clip_range", "-10", "-2"]).config
    assert cfg.checkpoint.save_steps == -1 and cfg.logging.eval_steps == -1
    assert cfg.algo.reward_clip_range == (-10.0, -2.0)


# --- ignored flags --------------------------------------------------------------------------------------------


def _values_for(nargs: int | str) -> list[str]:
    return {"*": ["q_proj", "k_proj", "v_proj"], 0: [], 1: ["8"], 2: ["0.2", "0.28"]}[nargs]  # type: ignore[index]


@pytest.mark.parametrize("name", sorted(set(IGNORED_FLAGS) - set(CHANGES_TRAINING)))
def test_ignored_flag_is_reported_and_its_values_consumed(name):
    nargs, reason = IGNORED_FLAGS[name]
    parsed = parse_args(["--seed", "3", f"--{name}", *_values_for(nargs), "--max_epochs", "2"])
    assert parsed.ignored == (f"--{name}: ignored ({reason})",)
    assert parsed.config.train.seed == 3 and parsed.config.train.max_epochs == 2
    assert parsed.explicit == {"seed", "max_epochs"}


@pytest.mark.parametrize("name", [n for n, (nargs, _) in IGNORED_FLAGS.items() if nargs == 1 and n not in CHANGES_TRAINING])
def test_ignored_flag_equals_form(name):
    parsed = parse_args([f"--{name}=5", "--seed", "4"])
    assert len(parsed.ignored) == 1 and parsed.config.train.seed == 4


@pytest.mark.parametrize("name", sorted(set(IGNORED_FLAGS) & set(CHANGES_TRAINING)))
def test_flags_that_would_change_what_is_trained_are_refused(name):
    """Issue 24 (7): ignoring them would silently train something else; a value that asks for nothing passes."""
    nargs, _ = IGNORED_FLAGS[name]
    with pytest.raises(ConfigError) as err:
        parse_args(["--seed", "3", f"--{name}", *_values_for(nargs)])
    assert str(err.value).startswith(f"--{name}") and CHANGES_TRAINING[name] in str(err.value)
    assert "\n" not in str(err.value)
    if nargs == 1:
        assert parse_args([f"--{name}", "0", "--seed", "3"]).ignored  # 0: the feature is off


def test_ignored_reasons():
    assert IGNORED_FLAGS["deepcompile"][1] == NOT_YET
    assert "deepspeed_enable_sleep" not in IGNORED_FLAGS  # implemented: rlrun.rl.sleep
    assert IGNORED_FLAGS["vllm_sync_with_ray"][1] == RAY_ONLY
    assert IGNORED_FLAGS["local_rank"][1] == LAUNCHER
    parsed = parse_args(["--deepcompile", "--ds_tensor_parallel_size", "2"])
    assert parsed.ignored == (f"--deepcompile: ignored ({NOT_YET})", f"--ds_tensor_parallel_size: ignored ({NOT_YET})")
    assert parsed.config == Config()


def test_ignored_flag_reported_once_when_repeated():
    assert len(parse_args(["--deepcompile", "--deepcompile"]).ignored) == 1


@pytest.mark.parametrize("argv", [
    ["--ray_foo", "value", "--seed", "5"],
    ["--ray_foo=value", "--seed", "5"],
    ["--seed", "5", "--ray_foo"],  # last token: no value
    ["--ray_foo", "--seed", "5"],  # next token is a flag: nothing consumed
])
def test_unknown_ray_flag_is_ignored_as_ray_only(argv):
    parsed = parse_args(argv)
    assert parsed.ignored == (f"--ray_foo: ignored ({RAY_ONLY})",)
    assert parsed.config.train.seed == 5
    assert parsed.explicit == {"seed"}


def test_ray_flag_value_is_consumed_not_parsed():
    # "value" would otherwise be a stray positional argument.
    parse_args(["--ray_object_store_memory", "1000000", "--ray_address", "auto"])


def test_unknown_non_ray_flag_still_fails():
    with pytest.raises(ConfigError, match="unknown flag '--rayfoo'"):
        parse_args(["--rayfoo", "1"])


# --- realistic command lines -----------------------------------------------------------------------------------

# examples/scripts/train_ppo_llama_ray.sh style (hybrid engine), submitted through `ray job submit`,
# with Ray-only flags mixed in.
PPO_SCRIPT = r"""
ray job submit --address="http://127.0.0.1:8265" \
   --runtime-env-json='{"working_dir": "/openrlhf"}' \
   -- python3 -m openrlhf.cli.train_ppo_ray \
   --ref_num_nodes 1 \
   --ref_num_gpus_per_node 8 \
   --reward_num_nodes 1 \
   --reward_num_gpus_per_node 8 \
   --critic_num_nodes 1 \
   --critic_num_gpus_per_node 8 \
   --actor_num_nodes 1 \
   --actor_num_gpus_per_node 8 \
   --vllm_num_engines 4 \
   --vllm_tensor_parallel_size 2 \
   --colocate_all_models \
   --vllm_gpu_memory_utilization 0.5 \
   --ray_address auto \
   --pretrain OpenRLHF/Llama-3-8b-sft-mixture \
   --reward_pretrain OpenRLHF/Llama-3-8b-rm-700k \
   --save_path /openrlhf/examples/test_scripts/final/llama3-8b-rlhf \
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/llama3-8b-rlhf \
   --save_hf_ckpt \
   --micro_train_batch_size 8 \
   --train_batch_size 128 \
   --micro_rollout_batch_size 16 \
   --rollout_batch_size 1024 \
   --n_samples_per_prompt 1 \
   --max_epochs 1 \
   --prompt_max_len 1024 \
   --max_samples 100000 \
   --generate_max_len 1024 \
   --zero_stage 3 \
   --bf16 \
   --actor_learning_rate 5e-7 \
   --critic_learning_rate 9e-6 \
   --init_kl_coef 0.01 \
   --prompt_data OpenRLHF/prompt-collection-v0.1 \
   --input_key context_messages \
   --apply_chat_template \
   --normalize_reward \
   --gradient_checkpointing \
   --packing_samples \
   --vllm_sync_backend nccl \
   --vllm_sync_with_ray \
   --enforce_eager \
   --vllm_enable_sleep \
   --deepspeed_enable_sleep \
   --runtime-env-json='{"setup_commands": ["pip install openrlhf[vllm]"]}' \
   --use_wandb {wandb_token}
"""

# train_grpo_ray_hybrid_engine.sh style: GRPO with a reward function file, KL as a loss, no critic.
GRPO_SCRIPT = r"""
python3 -m openrlhf.cli.train_ppo_ray \
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 \
   --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
   --vllm_num_engines 8 --vllm_tensor_parallel_size 1 \
   --colocate_all_models --vllm_gpu_memory_utilization 0.6 \
   --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3 \
   --advantage_estimator group_norm \
   --pretrain Qwen/Qwen2.5-7B-Instruct \
   --remote_rm_url /openrlhf/examples/python/reward_func.py \
   --save_path /openrlhf/examples/test_scripts/final/qwen2.5-7b-grpo \
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/qwen2.5-7b-grpo \
   --save_hf_ckpt --micro_train_batch_size 4 --train_batch_size 128 \
   --micro_rollout_batch_size 8 --rollout_batch_size 128 --n_samples_per_prompt 8 \
   --max_epochs 1 --prompt_max_len 1024 --max_samples 1e8 --generate_max_len 1024 \
   --zero_stage 3 --bf16 --actor_learning_rate 5e-7 \
   --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --label_key label \
   --apply_chat_template --gradient_checkpointing --packing_samples \
   --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep \
   --async_train --async_queue_size 2 --ray_namespace grpo \
   --lr_scheduler cosine_with_min_lr --eps_clip_low_high 0.2 0.28 --use_tensorboard logs/grpo
"""


def _argv(script: str) -> list[str]:
    tokens = shlex.split(script.replace("\\\n", " "))  # shell line continuations
    return tokens[tokens.index("openrlhf.cli.train_ppo_ray") + 1:]


def test_realistic_ppo_command_line():
    parsed = parse_args(_argv(PPO_SCRIPT))
    cfg = parsed.config
    r = cfg.resources
    assert (r.actor_num_nodes, r.actor_num_gpus_per_node, r.critic_num_gpus_per_node) == (1, 8, 8)
    assert (r.ref_num_gpus_per_node, r.reward_num_gpus_per_node) == (8, 8)
    assert (r.vllm_num_engines, r.vllm_tensor_parallel_size, r.colocate_all_models) == (4, 2, True)
    assert cfg.model.pretrain == "OpenRLHF/Llama-3-8b-sft-mixture"
    assert cfg.reward.reward_pretrain == "OpenRLHF/Llama-3-8b-rm-700k"
    assert cfg.model.bf16 and cfg.model.gradient_checkpointing
    assert (cfg.train.rollout_batch_size, cfg.train.train_batch_size, cfg.train.micro_train_batch_size) == (1024, 128, 8)
    assert cfg.train.actor_learning_rate == 5e-7 and cfg.train.zero_stage == 3
    assert cfg.train.sleep  # with FSDP2 ZeRO-3, rlrun's default strategy: sleep works there too
    assert cfg.algo.init_kl_coef == 0.01 and cfg.algo.normalize_reward
    assert cfg.data.input_key == "context_messages" and cfg.template.apply_chat_template
    assert cfg.generation.vllm_gpu_memory_utilization == 0.5 and cfg.generation.enforce_eager
    assert cfg.checkpoint.save_hf_ckpt and cfg.checkpoint.ckpt_path.endswith("ckpt/llama3-8b-rlhf")
    assert cfg.logging.use_wandb == "{wandb_token}"
    assert [line.split(":")[0] for line in parsed.ignored] == [
        "--ray_address", "--vllm_sync_with_ray", "--runtime-env-json",
        "--vllm_gpu_memory_utilization", "--vllm_enable_sleep", "--enforce_eager"]
    # The same command on 8 ranks of one node: every model and 4 TP-2 engines on all 8 ranks.
    layout = lay_out(cfg, 8, 8).layout
    for role in (Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD, Role.ENGINE):
        assert layout.ranks_of(role) == tuple(range(8))
    assert layout.engines == ((0, 1), (2, 3), (4, 5), (6, 7))


def test_realistic_grpo_command_line():
    parsed = parse_args(_argv(GRPO_SCRIPT))
    cfg = parsed.config
    assert cfg.algo.advantage_estimator == "group_norm" and cfg.algo.use_kl_loss and cfg.algo.kl_estimator == "k3"
    assert cfg.algo.init_kl_coef == 1e-3 and cfg.train.n_samples_per_prompt == 8
    assert cfg.train.max_samples == 100_000_000
    assert cfg.reward.remote_rm_url == "/openrlhf/examples/python/reward_func.py"
    assert cfg.data.label_key == "label" and cfg.logging.use_tensorboard == "logs/grpo"
    assert not cfg.algo.needs_critic and cfg.algo.needs_ref and not cfg.reward.needs_reward_model
    assert {line.split(":")[0] for line in parsed.ignored} == {
        "--ray_namespace",
        "--lr_scheduler", "--vllm_gpu_memory_utilization", "--vllm_enable_sleep", "--enforce_eager"}
    assert cfg.algo.eps_clip_low_high == (0.2, 0.28)
    layout = lay_out(cfg, 8, 8).layout
    assert layout.ranks_of(Role.ACTOR) == layout.ranks_of(Role.REF) == layout.ranks_of(Role.ENGINE) == tuple(range(8))
    assert not layout.has(Role.CRITIC) and not layout.has(Role.REWARD)


def test_every_openrlhf_flag_in_one_command_line():
    argv = [tok for name, values, _ in OPENRLHF_FLAGS for tok in (f"--{name}", *values)]
    cfg = parse_args(argv).config
    for name, _, expected in OPENRLHF_FLAGS:
        if name not in IGNORED_FLAGS:
            field = RENAMED_FLAGS.get(name, name)
            info = fields_of(Config)[field]
            assert getattr(getattr(cfg, info.section), field) == expected, name


def test_config_sections_cover_all_flags():
    # Guards the table above against a section being dropped from Config.
    assert {f.name for f in dataclasses.fields(Config)} == {i.section for i in fields_of(Config).values()}
