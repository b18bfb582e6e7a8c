"""The one typed configuration tree.

Sources, later wins: dataclass defaults < YAML file (``--config x.yaml``) < CLI flags.
Every field is a flag of the same name (OpenRLHF's ``train_ppo_ray`` names where one exists), so a field is defined
exactly once: here (the sections every trainer reads, then rlrun.ppo's), or for the supervised trainers in
``rlrun.config.supervised``. ``rlrun.cli.parser`` builds the parser from it, through ``rlrun.config.fields`` (the
fields by flag name, value coercion, building and redacting a config). A component receives its own section; the
properties that need two sections are on ``Config``.
"""

from __future__ import annotations

import typing
from dataclasses import dataclass, field
from typing import Any, Literal

# ---- declaring a field -------------------------------------------------------------------------------------------
# `opt`: how every config field is declared (its default and its help text, which is its flag's help).


def opt(default: Any, help: str, *, secret: bool = False, metavar: str | None = None) -> Any:
    """A config field with its help text (every flag has one)."""
    meta = {"help": help, "secret": secret, "metavar": metavar}
    if isinstance(default, (list, dict, set)):
        return field(default_factory=lambda: type(default)(default), metadata=meta)
    return field(default=default, metadata=meta)


# ---- rlrun.ppo's sections ----------------------------------------------------------------------------------------
# The PPO-only sections of the config tree (rlrun.config.schema.Config): the role layout, generation, the
# algorithm and multi-turn agents. Every field is a flag of the same name, as in rlrun.config.schema.

AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"]
GROUP_ESTIMATORS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"})
NEEDS_GROUPS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})
# rlrun.algo.policy_losses.PolicyLossType, named here so that reading a config imports no torch (a test keeps the
# two equal).
PolicyLossType = Literal[
    "ppo", "gspo", "cispo", "sapo", "gpg", "clip_cov", "kl_cov", "geo_mean", "dppo_tv", "dppo_kl", "dro"
]


@dataclass
class ResourceConfig:
    """Role layout. 'gpus' in these OpenRLHF flags means ranks. No sizes given: every role on every rank."""

    actor_num_nodes: int | None = opt(None, "Nodes for the actor (ranks = nodes x gpus_per_node).")
    actor_num_gpus_per_node: int | None = opt(None, "Ranks per node for the actor.")
    critic_num_nodes: int | None = opt(None, "Nodes for the critic.")
    critic_num_gpus_per_node: int | None = opt(None, "Ranks per node for the critic.")
    ref_num_nodes: int | None = opt(None, "Nodes for the reference model.")
    ref_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reference model.")
    teacher_num_nodes: int | None = opt(None, "Nodes for the distillation teacher (--teacher_pretrain).")
    teacher_num_gpus_per_node: int | None = opt(None, "Ranks per node for the distillation teacher.")
    reward_num_nodes: int | None = opt(None, "Nodes for the reward model.")
    reward_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reward model.")
    vllm_num_engines: int | None = opt(
        None,
        "Number of generation engines on their own ranks (whatever the backend). "
        "Unset: engines share the actor's ranks.",
    )
    vllm_tensor_parallel_size: int = opt(1, "Ranks per generation engine.")
    colocate_actor_ref: bool = opt(False, "Reference model on the actor's ranks (same processes).")
    colocate_actor_teacher: bool = opt(False, "Distillation teacher on the actor's ranks (same processes).")
    colocate_critic_reward: bool = opt(False, "Reward model on the critic's ranks.")
    colocate_all_models: bool = opt(False, "Every role, engines included, on the same ranks.")
    ref_sequence_parallel_size: int | None = opt(None, "The reference model's (unset: --sequence_parallel_size).")
    critic_sequence_parallel_size: int | None = opt(None, "The critic's (unset: --sequence_parallel_size).")
    actor_node_label: str | None = opt(
        None, "Put the actor on nodes with this label (each node's RLRUN_NODE_LABEL, else its host name)."
    )
    critic_node_label: str | None = opt(
        None, "Put the critic on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    teacher_node_label: str | None = opt(None, "Put the distillation teacher on nodes with this label.")
    ref_node_label: str | None = opt(
        None, "Put the reference model on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    reward_node_label: str | None = opt(
        None, "Put the reward model on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )
    engine_node_label: str | None = opt(
        None, "Put the generation engines on nodes with this label (RLRUN_NODE_LABEL, else the host name)."
    )


@dataclass
class GenerationConfig:
    """Rollout generation."""

    generation_backend: Literal["auto", "native", "hf", "vllm"] = opt(
        "auto",
        "native: rlrun's own KV-cache decoder (Llama, Qwen2, Qwen3, Mistral; reports sampled-token log-probs); "
        "hf: transformers generate; vllm: vLLM engines; auto: vllm when it is installed and a GPU is present, else "
        "native "
        "when the model's architecture allows it, else hf.",
    )
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling threshold.")
    prompt_max_len: int = opt(1024, "Max prompt tokens.")
    prompt_overflow: Literal["truncate", "drop"] = opt(
        "truncate",
        "Prompts longer than --prompt_max_len: keep the "
        "last tokens, or drop the record (counted in the "
        "log either way).",
    )
    generate_max_len: int = opt(1024, "Max new tokens per response.")
    native_kv_cache_mb: int | None = opt(
        None,
        "--generation_backend native: the KV cache budget of each engine rank "
        "in "
        "MiB; a rank's rollouts are generated in batches whose cache fits it. "
        "Default: "
        "on GPU from the memory free when generation starts (less the activations), "
        "on CPU unbounded (one batch).",
    )
    native_cuda_graph: bool = opt(
        False,
        "--generation_backend native on GPU: capture each decode step as a CUDA graph "
        "and replay it per token (fewer kernel launches; the step attends over the filled "
        "cache rounded up to 256 positions, one graph per span). rlrun.ppo: on by default with a "
        "CUDA device where the policy allows it (not MoE, not dynamic rope). No effect on CPU.",
    )
    vllm_gpu_memory_utilization: float = opt(
        0.95,
        "vLLM gpu_memory_utilization (GPU: the fraction of the whole GPU "
        "one engine "
        "rank may use; lower it when the actor shares the GPU, e.g. 0.3-0.5).",
    )
    vllm_kv_cache_memory_bytes: int | None = opt(
        None,
        "GPU: the KV cache size of each vLLM engine rank in bytes, "
        "instead of "
        "sizing it from --vllm_gpu_memory_utilization (more robust when "
        "trainer "
        "models share the GPU). CPU: no effect (VLLM_CPU_KVCACHE_SPACE sizes "
        "it).",
    )
    vllm_enable_sleep: bool = opt(
        False,
        "GPU: vLLM sleeps (level 1: weights to host memory, KV cache freed) after "
        "each "
        "generate call and wakes for the next weight push; CPU: no effect (vLLM has no "
        "sleep mode there).",
    )
    vllm_sync_backend: Literal["nccl", "gloo"] = opt("nccl", "Backend of the actor->engine weight-sync group on GPU.")
    enforce_eager: bool = opt(False, "Disable CUDA graphs in vLLM (always eager on CPU).")
    vllm_engine_host: Literal["auto", "child", "in_process"] = opt(
        "auto",
        "Where each vLLM engine runs. in_process: inside the rank (vLLM's external_launcher), only when the "
        "engine ranks are the whole world (colocate all, or 1 rank); child: a spawned child process per engine "
        "(any layout); auto: in_process when the layout allows it, else child.",
    )
    vllm_seeded_requests: bool = opt(
        False,
        "Give every vLLM request its own seed: a row's sample then does not depend "
        "on the other rows of its generate call (batch size, order, host), but vLLM draws "
        "seeded rows' noise one row at a time, which is slower on big batches. Off: "
        "requests "
        "carry no seed and vLLM samples the whole batch at once, from one seed per call "
        "(a run "
        "repeated on the same hardware samples alike; a row's sample depends on its "
        "batch).",
    )
    weight_sync_bucket_mb: int = opt(256, "Size of each actor->engine weight-sync bucket (MiB).")


@dataclass
class AlgorithmConfig:
    """Advantages, KL and losses."""

    advantage_estimator: AdvantageEstimator = opt(
        "gae", "gae (PPO), group_norm (GRPO), dr_grpo, rloo, reinforce (REINFORCE++), reinforce_baseline."
    )
    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss).")
    kl_target: float | None = opt(None, "Adaptive KL: target KL (unset: fixed coefficient).")
    kl_horizon: int = opt(10000, "Adaptive KL horizon.")
    kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "KL estimator (Schulman's k1/k2/k3); every estimate is clamped to [-10, 10] as in OpenRLHF."
    )
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty (GRPO).")
    gamma: float = opt(
        1.0,
        "Discount factor (gae, reinforce). group_norm, dr_grpo, rloo and reinforce_baseline "
        "always use 1.0, as in OpenRLHF.",
    )
    lambd: float = opt(1.0, "GAE lambda.")
    eps_clip: float = opt(0.2, "PPO clip range.")
    eps_clip_low_high: tuple[float, float] | None = opt(
        None,
        "Asymmetric PPO clip: the ratio is clipped to [1 - LOW, "
        "1 + HIGH] (DAPO clip-higher). Unset: (eps_clip, "
        "eps_clip).",
    )
    policy_loss_type: PolicyLossType = opt(
        "ppo",
        "The policy loss (verl's policy_loss.loss_mode; rlrun.algo.policy_losses): ppo (clipped ratio); gspo (one "
        "ratio per sequence, use a small --eps_clip_low_high, e.g. 3e-4 4e-4); cispo (REINFORCE weighted by the "
        "clipped, detached ratio: verl's example clips 10 0.2); sapo (a soft sigmoid gate, --sapo_tau_pos/neg); gpg "
        "(-A log pi); clip_cov / kl_cov (covariance-selected tokens detached / penalised); geo_mean (GMPO, the "
        "--eps_clip_low_high pair as log-space bounds, e.g. 0.4 0.4); dppo_tv / dppo_kl (probability trust region, "
        "the pair as thresholds, e.g. 0.15 / 0.05; --dual_clip caps the ratio, default 3); dro (quadratic penalty, "
        "--dro_beta).",
    )
    sapo_tau_pos: float = opt(1.0, "sapo: the gate's temperature for tokens with a positive advantage.")
    sapo_tau_neg: float = opt(1.05, "sapo: the gate's temperature for the other tokens.")
    clip_cov_ratio: float = opt(2e-4, "clip_cov: share of a micro-batch's tokens whose gradient is detached (>= 1).")
    clip_cov_bounds: tuple[float, float] = opt(
        (1.0, 5.0), "clip_cov: LB UB, the covariance window of the tokens it may detach."
    )
    kl_cov_ratio: float = opt(2e-4, "kl_cov: share of a micro-batch's tokens given the |log-ratio| penalty (>= 1).")
    kl_cov_coef: float = opt(0.1, "kl_cov: the penalty's weight (verl's policy_loss.ppo_kl_coef).")
    dro_beta: float | None = opt(None, "dro: the weight of its (log pi - log pi_old)^2 / 2 penalty (required, > 0).")
    dual_clip: float | None = opt(
        None, "Dual-clip constant (> 1; ppo, gspo). dppo_tv / dppo_kl: the cap of the truncated ratio (unset: 3)."
    )
    value_clip: float | None = opt(0.5, "Value clip range (unset: no clipping).")
    normalize_reward: bool = opt(
        False,
        "As OpenRLHF: (score - mean) / std with the mean/std stored in the reward "
        "model's config.json (absent: 0/1); critic values get their model config's "
        "mean/std too. Reward functions and HTTP rewards are untouched.",
    )
    running_reward_norm: bool = opt(
        False, "rlrun: standardise every score with a running mean/std over all steps so far (kept in checkpoints)."
    )
    overlong_buffer_len: int | None = opt(
        None,
        "DAPO overlong penalty: responses longer than generate_max_len - N "
        "tokens lose up to --overlong_penalty_factor, linearly over the last "
        "N tokens. Unset: off.",
    )
    overlong_penalty_factor: float = opt(1.0, "Largest overlong penalty (reached at generate_max_len tokens).")
    stop_properly_penalty_coef: float | None = opt(
        None,
        "ProRL: rewards of responses cut off at generate_max_len "
        "without EOS are multiplied by this (in [0, 1]) or, if "
        "negative, replaced by it. Unset: off.",
    )
    dynamic_filtering: bool = opt(
        False,
        "DAPO dynamic sampling: prompt groups whose mean score is not strictly "
        "inside --dynamic_filtering_reward_range are left out of the update (rlrun "
        "keeps the batch shape and masks them out instead of re-sampling). Needs "
        "--n_samples_per_prompt > 1.",
    )
    dynamic_filtering_reward_range: tuple[float, float] = opt(
        (0.0, 1.0), "Keep a prompt group when LOW < mean score < HIGH (--dynamic_filtering)."
    )
    reward_clip_range: tuple[float, float] = opt((-10.0, 10.0), "Clip scores to this range.")
    entropy_loss_coef: float | None = opt(None, "Entropy bonus coefficient (0 logs entropy only).")
    no_advantage_std_norm: bool = opt(
        False, "gae/reinforce/reinforce_baseline: only subtract the advantage mean, do not divide by its std."
    )
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = opt(
        "token-mean", "How per-token losses are averaged."
    )
    is_correction_level: Literal["off", "token", "seq"] = opt(
        "off",
        "Correct the engine/actor log-prob mismatch "
        "(OpenRLHF 0.11 "
        "--algo.advantage.is_correction_level; needs "
        "--generation_backend vllm): gate each token, or "
        "each sequence's mean, on the statistic below.",
    )
    is_correction_mode: Literal["mask", "clip"] = opt(
        "mask",
        "mask: drop units outside the threshold (survivors keep "
        "their weight pi_train/pi_rollout); clip: clamp the "
        "token weight into it (token level, ratio gating).",
    )
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = opt(
        "ratio",
        "Statistic the gate reads: the weight "
        "pi_train/pi_rollout itself, or the "
        "sampled token's binary KL / total "
        "variation between the two.",
    )
    is_correction_threshold: tuple[float, float] = opt(
        (0.5, 5.0),
        "LOW HIGH bounds of the gated statistic (0 HIGH for an upper bound only, required for binary_kl/tv).",
    )

    aux_loss_coef: float = opt(
        0.0,
        "MoE policies: weight of the load-balancing loss added to the actor's (transformers' aux_loss, the "
        "Switch-Transformer form, over the micro-batch's real tokens; OpenRLHF's --aux_loss_coef). 0: none.",
    )
    router_replay: Literal["off", "R2", "R3"] = opt(
        "off",
        "MoE policies: R3 records the experts each token went through when the engine sampled it and routes the "
        "actor's and reference's forwards through the same ones (the router's probabilities still train; verl's "
        "actor_rollout_ref.actor.router_replay.mode). R2 records them in the actor's scoring pass and replays them "
        "in its training passes (any engine). off: each forward routes by itself.",
    )
    teacher_kl_coef: float = opt(
        1.0,
        "--teacher_pretrain: weight of the teacher signal: with --teacher_kl_loss false each token's advantage gets "
        "-coef * D (D: --teacher_kl_estimator of log pi_old - log pi_teacher; Thinking Machines, slime --opd-kl-coef, "
        "verl's policy-gradient OPD); with true, coef * D(log pi - log pi_teacher) joins the loss (verl's GKD OPD).",
    )
    teacher_kl_estimator: Literal["k1", "k2", "k3"] = opt(
        "k1", "The per-token divergence to the teacher (k1 = log-ratio: the reverse KL's sample; k2, k3 as for the KL)."
    )
    teacher_kl_loss: bool = opt(
        False, "Backpropagate the divergence to the teacher as a loss term instead of adding it to the advantages."
    )
    teacher_kl_clamp: float | None = opt(
        None, "Clamp each token's divergence to [-C, C] before use (verl's loss_max_clamp). Unset: no clamp."
    )
    teacher_temperature: float = opt(1.0, "The teacher's logits are divided by this (verl forces 1).")
    distill_task_reward: bool = opt(
        True,
        "--teacher_pretrain: also learn from the reward (false: only from the teacher; the reward is still computed "
        "and logged; verl's use_task_rewards).",
    )
    enable_vllm_is_correction: bool = opt(
        False,
        "OpenRLHF 0.9.4-0.11.0's correction switch (--algo.advantage.is_correction_enable): token weights "
        "pi_actor / pi_engine by --vllm_is_correction_type within --is_correction_threshold LOW HIGH.",
    )
    vllm_is_correction_type: Literal["tis", "icepop", "seq-mask-tis"] = opt(
        "tis",
        "--enable_vllm_is_correction's kind: tis clamps each token's weight, icepop zeroes those outside, "
        "seq-mask-tis zeroes whole sequences whose geometric-mean ratio is outside (= --is_correction_level "
        "token/token/seq with --is_correction_mode clip/mask/mask).",
    )
    rollout_correction: str | None = opt(
        None,
        "A verl rollout-correction preset by name (RolloutCorrectionConfig's constructors: decoupled_token_is, "
        "decoupled_seq_is, decoupled_token_icepop, decoupled_geo_rs, bypass_ppo_clip, bypass_pg_is, ...; "
        "rlrun.algo.rollout_correction.VERL_PRESETS); instead of the --rollout_is/--rollout_rs flags.",
    )
    rollout_is: Literal["off", "token", "sequence"] = opt(
        "off",
        "verl's rollout_correction.rollout_is: importance weights pi_actor / pi_engine per token, or the sequence's "
        "product on each of its tokens (needs the engine's log-probs: native or vllm).",
    )
    rollout_is_threshold: str = opt(
        "2.0",
        "--rollout_is's bound: a number truncates the weights above it (TIS); LOW_HIGH (e.g. 0.5_5.0) zeroes those "
        "outside (IcePop).",
    )
    rollout_is_batch_normalize: bool = opt(False, "Divide the --rollout_is weights by their batch mean.")
    rollout_rs: str | None = opt(
        None,
        "verl's rejection sampling: comma list of token_k1/k2/k3, seq_sum_k1/k2/k3, seq_mean_k1/k2/k3, "
        "seq_max_k2/k3; tokens (or sequences) whose mismatch is outside --rollout_rs_threshold leave the update.",
    )
    rollout_rs_threshold: str | None = opt(
        None, "--rollout_rs bounds, one or one per option: k1 LOW_HIGH (or HIGH: LOW = 1/HIGH), k2/k3 HIGH."
    )
    rollout_bypass: bool = opt(
        False,
        "verl's bypass_mode: the loss's old log-probs are the engine's (no actor scoring pass unless the KL "
        "penalty needs it); weights and rejections from the current policy per micro-batch.",
    )
    rollout_bypass_loss: Literal["ppo_clip", "reinforce"] = opt(
        "ppo_clip",
        "--rollout_bypass: ppo_clip (the clipped ratio against the engine; weights only logged) or reinforce "
        "(-A log pi times the --rollout_is weights).",
    )

    @property
    def needs_critic(self) -> bool:
        return self.advantage_estimator not in GROUP_ESTIMATORS

    @property
    def needs_ref(self) -> bool:
        """A KL term needs reference log-probs (from a reference model, or from the LoRA actor's base)."""
        return self.init_kl_coef > 0 or self.use_kl_loss


RETRIEVER_RETRY_BACKOFF_S = 0.5  # the retriever client sleeps this * 2**(k-1) before retry k


@dataclass
class AgentConfig:
    """Multi-turn agent rollouts: an environment answers each model turn (observation tokens are not actions)."""

    agent_func_path: str | None = opt(
        None,
        "OpenRLHF agent file (.py) defining AgentInstance (reset/step, async) and "
        "usually AgentExecutor; its rewards replace any reward source. Turns: see "
        "--max_turns.",
    )
    retriever_url: str | None = opt(
        None,
        "Built-in Search-R1 agent: the retrieval server's POST URL (e.g. "
        "http://127.0.0.1:8000/retrieve, see python -m rlrun.retriever_server); "
        "reward = exact match of the last <answer> against the label's golden "
        "answers.",
    )
    retriever_topk: int = opt(3, "Search-R1 agent: passages per search.")
    retriever_timeout: float = opt(
        10.0,
        "Search-R1 agent: seconds per retrieval request (tried --remote_rm_retries "
        "times with backoff, then the run fails naming the URL); all tries must fit "
        "in --agent_timeout.",
    )
    max_turns: int | None = opt(
        None,
        "Most model turns per episode (each turn generates, then the agent steps). "
        "Unset: until the agent says done or --generate_max_len is used up. Search-R1's "
        "max_turns=K is K search turns plus a final answer turn, i.e. --max_turns K+1.",
    )
    max_tokens_per_turn: int | None = opt(
        None,
        "Most tokens generated in one turn (Search-R1's per-turn "
        "max_response_length). Unset: what is left of --generate_max_len.",
    )
    max_obs_len: int | None = opt(
        None,
        "Most tokens of one observation (verl/Search-R1 max_obs_length); longer ones "
        "keep their first tokens and are counted in agent/obs_truncated.",
    )
    state_masking: bool = opt(
        True,
        "Observation tokens carry no loss, KL or advantage (Search-R1 state_masking). "
        "false: they are trained on like generated tokens.",
    )
    agent_timeout: float = opt(60.0, "Seconds one agent reset() or step() call may take before the run fails.")
    agent_max_concurrency: int = opt(64, "Agent calls of one engine rank that run at once (asyncio).")

    @property
    def multi_turn(self) -> bool:
        """Rollouts are agent episodes (their rewards are the reward)."""
        return self.agent_func_path is not None or self.retriever_url is not None


@dataclass
class PretrainedConfig:
    """The model being trained: where it comes from and how it runs (every trainer)."""

    pretrain: str | None = opt(
        None, "Model to train: a local HF directory. Unset: the embedded tiny model (see --model_preset)."
    )
    model_preset: Literal["tiny", "3m", "100m", "0.5b", "tiny-vl"] = opt(
        "tiny",
        "Random-init model shape used when "
        "--pretrain is unset (offline demo "
        "and benchmarks). tiny-vl "
        "(rlrun.ppo): a tiny Qwen2.5-VL and, "
        "without --prompt_data, its image "
        "task (configs/vlm_demo.yaml), built "
        "into RLRUN_CACHE (default "
        "~/.cache/rlrun) on first use.",
    )
    bf16: bool = opt(False, "bf16 mixed precision (on GPU; CPU training stays fp32).")
    flash_attn: bool = opt(False, "Use flash-attention 2 (needs the flash-attn extra and a GPU).")
    attn_implementation: str | None = opt(None, "HF attn_implementation override (eager, sdpa, flash_attention_2).")
    gradient_checkpointing: bool = opt(False, "Recompute activations in the backward pass to save memory.")
    lora_rank: int = opt(
        0, "LoRA rank (PEFT adapters on the trained models; the base weights stay frozen). 0: train every weight."
    )
    lora_alpha: int = opt(16, "LoRA alpha: the adapter's update is scaled by alpha / rank.")
    target_modules: tuple[str, ...] = opt(
        ("all-linear",),
        "Modules that get LoRA adapters: module names (q_proj "
        "v_proj ...) or all-linear (every linear layer but the "
        "output head), as PEFT's target_modules.",
    )
    lora_dropout: float = opt(0.0, "Dropout on the LoRA adapters' input during training.")


# --model_preset of the tiny vision-language policy (rlrun.vision.demo builds and saves it).
VL_PRESET = "tiny-vl"


@dataclass
class ModelConfig(PretrainedConfig):
    """Models and reward sources."""

    freeze_visual_encoder: bool = opt(
        False,
        "Vision-language policies: train the language model only; the vision "
        "tower and its projector keep their weights (no gradients, no optimizer "
        "state).",
    )
    freeze_prefix: tuple[str, ...] | None = opt(
        None,
        "Keep the actor's parameters whose names start with these fixed "
        "(OpenRLHF-M's --freeze_prefix visual); checkpoint names and "
        "the model's own both match.",
    )
    reward_pretrain: str | None = opt(
        None, "Reward model directory (sequence-classification or value-head model scoring the last token)."
    )
    critic_pretrain: str | None = opt(None, "Critic initialisation. Unset: the reward model, else the policy.")
    teacher_pretrain: str | None = opt(
        None,
        "On-policy distillation: a frozen teacher (HF directory or hub id, the policy's tokenizer) scores the "
        "policy's own samples and the per-token reverse KL to it trains the policy (--teacher_kl_*); laid out like "
        "the reference (--teacher_num_nodes/--teacher_num_gpus_per_node, --colocate_actor_teacher).",
    )
    remote_rm_url: str | None = opt(
        None,
        "Reward from a local Python file defining reward_func(queries, prompts, "
        "labels), or an http(s):// endpoint; 'demo' is the demo's rule. With no "
        "reward source at all only the demo runs (built-in prompts, embedded "
        "model); anything else must name one.",
    )
    remote_rm_timeout: float = opt(
        30.0, "Seconds to wait for each HTTP reward request (--remote_rm_url http(s)://...)."
    )
    remote_rm_retries: int = opt(
        3, "Attempts per HTTP reward batch (connection errors, timeouts and 5xx are retried with backoff)."
    )
    compute_score: str | None = opt(
        None,
        "verl's reward convention: a .py file defining compute_score(data_source, "
        "solution_str, ground_truth, extra_info) called per sample (a float, or a "
        "dict whose 'score' is the reward), or 'builtin' for rlrun's versions of "
        "verl's rule scores (GSM8K, MATH, DAPO/AIME, NuminaMath, Geometry3K, Search-R1 QA), chosen per prompt by its "
        "data source. The label is --label_key (verl: reward_model.ground_truth).",
    )
    compute_score_name: str = opt(
        "compute_score", "The function --compute_score calls in its file (verl's custom_reward_function.name)."
    )
    reward_workers: int | None = opt(
        None,
        "Processes scoring samples with --compute_score in parallel (1: in this "
        "process). Unset: min(8, CPU cores / processes on the node).",
    )
    reward_timeout: float | None = opt(
        None,
        "Seconds one call of a reward file's reward_func may take on one batch; "
        "past it the run fails naming the function and the batch. Unset: 0.8 x "
        "--dist_timeout (the other ranks wait that long at most).",
    )

    @property
    def needs_reward_model(self) -> bool:
        return self.reward_pretrain is not None and self.remote_rm_url is None


@dataclass
class OptimConfig:
    """Batch sizes, schedule, optimisation (every trainer)."""

    train_batch_size: int = opt(
        128,
        "Samples per optimizer step over all training ranks (PPO: sequences; rlrun.rm/rlrun.dpo: preference pairs).",
    )
    micro_train_batch_size: int = opt(4, "Samples per forward/backward, per rank.")
    max_epochs: int = opt(1, "PPO: passes over each rollout batch; rlrun.sft/rm/dpo: passes over the dataset.")
    packing_samples: bool = opt(
        False,
        "Score and train on packed rows: the real tokens of several sequences share a "
        "row (per-sequence position ids) instead of padded rows. Text models on sdpa pack a "
        "micro-batch into one row and attend each sequence by itself (flash-attention: its "
        "varlen kernel; eager and vision-language models: a block-diagonal mask). rlrun.ppo: "
        "on by default with a CUDA device (--packing_samples false turns it off); off on CPU "
        "and for rlrun.sft/rm/dpo unless given.",
    )
    sequence_parallel_size: int = opt(
        1,
        "Ulysses sequence parallelism: groups of N consecutive ranks of each trained and scoring role "
        "(rlrun.sft/rm/dpo: of all ranks) share every micro-batch's tokens (all-to-all of attention heads), so a "
        "response N times as long fits; the role's ranks must divide by N. Needs packed rows (turned on with it). "
        "OpenRLHF's --ring_attn_size and verl's ulysses_sequence_parallel_size set it.",
    )
    max_samples: int = opt(100_000_000, "Use at most this many records of the dataset (the first ones).")
    max_steps: int | None = opt(
        None, "Stop after this many steps (PPO: rollout + update; rlrun.sft/rm/dpo: optimizer steps)."
    )
    lr_warmup_ratio: float = opt(0.03, "Fraction of optimizer steps spent in linear warmup (then cosine decay).")
    adam_betas: tuple[float, float] = opt((0.9, 0.95), "Adam betas.")
    max_norm: float = opt(1.0, "Gradient clipping norm.")
    max_skipped_steps: int = opt(
        10,
        "Fail when this many optimizer steps in a row are skipped for a NaN/inf gradient "
        "(each one is skipped and counted).",
    )
    l2: float = opt(0.0, "Weight decay.")
    zero_stage: int = opt(
        2, "Sharding stage: 3 reshards parameters after forward (ZeRO-3-like); 0-2 keep them gathered until backward."
    )
    adam_offload: bool = opt(
        False,
        "Offload to CPU (GPU only): with fsdp parameters, gradients and optimizer state; "
        "with deepspeed the optimizer state and fp32 master weights (ZeRO-Offload, "
        "DeepSpeedCPUAdam).",
    )
    strategy: Literal["fsdp", "deepspeed"] = opt(
        "fsdp",
        "How the trained and frozen models are sharded and stepped on their ranks: fsdp "
        "(FSDP2, --zero_stage 0-3) or deepspeed (DeepSpeed ZeRO, --zero_stage 0-2 on any role group, 3 when every "
        "model spans all ranks; pip install 'rlrun[deepspeed]').",
    )
    seed: int = opt(42, "Seed for data order, initialisation and sampling.")

    @property
    def reduces_on_cpu(self) -> bool:
        """FSDP2 with --adam_offload keeps gradients on the CPU, so the gradient norm is reduced over CPU tensors."""
        return self.adam_offload and self.strategy == "fsdp"


@dataclass
class TrainConfig(OptimConfig):
    """Rollout batches, the schedule of PPO-style training, learning rates."""

    rollout_batch_size: int = opt(1024, "Prompts per step (before n_samples_per_prompt).")
    micro_rollout_batch_size: int = opt(8, "Sequences per forward pass when scoring rollouts, per rank.")
    logits_chunk_size: int = opt(
        1024,
        "rlrun: positions per chunk of the vocabulary projection when computing "
        "log-probs/entropy (actor and reference); bounds the logits' memory to chunk x vocab "
        "x "
        "4 bytes; 0 = whole sequences (more memory, same numbers). Models whose forward "
        "transforms the logits (Gemma-2/3 soft-capping, Cohere, Granite) always use 0.",
    )
    dynamic_batch: bool = opt(
        False,
        "Form micro-batches by tokens instead of --micro_train_batch_size / "
        "--micro_rollout_batch_size (OpenRLHF's --use_dynamic_batch, verl's use_dynamic_bsz): "
        "rows are dealt to each role's ranks balanced by length, then sorted by length into "
        "micro-batches of at most --train_max_tokens_per_gpu tokens (scoring: "
        "--rollout_max_tokens_per_gpu), each cut to its own longest row, the same number on "
        "every rank of a role. Long-tailed response lengths then train on far less padding; "
        "the loss normalisation (whole mini-batch token/sequence mean) is unchanged. On by default "
        "with a CUDA device, budgets unless given the memory plan's micro-batches "
        "(--micro_train_batch_size / --micro_rollout_batch_size rows of the longest row); off on CPU.",
    )
    train_max_tokens_per_gpu: int = opt(
        16192,
        "--dynamic_batch: the most tokens of one training micro-batch on one "
        "rank: "
        "rows x (longest prompt + longest response) of its rows, or with "
        "--packing_samples their packed (real) tokens. At least --prompt_max_len + "
        "--generate_max_len (OpenRLHF's default 16192; verl: "
        "ppo_max_token_len_per_gpu).",
    )
    rollout_max_tokens_per_gpu: int | None = opt(
        None,
        "--dynamic_batch: the same budget for the scoring forwards "
        "(old/ref "
        "log-probs, values, reward-model scores; no gradients, so it may be "
        "larger). Unset: --train_max_tokens_per_gpu, as OpenRLHF.",
    )
    n_samples_per_prompt: int = opt(1, "Responses sampled per prompt.")
    async_train: bool = opt(
        False,
        "Overlap generation with training (engines on ranks of their own): the engines "
        "generate step N+1 "
        "with the weights before step N's update while the other ranks train on step N, i.e. one "
        "step "
        "off-policy, always exactly one (deterministic and exactly resumable). Default: on-policy.",
    )
    partial_rollout: bool = opt(
        False,
        "With --async_train: engines keep sequences in flight (--max_staleness steps' "
        "worth) "
        "and go on with them while the learners train; a step takes the first whole groups to "
        "finish, and the unfinished ones carry across the weight sync and continue under the "
        "new "
        "weights (tokens of one response may come from several policy versions; the PPO ratio "
        "uses the actor's recomputed log-probs, the engine's per-token ones feed "
        "--is_correction_level). Long-tailed response lengths then stop stalling every step "
        "on its "
        "longest sample. Not bit-reproducible (how far the engines get while the learners "
        "train "
        "depends on timing).",
    )
    partial_rollout_tokens: int = opt(
        32,
        "--partial_rollout: new tokens a sequence generates between two points where "
        "the engine may hand finished groups over and take new weights.",
    )
    max_staleness: int = opt(
        2,
        "--partial_rollout: the most policy versions a trained token may lag the policy "
        "trained "
        "on it; groups holding older tokens are restarted from their prompt. An engine holds this "
        "many steps' rows (generating or finished). 1: no response outlives a weight sync, which "
        "is --async_train's loop exactly.",
    )
    async_queue_size: int = opt(
        1,
        "Rollout batches in flight with --async_train; rlrun always keeps exactly 1 "
        "(OpenRLHF's default); other values are reported and ignored (--partial_rollout "
        "bounds its samples' age with --max_staleness).",
    )
    num_episodes: int = opt(1, "Passes over the prompt dataset.")
    actor_learning_rate: float = opt(1e-6, "Actor learning rate.")
    critic_learning_rate: float = opt(9e-6, "Critic learning rate.")
    deepspeed_enable_sleep: bool = opt(
        False,
        "Sleep, with either --strategy (OpenRLHF's name): each role's "
        "parameters and its "
        "gradients/optimizer state move to CPU memory between the phases that use them "
        "and back "
        "(bit-identical results), so colocated roles and engines fit one GPU; what "
        "--adam_offload "
        "already keeps on the CPU stays there. Not with --strategy deepspeed "
        "--zero_stage 3.",
    )

    @property
    def rollouts_per_step(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt

    @property
    def continues_rollouts(self) -> bool:
        """--partial_rollout in effect: responses outlive a weight sync (--max_staleness 1 lets none: that is
        --async_train's loop, run as such)."""
        return self.partial_rollout and self.max_staleness > 1


@dataclass
class TemplateConfig:
    """How a record's prompt text becomes model input (every trainer)."""

    input_template: str | None = opt(None, "Template with {} for the prompt.")
    apply_chat_template: bool = opt(False, "Wrap prompts with the tokenizer's chat template.")


@dataclass
class DataConfig(TemplateConfig):
    """Prompt data."""

    prompt_data: str | None = opt(
        None,
        "Prompt sources, comma-separated (OpenRLHF's blending): each a "
        ".jsonl/.json/.parquet/.csv "
        "file, a directory (save_to_disk, or data files), or a Hugging Face Hub dataset id, "
        "optionally SOURCE@DATA_DIR. Unset: built-in prompts.",
    )
    prompt_data_probs: str | None = opt(
        None,
        "Comma-separated sampling weights, one per --prompt_data source: "
        "interleave "
        "them (datasets' interleave_datasets, seeded by --seed, until every source is "
        "exhausted) instead of concatenating.",
    )
    prompt_split: str = opt(
        "train", "Split of each --prompt_data source (a DatasetDict's split, or data files named after it)."
    )
    input_key: str = opt(
        "input",
        "Field holding the prompt: a string, or a list of {role, content} chat messages "
        "(also as JSON text), which is always rendered with the tokenizer's chat template.",
    )
    label_key: str | None = opt(
        None,
        "Field holding the label passed to the reward, as the value it is (a dotted "
        "path reaches nested fields: reward_model.ground_truth).",
    )
    data_source_key: str = opt(
        "data_source",
        "Field naming each prompt's data source (verl's data.reward_fn_key): it "
        "picks the built-in rule scorer and reaches compute_score.",
    )
    apply_chat_template_kwargs: dict[str, Any] = opt(
        {},
        "Extra arguments for the tokenizer's chat template as JSON, "
        "e.g. '{\"enable_thinking\": false}' (verl's "
        "data.apply_chat_template_kwargs).",
    )
    image_key: str = opt(
        "images",
        "Vision-language policies: field holding each prompt's images, placed at the "
        "prompt's <image> placeholders (verl's data.image_key). Images inside chat "
        'messages ({"type": "image", "image": ...}, OpenRLHF-M) need no key.',
    )
    max_images_per_prompt: int = opt(
        0,
        "Vision-language policies: most images one prompt may hold (OpenRLHF's flag, "
        "vLLM's limit_mm_per_prompt); a record with more is refused at start naming "
        "it. 0: no limit (vLLM engines then take one image per prompt).",
    )
    min_pixels: int | None = opt(
        None,
        "Vision-language policies: smallest area (pixels) an image is resized to "
        "(OpenRLHF-M's --min_pixels). Unset: the model's preprocessor_config.json.",
    )
    max_pixels: int | None = opt(
        None,
        "Vision-language policies: largest area (pixels) an image is resized to "
        "(OpenRLHF-M's --max_pixels; fewer pixels, fewer image tokens). Unset: the "
        "model's preprocessor_config.json.",
    )


@dataclass
class SavingConfig:
    """Saving and resuming (every trainer)."""

    save_path: str = opt("./ckpt", "The trained model (HF format) and the default metrics file go here.")
    save_steps: int = opt(-1, "Save a checkpoint every N steps (-1: never).")
    load_checkpoint: bool = opt(False, "Resume from the newest complete checkpoint in --ckpt_path.")
    max_ckpt_num: int = opt(3, "Keep this run's newest N checkpoints (another run's are never pruned).")
    overwrite_checkpoints: bool = opt(
        False,
        "Start a new run in a --ckpt_path that holds another run's checkpoints, "
        "deleting them once this run has saved its first one. Without it (and "
        "without --load_checkpoint) such a run stops at start-up.",
    )
    save_merged: bool = opt(
        False,
        "With --lora_rank: besides the adapter (PEFT's layout) in --save_path, write the "
        "merged model (base + adapter, plain HF format) to <save_path>/merged.",
    )
    export_nonfinite: bool = opt(
        False,
        "Export the trained model even when a weight is NaN/inf (by default the export stops, naming the tensor).",
    )
    ckpt_path: str = opt("./ckpt/checkpoints", "Directory of resumable checkpoints.")  # each trainer's own default


@dataclass
class CheckpointConfig(SavingConfig):
    """Saving and resuming."""

    ckpt_path: str = opt("./ckpt/checkpoints_ppo", "Directory of resumable checkpoints.")
    save_hf_ckpt: bool = opt(False, "Also save the policy in HF format beside each checkpoint.")
    save_value_network: bool = opt(False, "Also save the critic in HF format.")
    load_openrlhf_checkpoint: str | None = opt(
        None,
        "Start from an OpenRLHF DeepSpeed checkpoint: the --ckpt_path of "
        "an OpenRLHF PPO run (holding _actor/ and _critic/, tag from "
        "_actor/latest). Its fp32 weights replace the actor's (and the "
        "critic's, when this run has one and the checkpoint has "
        "_critic); the architecture still comes from "
        "--pretrain/--critic_pretrain and every tensor shape must match. "
        "Weights only: fresh optimizer and schedule, steps count from 0. "
        "--load_checkpoint still resumes from rlrun's own newer "
        "checkpoint when one exists. Offline alternative: python -m "
        "rlrun.compat.openrlhf_checkpoint.",
        metavar="DIR",
    )


@dataclass
class TrackingConfig:
    """Metrics and trackers (every trainer)."""

    logging_steps: int = opt(1, "Log metrics every N steps.")
    eval_steps: int = opt(
        -1,
        "Evaluate on --eval_dataset every N steps. -1: rlrun.ppo never; rlrun.sft/rm/dpo at the "
        "end of every epoch, as OpenRLHF.",
    )
    eval_before_train: bool = opt(
        False, "Also evaluate before the first training step (logged as step 0), like verl's val_before_train."
    )
    metrics_file: str | None = opt(None, "JSONL metrics file (default: <save_path>/metrics.jsonl).")
    use_wandb: str | None = opt(
        None, "Log to wandb. Optional value: the API key (else WANDB_API_KEY).", secret=True, metavar="[KEY]"
    )
    wandb_org: str | None = opt(None, "wandb entity.")
    wandb_project: str | None = opt(None, "wandb project (default: rlrun_<trainer>, e.g. rlrun_ppo).")
    wandb_group: str | None = opt(None, "wandb group.")
    wandb_run_name: str | None = opt(None, "wandb run name.")
    use_tensorboard: str | None = opt(None, "TensorBoard log directory.")


@dataclass
class LoggingConfig(TrackingConfig):
    """Metrics, trackers and evaluation."""

    eval_dataset: str | None = opt(
        None,
        "Evaluation prompts, sources as for --prompt_data (same "
        "--input_key/--label_key). Needs a reward function or URL (or an agent), not "
        "--reward_pretrain.",
    )
    eval_split: str = opt("train", "Split of each --eval_dataset source (OpenRLHF's default: train).")
    eval_temperature: float = opt(0.6, "Sampling temperature for evaluation.")
    eval_n_samples_per_prompt: int = opt(4, "Responses per evaluation prompt (pass@N is logged when N > 1).")


@dataclass
class RuntimeConfig:
    """Process groups and devices (rlrun's own)."""

    device: Literal["auto", "cpu", "cuda"] = opt("auto", "auto: cuda when available, else cpu.")
    dist_backend: Literal["auto", "nccl", "gloo"] = opt("auto", "auto: nccl with cuda, else gloo.")
    dist_timeout: float = opt(300.0, "Seconds any collective may wait before the job fails.")
    tf32: bool = opt(
        True,
        "GPU: fp32 matmuls and convolutions on TF32 tensor cores (Ampere and newer: several times "
        "faster, ~1e-3 relative error; PyTorch's own default for convolutions). false: exact fp32 "
        "matmuls. No effect on CPU or on bf16 math.",
    )
    data_timeout: float = opt(
        1800.0,
        "Seconds loading the datasets may take (every rank loads them before the first "
        "collective); past it the run fails naming the dataset.",
    )
    dry_run: bool = opt(
        False,
        "Preflight, then exit: print the role layout and its memory plan, read the prompt data "
        "and render its first prompt, import the reward source; loads no model weights, contacts no "
        "server.",
    )
    gpu_memory_gb: float | None = opt(
        None,
        "Per-GPU memory in GiB that --dry_run's memory plan checks every rank "
        "against "
        "(given, the plan is for GPUs even on a machine without one). Unset: the GPU's "
        "here (detected); none here: a CPU run's plan, or 80 with --device cuda.",
    )
    plan_json: str | None = opt(
        None,
        "--dry_run: also write the memory plan (per rank: GPU and host bytes by "
        "component; "
        "what does not fit and what would) to this JSON file.",
        metavar="PATH",
    )


@dataclass
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    resources: ResourceConfig = field(default_factory=ResourceConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    algo: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    data: DataConfig = field(default_factory=DataConfig)
    agent: AgentConfig = field(default_factory=AgentConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)

    @property
    def ref_is_actor_base(self) -> bool:
        """LoRA with a KL term: the actor's own weights with the adapters disabled are the reference (verl does this),
        so the layout has no reference role and no copy of the model is held for it."""
        return self.algo.needs_ref and self.model.lora_rank > 0

    @property
    def reward_call_timeout(self) -> float:
        """The bound on one reward-function call: --reward_timeout, or 0.8 x --dist_timeout."""
        return self.model.reward_timeout if self.model.reward_timeout is not None else 0.8 * self.runtime.dist_timeout


class RootConfig(typing.Protocol):
    """What every trainer's root config has (PPO's Config, rlrun.config.supervised's configs): read-only, so that each
    trainer's own subclasses of these sections fit."""

    @property
    def model(self) -> PretrainedConfig: ...

    @property
    def train(self) -> OptimConfig: ...

    @property
    def checkpoint(self) -> SavingConfig: ...

    @property
    def logging(self) -> TrackingConfig: ...

    @property
    def runtime(self) -> RuntimeConfig: ...
