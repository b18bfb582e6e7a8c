"""The PPO-only sections of the config tree (rlrun.config.schema.Config): the role layout, generation, the
algorithm and multi-turn agents. Every field is a flag of the same name, as in rlrun.config.schema."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.option import opt

AdvantageEstimator = Literal["gae", "group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"]
GROUP_ESTIMATORS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce", "reinforce_baseline"})
NEEDS_GROUPS = frozenset({"group_norm", "dr_grpo", "rloo", "reinforce_baseline"})


@dataclass
class ResourceConfig:
    """Role layout. 'gpus' in these OpenRLHF flags means ranks. No sizes given: every role on every rank."""

    actor_num_nodes: int | None = opt(None, "Nodes for the actor (ranks = nodes x gpus_per_node).")
    actor_num_gpus_per_node: int | None = opt(None, "Ranks per node for the actor.")
    critic_num_nodes: int | None = opt(None, "Nodes for the critic.")
    critic_num_gpus_per_node: int | None = opt(None, "Ranks per node for the critic.")
    ref_num_nodes: int | None = opt(None, "Nodes for the reference model.")
    ref_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reference model.")
    reward_num_nodes: int | None = opt(None, "Nodes for the reward model.")
    reward_num_gpus_per_node: int | None = opt(None, "Ranks per node for the reward model.")
    vllm_num_engines: int | None = opt(None, "Number of generation engines on their own ranks (whatever the backend). Unset: engines share the actor's ranks.")
    vllm_tensor_parallel_size: int = opt(1, "Ranks per generation engine.")
    colocate_actor_ref: bool = opt(False, "Reference model on the actor's ranks (same processes).")
    colocate_critic_reward: bool = opt(False, "Reward model on the critic's ranks.")
    colocate_all_models: bool = opt(False, "Every role, engines included, on the same ranks.")
    actor_node_label: str | None = opt(None, "Put the actor on nodes with this label (each node's RLRUN_NODE_LABEL, else its host name).")
    critic_node_label: str | None = opt(None, "Put the critic on nodes with this label (RLRUN_NODE_LABEL, else the host name).")
    ref_node_label: str | None = opt(None, "Put the reference model on nodes with this label (RLRUN_NODE_LABEL, else the host name).")
    reward_node_label: str | None = opt(None, "Put the reward model on nodes with this label (RLRUN_NODE_LABEL, else the host name).")
    engine_node_label: str | None = opt(None, "Put the generation engines on nodes with this label (RLRUN_NODE_LABEL, else the host name).")


@dataclass
class GenerationConfig:
    """Rollout generation."""

    generation_backend: Literal["auto", "native", "hf", "vllm"] = opt(
        "auto", "native: rlrun's own KV-cache decoder (Llama, Qwen2, Qwen3, Mistral; reports sampled-token log-probs); "
        "hf: transformers generate; vllm: vLLM engines; auto: vllm when it is installed and a GPU is present, else native "
        "when the model's architecture allows it, else hf.")
    temperature: float = opt(1.0, "Sampling temperature.")
    top_p: float = opt(1.0, "Nucleus sampling threshold.")
    prompt_max_len: int = opt(1024, "Max prompt tokens.")
    prompt_overflow: Literal["truncate", "drop"] = opt("truncate", "Prompts longer than --prompt_max_len: keep the last tokens, or drop the record (counted in the log either way).")
    generate_max_len: int = opt(1024, "Max new tokens per response.")
    native_kv_cache_mb: int | None = opt(None, "--generation_backend native: the KV cache budget of each engine rank in "
                                         "MiB; a rank's rollouts are generated in batches whose cache fits it. Default: "
                                         "on GPU from the memory free when generation starts (less the activations), "
                                         "on CPU unbounded (one batch).")
    native_cuda_graph: bool = opt(False, "--generation_backend native on GPU: capture each decode step as a CUDA graph "
                                  "and replay it per token (fewer kernel launches; the step attends over the whole "
                                  "cache capacity). No effect on CPU.")
    vllm_gpu_memory_utilization: float = opt(0.95, "vLLM gpu_memory_utilization (GPU: the fraction of the whole GPU one engine "
                                             "rank may use; lower it when the actor shares the GPU, e.g. 0.3-0.5).")
    vllm_kv_cache_memory_bytes: int | None = opt(None, "GPU: the KV cache size of each vLLM engine rank in bytes, instead of "
                                                 "sizing it from --vllm_gpu_memory_utilization (more robust when trainer "
                                                 "models share the GPU). CPU: no effect (VLLM_CPU_KVCACHE_SPACE sizes it).")
    vllm_enable_sleep: bool = opt(False, "GPU: vLLM sleeps (level 1: weights to host memory, KV cache freed) after each "
                                  "generate call and wakes for the next weight push; CPU: no effect (vLLM has no sleep mode there).")
    vllm_sync_backend: Literal["nccl", "gloo"] = opt("nccl", "Backend of the actor->engine weight-sync group on GPU.")
    enforce_eager: bool = opt(False, "Disable CUDA graphs in vLLM (always eager on CPU).")
    vllm_engine_host: Literal["auto", "child", "in_process"] = opt(
        "auto", "Where each vLLM engine runs. in_process: inside the rank (vLLM's external_launcher), only when the "
        "engine ranks are the whole world (colocate all, or 1 rank); child: a spawned child process per engine "
        "(any layout); auto: in_process when the layout allows it, else child.")
    vllm_seeded_requests: bool = opt(False, "Give every vLLM request its own seed: a row's sample then does not depend "
                                     "on the other rows of its generate call (batch size, order, host), but vLLM draws "
                                     "seeded rows' noise one row at a time, which is slower on big batches. Off: requests "
                                     "carry no seed and vLLM samples the whole batch at once, from one seed per call (a run "
                                     "repeated on the same hardware samples alike; a row's sample depends on its batch).")
    weight_sync_bucket_mb: int = opt(256, "Size of each actor->engine weight-sync bucket (MiB).")


@dataclass
class AlgorithmConfig:
    """Advantages, KL and losses."""

    advantage_estimator: AdvantageEstimator = opt("gae", "gae (PPO), group_norm (GRPO), dr_grpo, rloo, reinforce (REINFORCE++), reinforce_baseline.")
    init_kl_coef: float = opt(0.01, "KL coefficient (reward penalty, or loss weight with --use_kl_loss).")
    kl_target: float | None = opt(None, "Adaptive KL: target KL (unset: fixed coefficient).")
    kl_horizon: int = opt(10000, "Adaptive KL horizon.")
    kl_estimator: Literal["k1", "k2", "k3"] = opt("k1", "KL estimator (Schulman's k1/k2/k3); every estimate is clamped to [-10, 10] as in OpenRLHF.")
    use_kl_loss: bool = opt(False, "KL as a loss term instead of a reward penalty (GRPO).")
    gamma: float = opt(1.0, "Discount factor (gae, reinforce). group_norm, dr_grpo, rloo and reinforce_baseline always use 1.0, as in OpenRLHF.")
    lambd: float = opt(1.0, "GAE lambda.")
    eps_clip: float = opt(0.2, "PPO clip range.")
    eps_clip_low_high: tuple[float, float] | None = opt(None, "Asymmetric PPO clip: the ratio is clipped to [1 - LOW, 1 + HIGH] (DAPO clip-higher). Unset: (eps_clip, eps_clip).")
    policy_loss_type: Literal["ppo", "gspo"] = opt("ppo", "ppo: per-token importance ratio. gspo: one ratio per sequence, exp(token-mean log-ratio), with a per-sequence loss mean (GSPO; use a small --eps_clip_low_high, e.g. 3e-4 4e-4).")
    dual_clip: float | None = opt(None, "Dual-clip constant (> 1).")
    value_clip: float | None = opt(0.5, "Value clip range (unset: no clipping).")
    normalize_reward: bool = opt(False, "As OpenRLHF: (score - mean) / std with the mean/std stored in the reward model's config.json (absent: 0/1); critic values get their model config's mean/std too. Reward functions and HTTP rewards are untouched.")
    running_reward_norm: bool = opt(False, "rlrun: standardise every score with a running mean/std over all steps so far (kept in checkpoints).")
    overlong_buffer_len: int | None = opt(None, "DAPO overlong penalty: responses longer than generate_max_len - N tokens lose up to --overlong_penalty_factor, linearly over the last N tokens. Unset: off.")
    overlong_penalty_factor: float = opt(1.0, "Largest overlong penalty (reached at generate_max_len tokens).")
    stop_properly_penalty_coef: float | None = opt(None, "ProRL: rewards of responses cut off at generate_max_len without EOS are multiplied by this (in [0, 1]) or, if negative, replaced by it. Unset: off.")
    dynamic_filtering: bool = opt(False, "DAPO dynamic sampling: prompt groups whose mean score is not strictly inside --dynamic_filtering_reward_range are left out of the update (rlrun keeps the batch shape and masks them out instead of re-sampling). Needs --n_samples_per_prompt > 1.")
    dynamic_filtering_reward_range: tuple[float, float] = opt((0.0, 1.0), "Keep a prompt group when LOW < mean score < HIGH (--dynamic_filtering).")
    reward_clip_range: tuple[float, float] = opt((-10.0, 10.0), "Clip scores to this range.")
    entropy_loss_coef: float | None = opt(None, "Entropy bonus coefficient (0 logs entropy only).")
    no_advantage_std_norm: bool = opt(False, "gae/reinforce/reinforce_baseline: only subtract the advantage mean, do not divide by its std.")
    loss_agg_mode: Literal["token-mean", "seq-mean-token-sum", "seq-mean-token-mean"] = opt("token-mean", "How per-token losses are averaged.")
    is_correction_level: Literal["off", "token", "seq"] = opt("off", "Correct the engine/actor log-prob mismatch (OpenRLHF 0.11 --algo.advantage.is_correction_level; needs --generation_backend vllm): gate each token, or each sequence's mean, on the statistic below.")
    is_correction_mode: Literal["mask", "clip"] = opt("mask", "mask: drop units outside the threshold (survivors keep their weight pi_train/pi_rollout); clip: clamp the token weight into it (token level, ratio gating).")
    is_correction_gating: Literal["ratio", "binary_kl", "tv"] = opt("ratio", "Statistic the gate reads: the weight pi_train/pi_rollout itself, or the sampled token's binary KL / total variation between the two.")
    is_correction_threshold: tuple[float, float] = opt((0.5, 5.0), "LOW HIGH bounds of the gated statistic (0 HIGH for an upper bound only, required for binary_kl/tv).")


RETRIEVER_RETRY_BACKOFF_S = 0.5  # the retriever client sleeps this * 2**(k-1) before retry k


@dataclass
class AgentConfig:
    """Multi-turn agent rollouts: an environment answers each model turn (observation tokens are not actions)."""

    agent_func_path: str | None = opt(None, "OpenRLHF agent file (.py) defining AgentInstance (reset/step, async) and usually AgentExecutor; its rewards replace any reward source. Turns: see --max_turns.")
    retriever_url: str | None = opt(None, "Built-in Search-R1 agent: the retrieval server's POST URL (e.g. http://127.0.0.1:8000/retrieve, see python -m rlrun.retriever_server); reward = exact match of the last <answer> against the label's golden answers.")
    retriever_topk: int = opt(3, "Search-R1 agent: passages per search.")
    retriever_timeout: float = opt(10.0, "Search-R1 agent: seconds per retrieval request (tried --remote_rm_retries times with backoff, then the run fails naming the URL); all tries must fit in --agent_timeout.")
    max_turns: int | None = opt(None, "Most model turns per episode (each turn generates, then the agent steps). Unset: until the agent says done or --generate_max_len is used up. Search-R1's max_turns=K is K search turns plus a final answer turn, i.e. --max_turns K+1.")
    max_tokens_per_turn: int | None = opt(None, "Most tokens generated in one turn (Search-R1's per-turn max_response_length). Unset: what is left of --generate_max_len.")
    max_obs_len: int | None = opt(None, "Most tokens of one observation (verl/Search-R1 max_obs_length); longer ones keep their first tokens and are counted in agent/obs_truncated.")
    state_masking: bool = opt(True, "Observation tokens carry no loss, KL or advantage (Search-R1 state_masking). false: they are trained on like generated tokens.")
    agent_timeout: float = opt(60.0, "Seconds one agent reset() or step() call may take before the run fails.")
    agent_max_concurrency: int = opt(64, "Agent calls of one engine rank that run at once (asyncio).")
