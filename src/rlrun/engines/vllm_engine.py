"""VLLMEngine: the engine surface of roles/engine.py backed by a vLLM child process (tensor parallel T: the
child runs vLLM's T workers; see tensor_parallel.py for how an engine's T ranks share it).

The engine rank keeps an HF copy of the policy, `model`, as the weight receiver: WeightSync writes the
actor's weights into its parameters (bucket views when disaggregated, in-place copies when colocated).
Those parameters are moved into shared memory once; the child maps the same memory, so a sync costs
no copy on the parent side and one vLLM `reload_weights` in the child. Weights are pushed before a
generate whenever they may have changed (every call: the loop syncs once per step).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
import time

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.engines.base import Generation, SamplingSettings
from rlrun.engines.stops import cut_at_stop
from rlrun.engines.vllm_adapter import EngineSpec, Sampling, check_version, sleeps, write_weights
from rlrun.engines.vllm_child import EngineChild
from rlrun.runtime.log import get_logger

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _visible_gpus(device: torch.device, count: int) -> str | None:
    """The physical GPUs of `device` and the next count - 1 local devices (an engine's tensor-parallel ranks are
    consecutive ranks of one node), as the child's CUDA_VISIBLE_DEVICES (None on CPU)."""
    if device.type != "cuda":
        return None
    first = device.index if device.index is not None else torch.cuda.current_device()
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(visible[i] if i < len(visible) else str(i) for i in range(first, first + count))


def write_model_dir(model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str) -> None:
    """The HF directory vLLM starts from: config and tokenizer only. The engine starts with dummy weights
    and gets the real ones by the push before its first generate, so no model-sized file is written.
    Not save_pretrained: under torch.distributed it writes on global rank 0 only."""
    os.makedirs(path, exist_ok=True)
    model.config.to_json_file(os.path.join(path, "config.json"))  # type: ignore[union-attr]
    tokenizer.save_pretrained(path)


def request_seeds(seed: int, count: int) -> list[int]:
    """One vLLM seed per request, a pure function of (seed, row): samples do not depend on batching."""
    rng = random.Random(seed)
    return [rng.getrandbits(31) for _ in range(count)]


class VLLMEngineBase:
    """What both vLLM hosts share: the HF copy of the policy that WeightSync writes into, the config-and-tokenizer
    directory vLLM starts from, per-row seeds from one seed, and the stop-string cut. Hosts implement
    sample_seeded(), load_weights() and close()."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, sampling: SamplingSettings,
                 device: torch.device, rank: int) -> None:
        check_version()
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.sampling = sampling
        self.device = device
        self.tokenizer = tokenizer
        self.last_sync_s = 0.0
        self.workdir = tempfile.mkdtemp(prefix=f"rlrun_vllm_r{rank}_")
        self.model_dir = os.path.join(self.workdir, "model")
        write_model_dir(model, tokenizer, self.model_dir)

    @property
    def dtype_name(self) -> str:
        return _DTYPES[next(self.model.parameters()).dtype]

    def sampling_for(self, stop: tuple[str, ...], max_new_tokens: int | None) -> Sampling:
        s = self.sampling
        return Sampling(temperature=s.temperature, top_p=s.top_p, eos_id=s.eos_id, stop=stop,
                        max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens)

    def finish(self, tokens: list[list[int]], logprobs: list[list[float]], stop: tuple[str, ...]) -> Generation:
        if stop:  # vLLM stops at the token completing a stop string too; this only makes the rule explicit
            tokens = [cut_at_stop(t, stop, self.tokenizer) for t in tokens]
            logprobs = [lp[:len(t)] for lp, t in zip(logprobs, tokens)]
        return Generation(tokens, logprobs)

    def sample_seeded(self, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int | None = None,
                      stop: tuple[str, ...] = ()) -> Generation:
        raise NotImplementedError

    def sample(self, prompts: list[list[int]], seed: int, *, max_new_tokens: int | None = None,
               stop: tuple[str, ...] = ()) -> Generation:
        return self.sample_seeded(prompts, request_seeds(seed, len(prompts)), max_new_tokens=max_new_tokens, stop=stop)

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        return self.sample(prompts, seed).responses

    def sleep(self) -> None:
        """No-op: with --vllm_enable_sleep on GPU the engine sleeps after every generate call by itself."""

    def wake(self) -> None:
        """No-op: the engine wakes by itself for the next weight push or generate call."""


class VLLMEngine(VLLMEngineBase):
    """Sampling with vLLM in a child process. generate()/sample() as HFEngine; load_weights() pushes
    the current `model` parameters to the child: the trainer calls it once after every weight sync, so
    generation and evaluation calls in between reuse the weights the child already holds."""

    def __init__(self, model: nn.Module, tokenizer: PreTrainedTokenizerBase, sampling: SamplingSettings,
                 device: torch.device, *, seed: int, max_model_len: int, timeout_s: float,
                 enforce_eager: bool = False, gpu_memory_utilization: float = 0.9, rank: int = 0,
                 tensor_parallel_size: int = 1, enable_sleep: bool = False,
                 kv_cache_memory_bytes: int | None = None) -> None:
        super().__init__(model, tokenizer, sampling, device, rank)
        model_dir = self.model_dir
        self.weights_dir = None
        if tensor_parallel_size > 1:
            # Pushed weights go through a file the workers read (/dev/shm: memory, not disk); the engine starts
            # from that directory, holding the initial weights.
            shm = "/dev/shm" if os.path.isdir("/dev/shm") else None
            self.weights_dir = model_dir = tempfile.mkdtemp(prefix=f"rlrun_vllm_w{rank}_", dir=shm)
            write_model_dir(model, tokenizer, model_dir)
            write_weights(self.model.named_parameters(), model_dir)
        spec = EngineSpec(model_dir=model_dir, dtype=self.dtype_name, seed=seed,
                          max_model_len=max_model_len, device=device.type, enforce_eager=enforce_eager,
                          gpu_memory_utilization=gpu_memory_utilization,
                          cuda_visible_devices=_visible_gpus(device, tensor_parallel_size),
                          tensor_parallel_size=tensor_parallel_size, weights_dir=self.weights_dir,
                          enable_sleep=enable_sleep, kv_cache_memory_bytes=kv_cache_memory_bytes)
        self.sleeps = sleeps(spec)
        log = get_logger(rank)
        self.child = EngineChild(
            spec, os.path.join(self.workdir, "engine.log"), timeout_s,
            on_ready=lambda s: log._emit("info", f"rank {rank}: vLLM engine child ready in {s:.1f} s (spawn -> ready, "
                                                 "overlapped with the rest of start-up)"))
        atexit.register(self.close)
        # The tensors last sent to the child, kept alive so that new buffers can never reuse their addresses.
        self._sent: list[torch.Tensor] = []
        self._staging: list[torch.Tensor] | None = None  # host copies when the model lives on a GPU
        log._emit("info", f"rank {rank}: vLLM engine child started (pid {self.child.pid}, tensor parallel "
                                        f"{tensor_parallel_size}, log {self.child.log_path})")

    # ---- weights ------------------------------------------------------------------------------

    def _shared_params(self) -> list[tuple[str, torch.Tensor]]:
        """(name, tensor) in shared CPU memory: the parameters themselves on CPU, host copies on GPU."""
        named = list(self.model.named_parameters())
        if self.device.type == "cpu":
            for _, p in named:
                if not p.data.is_shared():
                    p.data.share_memory_()  # in place: bucket views and WeightSync's buffers follow
            return [(n, p.data) for n, p in named]
        if self._staging is None:
            self._staging = [torch.empty(p.shape, dtype=p.dtype).share_memory_() for _, p in named]
        with torch.no_grad():
            for dst, (_, p) in zip(self._staging, named):
                dst.copy_(p.data)
        return [(n, t) for (n, _), t in zip(named, self._staging)]

    def load_weights(self) -> None:
        """Hand the current parameters to the child and wait for its ack (vLLM layerwise reload)."""
        t0 = time.perf_counter()
        named = self._shared_params()
        # Tensors cross the pipe only when their memory changed (first push, or rebound buffers).
        same = len(named) == len(self._sent) and all(
            t.data_ptr() == old.data_ptr() and t.shape == old.shape for (_, t), old in zip(named, self._sent))
        self.child.request("loading weights", "weights", None if same else named)
        self._sent = [t for _, t in named]
        self.last_sync_s = time.perf_counter() - t0

    # ---- generation ---------------------------------------------------------------------------

    def sample_seeded(self, prompts: list[list[int]], seeds: list[int], *, max_new_tokens: int | None = None,
                      stop: tuple[str, ...] = ()) -> Generation:
        """sample() with one given seed per row (the rows of several ranks sampled in one call)."""
        tokens, logprobs = self.child.request(  # type: ignore[misc]
            "generating", "generate", prompts, seeds, self.sampling_for(stop, max_new_tokens))
        if self.sleeps:  # GPU --vllm_enable_sleep: asleep through scoring and training; the next push wakes it
            self.child.request("sleeping", "sleep")
        return self.finish(tokens, logprobs, stop)

    # ---- lifecycle ----------------------------------------------------------------------------

    @property
    def start_s(self) -> float | None:
        return self.child.start_s

    def close(self) -> None:
        self.child.stop()
        shutil.rmtree(self.workdir, ignore_errors=True)
        if self.weights_dir is not None:
            shutil.rmtree(self.weights_dir, ignore_errors=True)
