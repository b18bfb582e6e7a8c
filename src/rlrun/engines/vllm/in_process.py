"""InProcessEngine: the engine surface of engines/protocol.py backed by vLLM inside this rank (external_launcher).

Only for layouts whose engine ranks are the whole torch.distributed world, in consecutive tensor-parallel blocks
from rank 0 (engines/vllm/placement.py says why; the constructor refuses anything else). Every rank builds one `LLM`;
the T ranks of an engine form vLLM's tensor-parallel group, and each of them submits the SAME requests: on every
sample() call the engine's ranks swap their prompts and per-row seeds (transfer.EngineRowExchange.to_all), all
run the whole batch, and each keeps its own rows. Every rank of an engine must therefore call sample() the same
number of times (single-turn generation and evaluation do; multi-turn episodes with tensor parallel > 1 are
refused before anything starts, as for the child host).

Weights: the rank keeps no copy of the policy (`model` lies on the meta device: it names the parameters). The
engine is WeightSync's loader: each sync, the actor's parameters, gathered one FSDP unit at a time into new full
tensors, go straight into vLLM's layerwise reload as they are gathered (vLLM keeps each until its layer is complete,
then its own shard of it); so a rank holds vLLM's weights plus about one unit and one layer, never the policy.

vLLM in the trainer's process has side effects rlrun undoes: it reseeds the host's global RNGs (python, numpy,
torch, CUDA) to LLM(seed=...), so their states are saved and restored around construction and every call;
on CPU its worker replaces torch.set_num_threads with a no-op, restored after construction; its engine core
gc.freeze()s the heap, undone after construction. It must be closed before the default process group is
destroyed, and without vLLM's own shutdown, which destroys that group (VLLMAdapter.close_in_process; build.py
registers close() with launch.dist.before_teardown).
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import shutil
import time
from collections.abc import Iterator
from typing import Protocol

import numpy as np
import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.engines.protocol import Generation, SamplingSettings
from rlrun.engines.receivers import ParamLoader
from rlrun.engines.vllm.adapter import EngineSpec, ImageRequests, VLLMAdapter, sleeps
from rlrun.engines.vllm.engine import VLLMEngineBase, VLLMOptions
from rlrun.engines.vllm.placement import gpu_utilization, whole_world_problem
from rlrun.launch.dist import keep_worker_threads_serial
from rlrun.launch.layout import Layout
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger


class PeerExchange(Protocol):
    """Provided by rlrun.launch.transfer.EngineRowExchange (the engine's process group stays there)."""

    index: int  # this rank's position in its engine

    def to_all(self, mine: object) -> list[object]: ...


@contextlib.contextmanager
def kept_host_rng(device: torch.device) -> Iterator[None]:
    """Restore the python, numpy, torch and (device cuda) CUDA global RNG states on exit: vLLM reseeds them."""
    py, npy, cpu = random.getstate(), np.random.get_state(), torch.get_rng_state()
    cuda = torch.cuda.get_rng_state_all() if device.type == "cuda" else None
    try:
        yield
    finally:
        random.setstate(py)
        np.random.set_state(npy)
        torch.set_rng_state(cpu)
        if cuda is not None:
            torch.cuda.set_rng_state_all(cuda)


@contextlib.contextmanager
def kept_set_num_threads() -> Iterator[None]:
    """vLLM's CPU worker replaces torch.set_num_threads with a no-op (it guards its own thread binding, which rlrun
    switches off: VLLM_CPU_OMP_THREADS_BIND=nobind); the trainer keeps the real one, and its threads' counts as
    launch.dist set them (other threads serial)."""
    real, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = real
        if not keep_worker_threads_serial(threads):
            torch.set_num_threads(threads)


def _torchrun_env(rank: int, world_size: int, device: torch.device) -> None:
    """external_launcher reads RANK and LOCAL_RANK from the environment (torchrun sets them; a single process or
    srun may not). On a GPU its worker takes device cuda:LOCAL_RANK, which must be the rank's own device."""
    os.environ.setdefault("RANK", str(rank))
    os.environ.setdefault("WORLD_SIZE", str(world_size))
    if device.type == "cuda":
        os.environ["LOCAL_RANK"] = str(device.index if device.index is not None else torch.cuda.current_device())
    else:
        os.environ.setdefault("LOCAL_RANK", "0" if world_size == 1 else str(rank))


class InProcessEngine(VLLMEngineBase, ParamLoader):
    """Sampling with vLLM in this rank. generate()/sample() as HFEngine; load_weights() hands the current `model`
    parameters to vLLM (the trainer calls it once after every weight sync)."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        device: torch.device,
        options: VLLMOptions,
        *,
        layout: Layout,
        world_size: int,
        exchange: PeerExchange,
    ) -> None:
        """`model` may lie on the meta device (but a vision-language policy's weights, read for vLLM's first file);
        it is moved there once the engine is built. WeightSync hands each sync's gathered tensors to `load`."""
        o = options
        rank, tensor_parallel_size = o.rank, o.tensor_parallel_size
        # A subset of the world would hang inside vLLM with no error: refuse it here too, not only in planning.
        problem = whole_world_problem(layout, tensor_parallel_size)
        if problem is None and world_size != layout.world_size:
            problem = f"the layout is for {layout.world_size} ranks but torch.distributed has {world_size}"
        if problem is not None:
            raise ConfigError(
                f"the in-process vLLM engine (--vllm_engine_host in_process) cannot run here: {problem}; "
                "use --vllm_engine_host child"
            )
        super().__init__(model, tokenizer, sampling, device, options)
        self.exchange = exchange
        self.tensor_parallel_size = tensor_parallel_size
        # Every rank of a tensor-parallel group must build the same engine, seed included (each call reseeds it
        # from the rows' seeds, or each request carries its own with --vllm_seeded_requests).
        self.spec = EngineSpec(
            model_dir=self.model_dir,
            dtype=self.dtype_name,
            seed=o.seed,
            max_model_len=o.max_model_len,
            device=device.type,
            enforce_eager=o.enforce_eager,
            gpu_memory_utilization=gpu_utilization(o.gpu_memory_utilization, device, rank),
            tensor_parallel_size=tensor_parallel_size,
            external_launcher=True,
            enable_sleep=o.enable_sleep,
            kv_cache_memory_bytes=o.kv_cache_memory_bytes,
            images_per_prompt=o.images_per_prompt,
            lora_rank=self.lora_rank,
        )
        self.sleeps = sleeps(self.spec)
        log = get_logger(rank)
        t0 = time.perf_counter()
        _torchrun_env(rank, world_size, device)
        with kept_host_rng(device), kept_set_num_threads():
            self.adapter: VLLMAdapter | None = VLLMAdapter(self.spec)
        # vLLM's engine core gc.freeze()s the heap after start-up (a server's static objects); in the trainer that
        # would pin everything alive now (models, optimizer, data) past its last use.
        gc.unfreeze()
        self.start_s: float | None = time.perf_counter() - t0
        log._emit(
            "info",
            f"rank {rank}: in-process vLLM engine ready in {self.start_s:.1f} s (external_launcher, "
            f"tensor parallel {tensor_parallel_size})",
        )
        self.drop_weights()
        if self.adapters is None:
            self.weights = self  # weight sync hands it each parameter as the actor is gathered (`load`)
            log.info_once(
                "weight syncs hand the gathered tensors straight to the in-process vLLM engines; no rank keeps "
                "a copy of the policy"
            )

    # ---- weights ------------------------------------------------------------------------------

    def load(self, named: Iterator[tuple[str, torch.Tensor]]) -> None:
        """ParamLoader: vLLM's layerwise reload of each tensor as WeightSync gathers it."""
        assert self.adapter is not None, "the engine is closed"
        t0 = time.perf_counter()
        with kept_host_rng(self.device):
            self.adapter.reload_weights(named)
        self.last_sync_s = time.perf_counter() - t0

    def load_weights(self) -> None:
        """A LoRA policy: vLLM loads the adapters the sync left. Else nothing to do: vLLM took the weights during the
        sync (`load`)."""
        version = self.next_adapter()
        if version is None:
            return
        assert self.adapter is not None and self.adapters is not None, "the engine is closed"
        t0 = time.perf_counter()
        with kept_host_rng(self.device):
            self.adapter.load_adapter(version)
        self.adapters.loaded(version)
        self.last_sync_s = time.perf_counter() - t0

    # ---- generation ---------------------------------------------------------------------------

    def sample_seeded(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        images: ImageRequests = None,
    ) -> Generation:
        """sample() with one given seed per row. Tensor parallel > 1: collective over the engine's ranks (text only:
        vision-language runs with tensor-parallel engines are refused before start)."""
        assert self.adapter is not None, "the engine is closed"
        rows, row_seeds, first = prompts, seeds, 0
        if self.tensor_parallel_size > 1:
            assert images is None, "images are not exchanged between tensor-parallel ranks"
            shares: list[dict[str, list]] = self.exchange.to_all({"prompts": prompts, "seeds": seeds})  # type: ignore[assignment]
            rows = [p for share in shares for p in share["prompts"]]
            row_seeds = [s for share in shares for s in share["seeds"]]
            first = sum(len(share["prompts"]) for share in shares[: self.exchange.index])
        with kept_host_rng(self.device):
            tokens, logprobs = self.adapter.generate(rows, row_seeds, self.sampling_for(stop, max_new_tokens), images)
            if self.sleeps:  # GPU --vllm_enable_sleep: asleep through scoring and training; the next push wakes it
                self.adapter.sleep()
        return self.finish(tokens[first : first + len(prompts)], logprobs[first : first + len(prompts)], stop)

    # ---- lifecycle ----------------------------------------------------------------------------

    def close(self) -> None:
        """Drop the engine and vLLM's groups (idempotent); before the default group is destroyed."""
        if self.adapter is not None:
            adapter, self.adapter = self.adapter, None
            adapter.close_in_process()
        shutil.rmtree(self.workdir, ignore_errors=True)
