"""OpenRLHF 0.11 dotted flags: each one means what the classic (0.9) flag of the same meaning does, or is reported
as ignored with its reason; unknown dotted flags fail with a suggestion over both spellings."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest

from helpers import value_tokens
from rlrun.cli.parser import IGNORED_FLAGS, NOT_YET, RAY_ONLY, parse_args
from rlrun.compat.openrlhf_flags import OPENRLHF_DOTTED, ByValue, Ignored, Same, resolve
from rlrun.compat.argv import refused
from rlrun.config.fields import fields_of
from rlrun.config.tree import Config
from rlrun.runtime.errors import ConfigError

PEER_CLI = Path("/work/peers/openrlhf/cli/train_ppo_ray.py")

# Fields other parts of rlrun are adding; until they exist the dotted flag is reported as not implemented.
PENDING = {"eps_clip_low_high", "policy_loss_type", "dynamic_filtering", "dynamic_filtering_reward_range",
           "overlong_buffer_len", "overlong_penalty_factor", "no_advantage_std_norm", "stop_properly_penalty_coef",
           "running_reward_norm", "normalize_reward", "eval_dataset", "eval_split", "eval_steps", "eval_temperature",
           "eval_n_samples_per_prompt", "eval_before_train", "packing_samples"}

FIELDS = fields_of(Config)
SAME = sorted(name for name, m in OPENRLHF_DOTTED.items() if isinstance(m, Same) and m.field in FIELDS)
IGNORED = sorted(name for name in OPENRLHF_DOTTED if isinstance(resolve(name, FIELDS, IGNORED_FLAGS), Ignored))


def _peer_dotted_flags() -> set[str]:
    src = PEER_CLI.read_text()
    flags = set(re.findall(r'"--([a-z_0-9]+\.[a-z_0-9.]+)"', src))
    for role in ("actor", "critic"):  # the per-role optimizer flags are made in a loop
        flags |= {f"{role}.{m}" for m in re.findall(r'f"--\{prefix\}\.([a-z_0-9.]+)"', src)}
    return flags


@pytest.mark.skipif(not PEER_CLI.exists(), reason="OpenRLHF 0.11.2 source not on this machine")
def test_table_has_every_dotted_flag_of_openrlhf_0_11_2():
    assert _peer_dotted_flags() == set(OPENRLHF_DOTTED)


def test_table_size():
    # 0.11.2's train_ppo_ray.py: 139 dotted flags plus 13 per-role optimizer flags for actor and critic.
    assert len(OPENRLHF_DOTTED) == 165


def test_every_target_is_a_field_a_classic_ignored_flag_or_pending():
    """A typo in a target name would silently turn a supported flag into an ignored one."""
    targets = {m.field for m in OPENRLHF_DOTTED.values() if isinstance(m, Same)}
    assert not targets - set(FIELDS) - set(IGNORED_FLAGS) - PENDING


@pytest.mark.parametrize("dotted", SAME)
def test_dotted_flag_equals_its_classic_flag(dotted):
    field = OPENRLHF_DOTTED[dotted].field  # type: ignore[union-attr]
    values = value_tokens(FIELDS[field])
    # rlrun-only flags around it: a flag that swallowed too many or too few tokens breaks them.
    by_dotted = parse_args(["--device", "cpu", f"--{dotted}", *values, "--dry_run"])
    by_classic = parse_args(["--device", "cpu", f"--{field}", *values, "--dry_run"])
    assert by_dotted.config == by_classic.config
    assert by_dotted.explicit == by_classic.explicit == {"device", "dry_run", field}
    assert by_dotted.ignored == by_classic.ignored
    assert by_dotted.config != parse_args(["--device", "cpu", "--dry_run"]).config  # the value landed


ONE_VALUE = [n for n in SAME if len(value_tokens(FIELDS[OPENRLHF_DOTTED[n].field])) == 1]  # type: ignore[union-attr]


@pytest.mark.parametrize("dotted", ONE_VALUE)
def test_dotted_flag_equals_form(dotted):
    field = OPENRLHF_DOTTED[dotted].field  # type: ignore[union-attr]
    value = value_tokens(FIELDS[field])[0]
    assert parse_args([f"--{dotted}={value}"]).config == parse_args([f"--{field}={value}"]).config


def _values_for(nargs: int | str) -> list[str]:
    return {"*": ["q_proj", "k_proj"], "+": ["0.5", "5"], 0: [], 1: ["8"], 2: ["0.2", "0.28"]}[nargs]  # type: ignore[index]


@pytest.mark.parametrize("dotted", IGNORED)
def test_ignored_dotted_flag_is_reported_and_its_values_consumed(dotted):
    meaning = resolve(dotted, FIELDS, IGNORED_FLAGS)
    assert isinstance(meaning, Ignored)
    values = _values_for(meaning.nargs)
    original = OPENRLHF_DOTTED[dotted]
    classic = f"--{original.field}" if isinstance(original, Same) else f"--{dotted}"
    if refused([(classic, values[0] if values else None)]):  # issue 24 (7): ignoring it would train something else
        with pytest.raises(ConfigError, match=rf"^--{re.escape(dotted)}\b"):
            parse_args(["--seed", "3", f"--{dotted}", *values])
        return
    parsed = parse_args(["--seed", "3", f"--{dotted}", *values, "--max_epochs", "2"])
    assert parsed.ignored == (f"--{dotted}: ignored ({meaning.reason})",)
    assert parsed.explicit == {"seed", "max_epochs"}
    assert parsed.config.train.seed == 3 and parsed.config.train.max_epochs == 2


def test_ignored_reasons_follow_the_classic_flag():
    for dotted, meaning in OPENRLHF_DOTTED.items():
        if isinstance(meaning, Same) and meaning.field not in FIELDS and meaning.field in IGNORED_FLAGS:
            assert resolve(dotted, FIELDS, IGNORED_FLAGS) == Ignored(meaning.nargs, IGNORED_FLAGS[meaning.field][1])
    assert parse_args(["--vllm.sync_with_ray"]).ignored == (f"--vllm.sync_with_ray: ignored ({RAY_ONLY})",)
    assert parse_args(["--train.async_enable"]).config.train.async_train  # rlrun implements it (one-step lag)
    assert parse_args(["--train.partial_rollout_enable"]).config.train.partial_rollout  # rlrun implements it too
    assert parse_args(["--actor.lr_scheduler", "cosine_with_min_lr"]).ignored == (
        "--actor.lr_scheduler: ignored (rlrun always uses linear warmup + cosine decay)",)


def test_missing_target_field_is_reported_not_implemented():
    """Another helper's field that does not exist (yet): the flag is accepted and reported, never an error."""
    without = {k: v for k, v in FIELDS.items() if k != "eps_clip_low_high"}
    assert resolve("actor.eps_clip_low_high", without, {}) == Ignored(2, NOT_YET)
    assert resolve("actor.eps_clip_low_high", without, {"eps_clip_low_high": (2, "because")}) == Ignored(2, "because")
    assert resolve("reward.stop_properly_penalty_coef", without, {}) in (
        Ignored(1, NOT_YET), Same("stop_properly_penalty_coef", 1))


def test_store_true_flags_take_no_value():
    cfg = parse_args(["--train.colocate_all", "--ckpt.load_enable", "--ds.adam_offload", "--rollout.batch_size", "8"]).config
    assert cfg.resources.colocate_all_models and cfg.checkpoint.load_checkpoint and cfg.train.adam_offload
    assert cfg.train.rollout_batch_size == 8


def test_two_value_flags():
    cfg = parse_args(["--reward.clip_range", "-5", "5", "--actor.adam.betas", "0.9", "0.999"]).config
    assert cfg.algo.reward_clip_range == (-5.0, 5.0)
    assert cfg.train.adam_betas == (0.9, 0.999)


def test_value_transforms():
    assert parse_args(["--ds.param_dtype", "bf16"]).config.model.bf16 is True
    assert parse_args(["--ds.param_dtype=bf16"]).config.model.bf16 is True
    with pytest.raises(ConfigError, match=r"--ds.param_dtype fp16: .*fp16 is not supported"):
        parse_args(["--ds.param_dtype", "fp16"])
    assert parse_args(["--actor.optim", "adam", "--critic.optim", "adam"]).config == Config()
    with pytest.raises(ConfigError, match=r"--critic.optim muon: rlrun trains with AdamW only"):
        parse_args(["--critic.optim", "muon"])
    assert isinstance(OPENRLHF_DOTTED["ds.param_dtype"], ByValue)


def test_meanings_read_from_openrlhf():
    cfg = parse_args(["--logger.wandb.key", "abc", "--ckpt.output_dir", "/final", "--ckpt.path", "/ckpts",
                      "--train.batch_size", "64", "--train.micro_batch_size", "2", "--rollout.micro_batch_size", "4",
                      "--rollout.max_new_tokens", "256", "--data.prompt_dataset", "p.jsonl",
                      "--actor.model_name_or_path", "/m", "--critic.model_name_or_path", "/c",
                      "--reward.remote_url", "r.py", "--algo.kl.init_coef", "0.002", "--algo.kl.use_loss",
                      "--actor.entropy_coef", "0.01", "--actor.adam.lr", "5e-7", "--critic.adam.lr", "9e-6",
                      "--actor.adam.weight_decay", "0.1", "--actor.max_norm", "0.5"]).config
    assert cfg.logging.use_wandb == "abc"
    assert (cfg.checkpoint.save_path, cfg.checkpoint.ckpt_path) == ("/final", "/ckpts")
    assert (cfg.train.train_batch_size, cfg.train.micro_train_batch_size, cfg.train.micro_rollout_batch_size) == (64, 2, 4)
    assert cfg.generation.generate_max_len == 256 and cfg.data.prompt_data == "p.jsonl"
    assert (cfg.model.pretrain, cfg.critic.critic_pretrain, cfg.reward.remote_rm_url) == ("/m", "/c", "r.py")
    assert cfg.algo.init_kl_coef == 0.002 and cfg.algo.use_kl_loss and cfg.algo.entropy_loss_coef == 0.01
    assert (cfg.train.actor_learning_rate, cfg.critic.critic_learning_rate) == (5e-7, 9e-6)
    assert (cfg.train.l2, cfg.train.max_norm) == (0.1, 0.5)


def test_critic_copies_of_shared_settings_are_reported():
    parsed = parse_args(["--critic.max_norm", "0.3", "--critic.adam.betas", "0.8", "0.9"])
    assert parsed.config == Config()
    assert [line.split(":")[0] for line in parsed.ignored] == ["--critic.max_norm", "--critic.adam.betas"]


def test_rlrun_section_aliases_agree_with_openrlhf():
    """A dotted name that is both an OpenRLHF flag and rlrun's --section.field alias means one field."""
    for dotted, meaning in OPENRLHF_DOTTED.items():
        section, _, name = dotted.partition(".")
        if name in FIELDS and FIELDS[name].section == section:
            assert isinstance(meaning, Same) and meaning.field == name, dotted
    assert parse_args(["--train.seed", "9"]).config.train.seed == 9
    assert parse_args(["--train.batch_size", "16"]).config.train.train_batch_size == 16
    assert parse_args(["--algo.gamma", "0.9"]).config.algo.gamma == 0.9  # rlrun-only alias still works


def test_later_spelling_wins():
    assert parse_args(["--train.seed", "1", "--seed", "2"]).config.train.seed == 2
    assert parse_args(["--seed", "2", "--train.seed", "1"]).config.train.seed == 1
    assert parse_args(["--algo.kl.init_coef", "0.1", "--init_kl_coef", "0.2"]).config.algo.init_kl_coef == 0.2


@pytest.mark.parametrize("flag, hint", [
    ("--actor.num_node", "--actor.num_nodes"),
    ("--algo.kl.init_coeff", "--algo.kl.init_coef"),
    ("--train.colocate_al", "--train.colocate_all"),
    ("--init_kl_coeff", "--init_kl_coef"),
])
def test_unknown_flag_suggests_either_spelling(flag, hint):
    with pytest.raises(ConfigError, match=f"unknown flag '{re.escape(flag)}'; did you mean '{re.escape(hint)}'"):
        parse_args([flag, "1"])


def test_bad_value_names_the_dotted_flag():
    with pytest.raises(ConfigError, match=r"from --rollout\.batch_size\) must be an integer"):
        parse_args(["--rollout.batch_size", "many"])
    with pytest.raises(ConfigError, match=r"--rollout\.batch_size needs 1 value"):
        parse_args(["--rollout.batch_size"])
    with pytest.raises(ConfigError, match=r"--reward\.clip_range needs 2 values"):
        parse_args(["--reward.clip_range", "-1", "--seed", "2"])


# The GRPO command line of tests/cli/test_cli_compat.py, spelled the OpenRLHF 0.11 way.
GRPO_0_11 = r"""
python3 -m openrlhf.cli.train_ppo_ray \
   --ref.num_nodes 1 --ref.num_gpus_per_node 8 \
   --actor.num_nodes 1 --actor.num_gpus_per_node 8 \
   --vllm.num_engines 8 --vllm.tensor_parallel_size 1 \
   --train.colocate_all --vllm.gpu_memory_utilization 0.6 \
   --algo.kl.init_coef 1e-3 --algo.advantage.gamma 1.0 --algo.kl.use_loss --algo.kl.estimator k3 \
   --algo.advantage.estimator group_norm \
   --actor.model_name_or_path Qwen/Qwen2.5-7B-Instruct \
   --reward.remote_url /openrlhf/examples/python/reward_func.py \
   --ckpt.output_dir /openrlhf/examples/test_scripts/final/qwen2.5-7b-grpo \
   --ckpt.path /openrlhf/examples/test_scripts/ckpt/qwen2.5-7b-grpo \
   --ckpt.save_hf --train.micro_batch_size 4 --train.batch_size 128 \
   --rollout.micro_batch_size 8 --rollout.batch_size 128 --rollout.n_samples_per_prompt 8 \
   --train.max_epochs 1 --data.max_len 2048 --data.max_samples 1e8 --rollout.max_new_tokens 1024 \
   --ds.zero_stage 3 --ds.param_dtype bf16 --actor.adam.lr 5e-7 \
   --data.prompt_dataset OpenRLHF/prompt-collection-v0.1 --data.input_key context_messages --data.label_key label \
   --data.apply_chat_template --actor.gradient_checkpointing_enable --ds.packing_samples \
   --vllm.sync_backend nccl --vllm.enforce_eager --vllm.enable_sleep --ds.enable_sleep \
   --train.async_enable --train.async_queue_size 2 \
   --actor.lr_scheduler cosine_with_min_lr --actor.eps_clip_low_high 0.2 0.28 --logger.tensorboard_dir logs/grpo
"""

GRPO_0_9 = r"""
python3 -m openrlhf.cli.train_ppo_ray \
   --ref_num_nodes 1 --ref_num_gpus_per_node 8 --actor_num_nodes 1 --actor_num_gpus_per_node 8 \
   --vllm_num_engines 8 --vllm_tensor_parallel_size 1 --colocate_all_models --vllm_gpu_memory_utilization 0.6 \
   --init_kl_coef 1e-3 --gamma 1.0 --use_kl_loss --kl_estimator k3 --advantage_estimator group_norm \
   --pretrain Qwen/Qwen2.5-7B-Instruct --remote_rm_url /openrlhf/examples/python/reward_func.py \
   --save_path /openrlhf/examples/test_scripts/final/qwen2.5-7b-grpo \
   --ckpt_path /openrlhf/examples/test_scripts/ckpt/qwen2.5-7b-grpo \
   --save_hf_ckpt --micro_train_batch_size 4 --train_batch_size 128 \
   --micro_rollout_batch_size 8 --rollout_batch_size 128 --n_samples_per_prompt 8 \
   --max_epochs 1 --max_len 2048 --max_samples 1e8 --generate_max_len 1024 \
   --zero_stage 3 --bf16 --actor_learning_rate 5e-7 \
   --prompt_data OpenRLHF/prompt-collection-v0.1 --input_key context_messages --label_key label \
   --apply_chat_template --gradient_checkpointing --packing_samples \
   --vllm_sync_backend nccl --enforce_eager --vllm_enable_sleep --deepspeed_enable_sleep \
   --async_train --async_queue_size 2 \
   --lr_scheduler cosine_with_min_lr --eps_clip_low_high 0.2 0.28 --use_tensorboard logs/grpo
"""


def _argv(script: str) -> list[str]:
    tokens = shlex.split(script.replace("\\\n", " "))
    return tokens[tokens.index("openrlhf.cli.train_ppo_ray") + 1:]


def test_openrlhf_0_11_command_line_equals_the_0_9_one():
    new, old = parse_args(_argv(GRPO_0_11)), parse_args(_argv(GRPO_0_9))
    assert new.config == old.config
    assert new.explicit == old.explicit
    assert new.config.algo.advantage_estimator == "group_norm" and new.config.train.n_samples_per_prompt == 8
    assert new.config.checkpoint.save_path.endswith("final/qwen2.5-7b-grpo") and new.config.model.bf16
    # Same flags ignored, each reported under the name the user typed.
    assert len(new.ignored) == len(old.ignored)
    assert "--actor.lr_scheduler" in {line.split(":")[0] for line in new.ignored}
    assert "--lr_scheduler" in {line.split(":")[0] for line in old.ignored}
    assert new.config.train.sleep  # --ds.enable_sleep = --deepspeed_enable_sleep = --sleep, acted on



def test_docs_list_every_dotted_flag():
    doc = (Path(__file__).resolve().parents[2] / "docs" / "compat.md").read_text()
    assert not [name for name in OPENRLHF_DOTTED if f"| `--{name}` |" not in doc]


def test_is_correction_threshold_single_value_is_an_upper_bound() -> None:
    """OpenRLHF 0.11 reads `--algo.advantage.is_correction_threshold HIGH` as LOW 0 (train_ppo_ray.py)."""
    from rlrun.cli.parser import parse_args

    one = parse_args(["--algo.advantage.is_correction_threshold", "2.5", "--seed", "3"]).config
    assert one.correction.is_correction_threshold == (0.0, 2.5) and one.train.seed == 3
    assert parse_args(["--algo.advantage.is_correction_threshold=4"]).config.correction.is_correction_threshold == (0.0, 4.0)
    two = parse_args(["--algo.advantage.is_correction_threshold", "0.5", "3", "--algo.advantage.is_correction_level",
                      "seq"]).config
    assert two.correction.is_correction_threshold == (0.5, 3.0) and two.correction.is_correction_level == "seq"


def test_the_0_11_0_and_0_9_correction_spellings_map_onto_the_0_11_2_gates() -> None:
    """OpenRLHF 0.10.2-0.11.0: --algo.advantage.is_correction_enable --algo.advantage.is_correction_type T;
    0.9.4-0.10.1: --enable_vllm_is_correction --vllm_is_correction_type T --vllm_is_truncated_threshold LOW HIGH."""
    from rlrun.algo.rollout_correction import ISWeights, RolloutCorrection
    from rlrun.cli.parser import parse_args
    from rlrun.compat.correction import resolve

    dotted = parse_args(["--algo.advantage.is_correction_enable", "--algo.advantage.is_correction_type",
                         "seq-mask-tis", "--algo.advantage.is_correction_threshold", "0.5", "2"]).config
    assert resolve(dotted.correction, dotted.algo.policy_loss_type) == RolloutCorrection(
        ISWeights("token", (0.5, 2.0), "zero", "geo_mean", gate_rows=True))
    classic = parse_args(["--enable_vllm_is_correction", "--vllm_is_truncated_threshold", "0.4", "3"]).config
    assert resolve(classic.correction, "ppo") == RolloutCorrection(ISWeights("token", (0.4, 3.0), "clamp"))  # tis
