"""Value checks that run before any process group, model or dataset is touched.

Every message names the offending flag, its value and what would fix it.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from importlib.metadata import PackageNotFoundError, version

from rlrun.compat import correction
from rlrun.config.agent import RETRIEVER_RETRY_BACKOFF_S
from rlrun.config.algorithm import NEEDS_GROUPS
from rlrun.config.checkpoint import SavingConfig
from rlrun.config.model import PretrainedConfig
from rlrun.config.supervised import DPOConfig, DPOLossConfig, SupervisedConfig
from rlrun.config.training import OptimConfig
from rlrun.config.tree import Config
from rlrun.launch.layout import Layout, Role
from rlrun.models.lora import ADAPTER_CONFIG, refuse_adapter_as_reference
from rlrun.runtime.errors import ConfigError

# The file that marks a PEFT adapter directory (models/lora.py reads it; here: --pretrain may be one).


def check_sections(cfg: Config | SupervisedConfig) -> None:
    """Every section's own rules (each section's check()), in the order --help lists them."""
    for section in dataclasses.fields(cfg):
        getattr(cfg, section.name).check()


def check_save_merged(model: PretrainedConfig, saving: SavingConfig) -> None:
    """--save_merged needs adapters to merge (a saved adapter directory as --pretrain trains LoRA without --lora_rank:
    its adapter_config.json says the rank)."""
    adapter = model.pretrain is not None and os.path.isfile(os.path.join(model.pretrain, ADAPTER_CONFIG))
    if saving.save_merged and model.lora_rank == 0 and not adapter:
        raise ConfigError(
            "--save_merged writes the base model with the LoRA adapters merged in, and this run has no "
            "adapters: add --lora_rank N (e.g. 16), or drop --save_merged (without LoRA --save_path "
            "holds the full model already)"
        )


def check_values(cfg: Config) -> None:
    """Every section's own rules, then the rules across sections (none needs the layout)."""
    check_sections(cfg)
    check_save_merged(cfg.model, cfg.checkpoint)
    a, t = cfg.algo, cfg.train
    if a.advantage_estimator in NEEDS_GROUPS and t.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--advantage_estimator {a.advantage_estimator} compares samples of the same prompt and needs "
            f"--n_samples_per_prompt >= 2, got {t.n_samples_per_prompt}"
        )
    _check_algorithm_extras(cfg)
    _check_dynamic_batch(cfg)
    _check_partial_rollout(cfg)
    _check_agent(cfg)
    reward_timeout, dist_timeout = cfg.reward.reward_timeout, cfg.runtime.dist_timeout
    if reward_timeout is not None and reward_timeout >= dist_timeout:
        raise ConfigError(
            f"--reward_timeout {reward_timeout:g} must be below --dist_timeout {dist_timeout:g}: the other ranks wait "
            "at most --dist_timeout for the rewards, so a slower reward function would end the run as a collective "
            "timeout instead of naming itself; raise --dist_timeout too, or lower --reward_timeout"
        )
    _check_reward_source(cfg)


def _check_algorithm_extras(cfg: Config) -> None:
    """The algorithm's rules that need the batch, the lengths or the backend (part of check_values)."""
    a, t = cfg.algo, cfg.train
    if a.dynamic_filtering and t.n_samples_per_prompt < 2:
        raise ConfigError(
            f"--dynamic_filtering drops prompt groups by their mean score and needs "
            f"--n_samples_per_prompt >= 2, got {t.n_samples_per_prompt}"
        )
    if a.overlong_buffer_len is not None and not 0 < a.overlong_buffer_len <= cfg.generation.generate_max_len:
        raise ConfigError(
            f"--overlong_buffer_len {a.overlong_buffer_len} must be in (0, --generate_max_len "
            f"{cfg.generation.generate_max_len}]; the penalty ramps over the last N tokens"
        )
    correction.check(cfg.correction, a.policy_loss_type)
    if (flags := correction_flags(cfg)) and cfg.generation.generation_backend == "hf":
        raise ConfigError(
            f"{flags} corrects the engine/actor log-prob mismatch with the engine's sampled-token log-probs, which "
            "--generation_backend hf does not report; use --generation_backend vllm or native, or drop the flag"
        )


def correction_flags(cfg: Config) -> str:
    """The flags that turn this run's rollout correction on, as typed ("" when none does)."""
    return correction.flags(cfg.correction, cfg.algo.policy_loss_type)


def _check_dynamic_batch(cfg: Config) -> None:
    """--dynamic_batch's token budgets must hold the longest row a step can have (one row is never split)."""
    t, g = cfg.train, cfg.generation
    longest = g.prompt_max_len + g.generate_max_len
    for name in ("train_max_tokens_per_gpu", "rollout_max_tokens_per_gpu"):
        value = getattr(t, name)
        if value is not None and t.dynamic_batch and value < longest:
            raise ConfigError(
                f"--{name} {value} is below the longest possible sequence, --prompt_max_len "
                f"{g.prompt_max_len} + --generate_max_len {g.generate_max_len} = {longest} tokens, and "
                f"--dynamic_batch never splits a sequence: raise --{name} to at least {longest}, or "
                "lower the lengths"
            )


REWARD_SOURCES = (
    "--reward_pretrain DIR (a reward model), --remote_rm_url FILE.py or URL (OpenRLHF's reward_func), "
    "--compute_score FILE.py or builtin (verl's compute_score, or its rule scores by data_source), or an "
    "agent (--agent_func_path, --retriever_url)"
)


def _check_partial_rollout(cfg: Config) -> None:
    """--partial_rollout streams single responses between engines and learners on ranks of their own."""
    if cfg.train.partial_rollout and cfg.agent.multi_turn:
        raise ConfigError(
            "--partial_rollout does not run agents (--agent_func_path / multi-turn episodes): an episode "
            "is not split at a weight sync; drop --partial_rollout (--async_train alone runs agents)"
        )


def _check_reward_source(cfg: Config) -> None:
    """Exactly one reward source, never a guessed one: the demo rule scores only the demo's own prompts and
    model, so labelled data or a real model without a source is an error, not a run that learns nothing."""
    if cfg.reward.sources() or cfg.agent.multi_turn or cfg.distills_alone:
        return
    pretrain = cfg.model.pretrain
    if cfg.data.prompt_data is not None or pretrain is not None:
        what = " and ".join(
            f"--{k} {v}" for k, v in (("pretrain", pretrain), ("prompt_data", cfg.data.prompt_data)) if v is not None
        )
        raise ConfigError(
            f"no reward source for {what}: pass {REWARD_SOURCES}. (rlrun does not guess one: its demo "
            f"rule, "
            "--remote_rm_url demo, only fits the demo's built-in prompts.)"
        )


def _check_agent(cfg: Config) -> None:
    """An agent's episodes against the engine, the reward sources and the correction."""
    ag, m = cfg.agent, cfg.reward
    tp = cfg.resources.vllm_tensor_parallel_size
    if cfg.agent.multi_turn and tp > 1 and cfg.generation.generation_backend == "vllm":
        # The engine's ranks share one vLLM engine call by call; episodes end after different numbers of turns on
        # different ranks, so those calls would not line up.
        raise ConfigError(
            f"multi-turn agent episodes (--agent_func_path/--retriever_url) with --generation_backend "
            f"vllm "
            f"--vllm_tensor_parallel_size {tp} are not supported yet; use --vllm_tensor_parallel_size 1 "
            "(more engines instead of wider ones), or --generation_backend hf"
        )
    if not cfg.agent.multi_turn:
        return
    if ag.env_id is not None and cfg.data.prompt_data is not None:
        raise ConfigError(
            f"--env_id {ag.env_id} with --prompt_data {cfg.data.prompt_data}: the taskset's tasks are the prompts; "
            "drop --prompt_data (--env_args chooses the taskset's split or subset)"
        )
    if ag.environment_factory is not None and m.reward_pretrain is not None:
        raise ConfigError(
            f"--reward_pretrain {m.reward_pretrain} with --environment_factory: a reward model is not one of TRL's "
            "reward sources here; score with get_reward() or --remote_rm_url FILE.py"
        )
    if (m.names_reward_function and not ag.adds_reward_function) or m.reward_pretrain is not None:
        source = (
            f"--remote_rm_url {m.remote_rm_url}"
            if m.remote_rm_url is not None
            else f"--reward_pretrain {m.reward_pretrain}"
            if m.reward_pretrain is not None
            else f"--compute_score {m.compute_score}"
        )
        raise ConfigError(
            f"{source} with an agent: the agent's step rewards are the reward (as OpenRLHF's "
            "--agent_func_path); score inside the agent, or drop the agent"
        )
    if ag.retriever_url is not None:
        tries = m.remote_rm_retries
        worst = tries * ag.retriever_timeout + RETRIEVER_RETRY_BACKOFF_S * (2 ** (tries - 1) - 1)
        if ag.agent_timeout <= worst:
            raise ConfigError(
                f"--agent_timeout {ag.agent_timeout:g}s is shorter than the retriever's worst case "
                f"({tries} tries x --retriever_timeout {ag.retriever_timeout:g}s + backoff = "
                f"{worst:g}s), "
                "so a retriever that is down would be reported as a slow agent; raise --agent_timeout "
                f"above {worst:g} or lower --retriever_timeout / --remote_rm_retries"
            )
    if not ag.state_masking and (flags := correction_flags(cfg)):
        raise ConfigError(
            "--state_masking false trains on observation tokens, which the engine did not sample and "
            f"has no log-probs for; {flags} needs those: drop one of the two"
        )


def check_batches(cfg: Config, role_sizes: dict[str, int]) -> None:
    """Batch sizes must split evenly over each role's ranks (FSDP ranks must run the same number
    of forward passes, or the job hangs). role_sizes: role name -> number of ranks."""
    t = cfg.train
    rollouts = cfg.train.rollouts_per_step
    for role, size in role_sizes.items():
        if rollouts % size:
            raise ConfigError(
                f"{rollouts} rollouts per step (--rollout_batch_size {t.rollout_batch_size} x "
                f"--n_samples_per_prompt {t.n_samples_per_prompt}) do not split evenly over the {size} {role} ranks; "
                f"make the rollouts a multiple of {size}"
            )
    if rollouts % t.train_batch_size:
        raise ConfigError(
            f"--train_batch_size {t.train_batch_size} must divide the {rollouts} rollouts per step "
            f"(--rollout_batch_size {t.rollout_batch_size} x --n_samples_per_prompt {t.n_samples_per_prompt})"
        )
    for role in ("actor", "critic"):
        ranks = role_sizes.get(role)
        if ranks and t.dynamic_batch and t.train_batch_size % ranks:  # micro-batches by tokens: only the rows split
            raise ConfigError(
                f"--train_batch_size {t.train_batch_size} must be a multiple of the {ranks} {role} ranks "
                "(--dynamic_batch deals each mini-batch's rows evenly over them)"
            )
        if ranks and not t.dynamic_batch and t.train_batch_size % (t.micro_train_batch_size * ranks):
            raise ConfigError(
                f"--train_batch_size {t.train_batch_size} must be a multiple of --micro_train_batch_size "
                f"{t.micro_train_batch_size} x {ranks} {role} ranks = {t.micro_train_batch_size * ranks}"
            )


# ---- supervised trainers -----------------------------------------------------------------------------------------
# Checks of a supervised trainer's settings, on every rank before any process group, model or file is touched.


def check_supervised(cfg: SupervisedConfig, world_size: int, prog: str) -> None:
    """Every section's own rules, then the dataset, the ranks and the strategy."""
    t, d = cfg.train, cfg.data
    if d.dataset is None:
        raise ConfigError(
            f"{prog} needs --dataset: a local .jsonl/.json/.parquet/.csv file or saved HF datasets directory"
        )
    check_sections(cfg)
    check_save_merged(cfg.model, cfg.checkpoint)
    sp = t.sequence_parallel_size
    if world_size % sp:
        raise ConfigError(
            f"--sequence_parallel_size {sp} does not divide the {world_size} ranks (blocks of {sp} consecutive ranks "
            f"share each sample); use a divisor of {world_size}, or launch a multiple of {sp} ranks"
        )
    dp = world_size // sp
    if t.train_batch_size % dp:
        shares = f"{dp} data-parallel shares ({world_size} ranks / --sequence_parallel_size {sp})" if sp > 1 else ""
        raise ConfigError(
            f"--train_batch_size {t.train_batch_size} must be a multiple of the "
            + (shares or f"{world_size} ranks")
            + f" (each takes an equal share of every batch); use e.g. {max(1, t.train_batch_size // dp) * dp}"
        )
    if t.strategy == "deepspeed":
        check_deepspeed_install()
        check_deepspeed_settings(
            t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint
        )
    if isinstance(cfg, DPOConfig) and cfg.loss.ref_offload and t.strategy == "fsdp" and t.zero_stage < 3:
        # Below ZeRO-3 the frozen reference is kept whole on every GPU (rlrun.strategies.fsdp), so there is no
        # sharded copy for FSDP2's CPU offload to hold: the flag would do nothing.
        raise ConfigError(
            f"--ref_offload needs --zero_stage 3 with --strategy fsdp (at --zero_stage {t.zero_stage} the reference "
            "stays whole on each GPU, so nothing would be offloaded); add --zero_stage 3 or drop --ref_offload"
        )


# ---- strategies --------------------------------------------------------------------------------------------------
# Strategy rules that need the layout, checked in planning on every rank before any group or model exists.

# The DeepSpeed releases rlrun's adapter was tested with (it relies on mpu, explicit accumulation boundaries,
# safe_get/set_full_*, the ZeRO-1/2 optimizer's partition attributes and ZeRO-3's flat fp32 sub-groups).
# Same range as setup.cfg's extra.
DEEPSPEED_TESTED = ((0, 19, 8), (0, 20, 0))
SHARDED_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)


def reference_is_base(model: PretrainedConfig, loss: DPOLossConfig) -> bool:
    """DPO with --lora_rank and no other --ref_pretrain: the reference is the policy's own base (adapters disabled),
    the initial policy, so no reference copy is built (verl, TRL). A --ref_pretrain naming another model is still
    loaded as a separate frozen reference, as OpenRLHF does (it always builds one)."""
    if model.lora_rank <= 0:
        return False
    ref, pretrain = loss.ref_pretrain, model.pretrain
    return (
        ref is None or ref == pretrain or (pretrain is not None and os.path.realpath(ref) == os.path.realpath(pretrain))
    )


def check_lora(cfg: SupervisedConfig) -> None:
    """What LoRA asks of the supervised trainers beyond the model section's own rules, checked with the command line on
    every rank (after --pretrain is resolved to a local path), before any model is built."""
    if isinstance(cfg, DPOConfig) and reference_is_base(cfg.model, cfg.loss):
        refuse_adapter_as_reference(cfg.model.pretrain, "DPO scores its reference with the policy's adapters off")


def _version_tuple(text: str) -> tuple[int, ...]:
    parts = []
    for piece in text.split("+")[0].split(".")[:3]:
        digits = "".join(ch for ch in piece if ch.isdigit())
        parts.append(int(digits or 0))
    return tuple(parts)


def _ranks(ranks: tuple[int, ...]) -> str:
    if len(ranks) > 1 and ranks == tuple(range(ranks[0], ranks[-1] + 1)):
        return f"ranks {ranks[0]}-{ranks[-1]}"
    return f"rank{'s' if len(ranks) > 1 else ''} {', '.join(map(str, ranks))}"


def check_strategy(cfg: Config, layout: Layout) -> None:
    """--strategy deepspeed: installed in the tested range; ZeRO-3 only where every sharded role spans the world."""
    t = cfg.train
    if t.strategy != "deepspeed":
        return
    check_deepspeed_install()
    if t.zero_stage == 3:
        roles = [r for r in SHARDED_ROLES if layout.has(r)]
        narrow = [r for r in roles if len(layout.ranks_of(r)) < layout.world_size]
        if narrow:
            role = narrow[0]
            raise ConfigError(
                f"--strategy deepspeed --zero_stage 3 needs the role ({role.value}: {_ranks(layout.ranks_of(role))}) "
                f"to "
                f"span all {layout.world_size} ranks: DeepSpeed ZeRO-3 calls world-wide barriers at init and "
                f"broadcasts "
                "from global rank 0 in its forward hooks (deepspeed/runtime/zero/stage3.py:914, "
                "partitioned_param_coordinator.py:260), which deadlock when other roles train on other ranks. "
                "Use --strategy fsdp --zero_stage 3 (comparable memory profile, works on role groups)."
            )
    check_deepspeed_settings(t, cfg.model.bf16, saves=cfg.checkpoint.save_steps > 0 or cfg.checkpoint.load_checkpoint)


def check_deepspeed_install() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        raise ConfigError(
            "--strategy deepspeed needs DeepSpeed: pip install 'rlrun[deepspeed]' "
            "(deepspeed>=0.19.8,<0.20), "
            "or use --strategy fsdp"
        )
    try:
        found = version("deepspeed")
    except PackageNotFoundError:
        found = "unknown"
    low, high = DEEPSPEED_TESTED
    if not low <= _version_tuple(found) < high:
        raise ConfigError(
            f"--strategy deepspeed is tested with deepspeed>=0.19.8,<0.20, found {found}: "
            "pip install 'rlrun[deepspeed]', or use --strategy fsdp"
        )


def check_deepspeed_settings(train: OptimConfig, bf16: bool, *, saves: bool) -> None:
    """The --strategy deepspeed rules that hold whatever the layout (every model on every rank included)."""
    if train.zero_stage == 0 and train.adam_offload:
        raise ConfigError(
            "--strategy deepspeed --zero_stage 0 --adam_offload: DeepSpeed offloads the optimizer only "
            "at "
            "ZeRO stages 1-3 (at stage 0 DeepSpeedCPUAdam would receive GPU parameters and assert); use "
            "--zero_stage 1 or 2 with --adam_offload, or drop --adam_offload"
        )
    if train.zero_stage == 0 and bf16 and saves:
        raise ConfigError(
            "--strategy deepspeed --zero_stage 0 --bf16 cannot save or load checkpoints yet (its fp32 "
            "master "
            "weights are not reachable by parameter); use --zero_stage 1 or 2, or drop --save_steps/"
            "--load_checkpoint"
        )
