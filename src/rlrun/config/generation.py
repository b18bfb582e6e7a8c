"""The generation section (rlrun.ppo): the backend, sampling, lengths and each backend's own settings, read by
rlrun.engines (through rlrun.engines.build) and the rollout phase."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from rlrun.config.fields import non_negative, opt, positive
from rlrun.runtime.errors import ConfigError


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
    weight_sync_senders: Literal["all", "root"] = opt(
        "all",
        "Engines on ranks of their own: 'all' = every actor rank sends its own shard, in the engines' dtype (no rank "
        "gathers the model; with several engine ranks each takes a share and passes it on to the others); 'root' = "
        "the actor's first rank gathers the model and broadcasts it. A LoRA actor (merged weights) and an actor on "
        "one rank send from the root either way.",
    )
    weight_sync_delta: bool = opt(
        False,
        "Engines on ranks of their own that keep the weights (rlrun's native engine): after the first sync, each "
        "actor rank sends only the elements of its shard whose bits changed since its last sync (index + value, "
        "written over the engine's copy: exact), or the part dense when more changed; every part's checksum is "
        "verified on the engines each sync. Each actor rank keeps a copy of its shard in the engines' dtype. "
        "Ignored (full syncs, said at start-up) for vLLM engines and a LoRA actor.",
    )
    max_engine_restarts: int = opt(
        3,
        "vLLM engines hosted in a child process (--vllm_engine_host child, or auto where the layout needs one): a "
        "child that dies, stops answering or fails a request is restarted in place, given the last sync's weights, and "
        "its request sent again with the same seeds, at most this many times within --engine_restart_window seconds; "
        "one more failure ends the job. At tensor parallel 1 the rank keeps a host copy of each weight sync for it "
        "(the policy in its engine dtype). 0: a failed child ends the job and no copy is kept.",
    )
    engine_restart_window: float = opt(3600.0, "Seconds over which --max_engine_restarts counts an engine's restarts.")

    def check(self) -> None:
        positive("native_kv_cache_mb", self.native_kv_cache_mb, allow_none=True)
        for name in ("prompt_max_len", "generate_max_len", "weight_sync_bucket_mb"):
            positive(name, getattr(self, name))
        non_negative("max_engine_restarts", self.max_engine_restarts)
        positive("engine_restart_window", self.engine_restart_window)
        if self.temperature <= 0:
            raise ConfigError(f"--temperature must be > 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ConfigError(f"--top_p must be in (0, 1], got {self.top_p}")
        if not 0 < self.vllm_gpu_memory_utilization <= 1:
            raise ConfigError(
                f"--vllm_gpu_memory_utilization must be in (0, 1], got {self.vllm_gpu_memory_utilization}"
            )
        if self.vllm_kv_cache_memory_bytes is not None and self.vllm_kv_cache_memory_bytes <= 0:
            raise ConfigError(f"--vllm_kv_cache_memory_bytes must be > 0 bytes, got {self.vllm_kv_cache_memory_bytes}")
