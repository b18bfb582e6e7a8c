"""VLLMEngine: the engine surface of engines/protocol.py backed by a vLLM child process (tensor parallel T: the
child runs vLLM's T workers; TensorParallelEngine, below, is how an engine's T ranks share it).

The rank keeps no copy of the policy: `model` lies on the meta device (it names the parameters), and WeightSync
hands each bucket of a sync to `sink` as it is received (disaggregated) or gathered (colocated with the actor):
engines/vllm/stream.py, through two staging buffers to the child at tensor parallel 1, into the workers' weights file in
/dev/shm at tensor parallel > 1 (on the engine's first rank only). Free space on /dev/shm is checked before
anything is put there.

A child that dies, stops answering or fails a request is restarted in place (--max_engine_restarts within
--engine_restart_window): a new child is given the last sync's weights (the sink's host copy, or the weights file)
and the failed request is sent again with the same seeds, so the step goes on with the rows it would have had. No
collective is involved: the other ranks wait for this one in their next collective (--dist_timeout bounds the restart).
"""

from __future__ import annotations

import atexit
import os
import random
import shutil
import tempfile
import time
from dataclasses import dataclass
from typing import Any, Protocol, cast

import torch
from torch import nn
from transformers import PreTrainedTokenizerBase

from rlrun.config.generation import GenerationConfig
from rlrun.data.batching import derive_seed
from rlrun.data.vision_batch import RowVision
from rlrun.engines.protocol import Generation, SamplingSettings, cut_at_stop, refuse_images
from rlrun.engines.receivers import KeptAdapters, WeightReceiver
from rlrun.engines.vllm.adapter import EngineSpec, ImageRequests, Sampling, check_version, sleeps, write_weights
from rlrun.engines.vllm.child import EngineChild, RestartBudget
from rlrun.engines.vllm.handoff import SHM_DIR, check_shm, file_bytes
from rlrun.engines.vllm.lora import AdapterFiles, AdapterVersion, vllm_lora_rank
from rlrun.engines.vllm.placement import gpu_utilization
from rlrun.engines.vllm.stream import ChildLinkError, ChildStreamSink, EngineSink, WeightCopy, WeightsFileSink
from rlrun.models.lora import LoraSettings
from rlrun.runtime.log import get_logger
from rlrun.vision.inputs import vision_token_ids

_DTYPES = {torch.float32: "float32", torch.bfloat16: "bfloat16", torch.float16: "float16"}


def _visible_gpus(device: torch.device, count: int) -> str | None:
    """The physical GPUs of `device` and the next count - 1 local devices (an engine's tensor-parallel ranks are
    consecutive ranks of one node), as the child's CUDA_VISIBLE_DEVICES (None on CPU)."""
    if device.type != "cuda":
        return None
    first = device.index if device.index is not None else torch.cuda.current_device()
    visible = [d for d in os.environ.get("CUDA_VISIBLE_DEVICES", "").split(",") if d.strip()]
    return ",".join(visible[i] if i < len(visible) else str(i) for i in range(first, first + count))


def write_model_dir(
    model: nn.Module, tokenizer: PreTrainedTokenizerBase, path: str, image_processor: Any = None
) -> None:
    """The HF directory vLLM starts from: config and tokenizer only (and a vision-language model's image processor,
    with rlrun's resize bounds, so that vLLM expands each image to the tokens the learners score). The engine starts
    with dummy weights and gets the real ones by the push before its first generate, so no model-sized file is
    written. Not save_pretrained: under torch.distributed it writes on global rank 0 only."""
    os.makedirs(path, exist_ok=True)
    model.config.to_json_file(os.path.join(path, "config.json"))  # type: ignore[union-attr, operator]  # an HF model's config
    tokenizer.save_pretrained(path)
    if image_processor is not None:
        image_processor.save_pretrained(path)


def one_token_per_image(ids: list[int], image_token: int) -> list[int]:
    """Prompt ids with each run of image tokens (one image, expanded by rlrun's processor) back to one token: vLLM
    expands them again itself from the images (given them expanded, it would expand each token once more)."""
    return [t for i, t in enumerate(ids) if t != image_token or i == 0 or ids[i - 1] != image_token]


def request_seeds(seed: int, count: int) -> list[int]:
    """One seed per row, a pure function of (seed, row). With --vllm_seeded_requests each request carries its own
    (samples do not depend on batching); without, the adapter seeds the whole call from them
    (rlrun.engines.vllm.adapter.batch_seed)."""
    rng = random.Random(seed)
    return [rng.getrandbits(31) for _ in range(count)]


def keyed_seeds(seed: int, keys: list[int]) -> list[int]:
    """One seed per row, a pure function of (seed, the row's key) (the gateway's requests: rlrun.gateway.server)."""
    return [derive_seed(seed, "row", key) & 0x7FFFFFFF for key in keys]


@dataclass(frozen=True)
class VLLMOptions:
    """How a vLLM engine starts: this rank, the run's seed and longest sequence, the engine's tensor-parallel size,
    the --vllm_* settings, and a vision-language policy's image processor (None for text)."""

    rank: int
    seed: int
    max_model_len: int
    tensor_parallel_size: int = 1
    timeout_s: float = 300.0  # child host: the bound on each request to the child
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    enable_sleep: bool = False
    kv_cache_memory_bytes: int | None = None
    seeded_requests: bool = False
    max_restarts: int = 0  # child host: restarts of a failed child within restart_window_s (0: a failure ends the job)
    restart_window_s: float = 3600.0
    image_processor: Any = None
    images_per_prompt: int = 0
    # A LoRA policy whose adapters the engine runs beside the base weights (rlrun.engines.build.engine_adapters):
    # each sync loads the adapters alone. vLLM reads the base at start from `base_files` (the pretrained model's
    # safetensors files and index, linked into its directory), or when there are none from `model`, written there.
    lora: LoraSettings | None = None
    base_files: tuple[str, ...] = ()

    @classmethod
    def of(
        cls, g: GenerationConfig, *, rank: int, seed: int, tensor_parallel_size: int, timeout_s: float
    ) -> VLLMOptions:
        """The generation section's vLLM settings for this rank (images: set by the caller with replace)."""
        return cls(
            rank,
            seed,
            g.prompt_max_len + g.generate_max_len,
            tensor_parallel_size,
            timeout_s,
            g.enforce_eager,
            g.vllm_gpu_memory_utilization,
            g.vllm_enable_sleep,
            g.vllm_kv_cache_memory_bytes,
            g.vllm_seeded_requests,
            g.max_engine_restarts,
            g.engine_restart_window,
        )


class VLLMEngineBase:
    """What both vLLM hosts share: the policy's parameter names and shapes (`model`, on the meta device once the
    engine is built), the config-and-tokenizer directory vLLM starts from, per-row seeds from one seed, and the
    stop-string cut. Hosts implement sample_seeded(), load_weights() and close(), and set `weights` (how weight sync
    reaches vLLM: a sink the buckets stream through, or the in-process engine itself as the loader).
    seeded_requests (--vllm_seeded_requests) is read on every call."""

    weights: WeightReceiver | None = None

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        device: torch.device,
        options: VLLMOptions,
    ) -> None:
        check_version()
        rank, image_processor = options.rank, options.image_processor
        self.seeded_requests = options.seeded_requests
        self.model = model.eval()
        self.model.requires_grad_(False)
        self.sampling = sampling
        self.device = device
        self.tokenizer = tokenizer
        self.last_sync_s = 0.0
        self.workdir = tempfile.mkdtemp(prefix=f"rlrun_vllm_r{rank}_")
        self.model_dir = os.path.join(self.workdir, "model")
        self.image_token: int | None = getattr(model.config, "image_token_id", None) if image_processor else None
        self.banned = tuple(vision_token_ids(model)) if image_processor is not None else ()
        write_model_dir(model, tokenizer, self.model_dir, image_processor)
        # vLLM builds a vision-language model from real weights (VLLMAdapter says why), and runs a LoRA policy's
        # adapters beside the base weights it read at start: the pretrained files as they are, else written
        for path in options.base_files:
            os.symlink(path, os.path.join(self.model_dir, os.path.basename(path)))
        if options.lora is not None:
            get_logger(rank).info_once(
                "vLLM engines read the base weights at start from "
                + (os.path.dirname(options.base_files[0]) + " (linked)" if options.base_files else "this rank's copy")
                + "; each weight sync sends the LoRA adapters alone"
            )
        if image_processor is not None or (options.lora is not None and not options.base_files):
            write_weights(self.model.named_parameters(), self.model_dir)
        self.lora_rank = 0 if options.lora is None else vllm_lora_rank(options.lora.rank)
        self.adapters = None if options.lora is None else AdapterFiles(options.lora, os.path.join(self.workdir, "lora"))
        if self.adapters is not None:
            self.weights = KeptAdapters(self.adapters.adopt)  # each sync writes the adapters into its module

    @property
    def restarts(self) -> int:
        """Times this rank's engine was restarted in place: the child host's; an in-process engine never is."""
        return 0

    @property
    def dtype_name(self) -> str:
        return _DTYPES[next(self.model.parameters()).dtype]

    def drop_weights(self) -> None:
        """Keep only the parameters' names and shapes (a vision-language or LoRA policy's were read for vLLM's first
        file)."""
        self.model.to("meta")

    def next_adapter(self) -> AdapterVersion | None:
        """After a sync: a LoRA policy's adapters as it left them, written for vLLM as a new version (else None)."""
        return None if self.adapters is None else self.adapters.next_version()

    def sampling_for(self, stop: tuple[str, ...], max_new_tokens: int | None) -> Sampling:
        s = self.sampling
        return Sampling(
            temperature=s.temperature,
            top_p=s.top_p,
            end_ids=s.end_ids,
            stop=stop,
            max_new_tokens=s.max_new_tokens if max_new_tokens is None else max_new_tokens,
            seeded=self.seeded_requests,
            banned=self.banned,
        )

    def finish(self, tokens: list[list[int]], logprobs: list[list[float]], stop: tuple[str, ...]) -> Generation:
        if stop:  # vLLM stops at the token completing a stop string too; this only makes the rule explicit
            tokens = [cut_at_stop(t, stop, self.tokenizer) for t in tokens]
            logprobs = [lp[: len(t)] for lp, t in zip(logprobs, tokens)]
        return Generation(tokens, logprobs)

    def sample_seeded(
        self,
        prompts: list[list[int]],
        seeds: list[int],
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        images: ImageRequests = None,
    ) -> Generation:
        raise NotImplementedError

    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,
    ) -> Generation:
        """`vision`: the rows' images (a vision-language policy); vLLM gets each row's decoded images and its prompt
        with one image token per image, and checks that it expanded them to the rows' own lengths."""
        images: ImageRequests = None
        if vision is not None:
            assert self.image_token is not None, "the engine was built without the policy's image processor"
            images = (vision.row_images(), [len(p) for p in prompts])
            prompts = [one_token_per_image(p, self.image_token) for p in prompts]
        seeds = request_seeds(seed, len(prompts)) if keys is None else keyed_seeds(seed, keys)
        return self.sample_seeded(prompts, seeds, max_new_tokens=max_new_tokens, stop=stop, images=images)

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        return self.sample(prompts, seed).responses

    def sleep(self) -> None:
        """No-op: with --vllm_enable_sleep on GPU the engine sleeps after every generate call by itself."""

    def wake(self) -> None:
        """No-op: the engine wakes by itself for the next weight push or generate call."""


class VLLMEngine(VLLMEngineBase):
    """Sampling with vLLM in a child process. generate()/sample() as HFEngine; the child has the new weights when a
    weight sync ends (its `sink` loaded them), so generation and evaluation calls in between reuse them."""

    def __init__(
        self,
        model: nn.Module,
        tokenizer: PreTrainedTokenizerBase,
        sampling: SamplingSettings,
        device: torch.device,
        options: VLLMOptions,
    ) -> None:
        """`model` may lie on the meta device (but a vision-language policy's weights, read for vLLM's first file);
        it is moved there once the engine is built."""
        o = options
        rank, tensor_parallel_size, image_processor = o.rank, o.tensor_parallel_size, o.image_processor
        check_version()
        shm = SHM_DIR if os.path.isdir(SHM_DIR) else None
        # Before anything is written or the child is spawned: what the weight syncs will put in /dev/shm. Tensor
        # parallel > 1: one weights file (the previous one is removed before the next is written). Tensor parallel 1:
        # two buckets on CPU, checked when they are handed over; nothing on a GPU (IPC handles).
        if tensor_parallel_size > 1 and shm is not None:
            check_shm(
                file_bytes(p.data for p in model.parameters()),
                f"the vLLM engine's weights file (tensor parallel {tensor_parallel_size}: its workers read every "
                "weight sync from a file in shared memory)",
            )
        super().__init__(model, tokenizer, sampling, device, options)
        model_dir = self.model_dir
        self.weights_dir = None
        if tensor_parallel_size > 1:
            # Pushed weights go through a file the workers read (/dev/shm: memory, not disk). A vision-language
            # engine starts from that directory, holding the initial weights (a text one from dummy weights).
            self.weights_dir = tempfile.mkdtemp(prefix=f"rlrun_vllm_w{rank}_", dir=shm)
            if image_processor is not None:
                model_dir = self.weights_dir
                write_model_dir(model, tokenizer, model_dir, image_processor)
                write_weights(self.model.named_parameters(), model_dir)
        spec = EngineSpec(
            model_dir=model_dir,
            dtype=self.dtype_name,
            seed=o.seed,
            max_model_len=o.max_model_len,
            device=device.type,
            enforce_eager=o.enforce_eager,
            gpu_memory_utilization=gpu_utilization(o.gpu_memory_utilization, device, rank),
            cuda_visible_devices=_visible_gpus(device, tensor_parallel_size),
            tensor_parallel_size=tensor_parallel_size,
            weights_dir=self.weights_dir,
            enable_sleep=o.enable_sleep,
            kv_cache_memory_bytes=o.kv_cache_memory_bytes,
            images_per_prompt=o.images_per_prompt,
            lora_rank=self.lora_rank,
        )
        self.sleeps = sleeps(spec)
        self.spec, self.rank, self.timeout_s = spec, rank, o.timeout_s
        self.log = get_logger(rank)
        self.budget = RestartBudget(o.max_restarts, o.restart_window_s)
        self.child = self._spawn({}, "overlapped with the rest of start-up")
        atexit.register(self.close)
        self.drop_weights()
        restartable = o.max_restarts > 0 and self.weights_dir is None and self.adapters is None
        copy = WeightCopy(pinned=device.type == "cuda") if restartable else None
        self.sink: EngineSink = (
            ChildStreamSink(self.child, self.model, device, copy)
            if self.weights_dir is None
            else WeightsFileSink(self.child, self.model, self.weights_dir)
        )
        if o.max_restarts > 0:
            self.sink.on_failure = self._restart
        if self.adapters is None:
            self.weights = self.sink
            self.log._emit(
                "info",
                f"rank {rank}: weight syncs stream bucket by bucket "
                + (
                    "to the vLLM child"
                    if self.weights_dir is None
                    else "into the weights file of the engine's tensor-parallel workers"
                )
                + (
                    "; this rank keeps no copy of the policy"
                    if copy is None
                    else f"; this rank keeps a host copy of each ({file_bytes(self.model.parameters()) / 2**30:.2f} "
                    "GiB) for restarting a failed child (--max_engine_restarts 0: none)"
                ),
            )
        self.log._emit(
            "info",
            f"rank {rank}: vLLM engine child started (pid {self.child.pid}, tensor parallel "
            f"{tensor_parallel_size}, log {self.child.log_path})",
        )

    def _spawn(self, sent_before: dict[str, int], when: str) -> EngineChild:
        """A new child (its log appends to the engine's). `sent_before`: the requests its predecessors were sent."""
        rank, log = self.rank, self.log
        return EngineChild(
            self.spec,
            os.path.join(self.workdir, "engine.log"),
            self.timeout_s,
            on_ready=lambda s: log._emit(
                "info", f"rank {rank}: vLLM engine child ready in {s:.1f} s (spawn -> ready, {when})"
            ),
            sent_before=sent_before,
        )

    @property
    def restarts(self) -> int:
        return self.budget.total

    def _restart(self, failure: ChildLinkError) -> None:
        """A new child in place of the failed one, given the last sync's weights; again while the new one fails too,
        until the restart budget is spent (which raises the failure: the job ends with it)."""
        while True:
            self.budget.spend(failure)
            first = (str(failure).splitlines() or [""])[0]
            self.log._emit(
                "warning",
                f"rank {self.rank}: {first}; restarting it with the last sync's weights (restart "
                f"{self.budget.total} of the run; --max_engine_restarts {self.budget.max_restarts} per "
                f"{self.budget.window_s:g} s)",
            )
            self.child.stop(timeout_s=1.0)  # killed already when it failed; its pipe is closed
            self.child = self._spawn(self.child.sent, f"restart {self.budget.total}")
            self.sink.attach(self.child)
            try:
                if self.adapters is not None:  # the base weights are its start's; the adapters go again
                    self.child.wait_ready()
                    if self.adapters.current is not None:
                        self.child.request("loading the LoRA adapters", "adapter", self.adapters.current)
                elif self.sink.has_weights:
                    self.sink.replay()
                else:  # before the first sync: the next one gives it the weights
                    self.child.wait_ready()
                return
            except ChildLinkError as err:
                failure = err

    def _request(self, doing: str, *msg: object) -> object:
        """A request to the child; a failed child is restarted (with the weights) and the request sent again."""
        while True:
            try:
                return self.child.request(doing, *msg)
            except ChildLinkError as failure:
                self._restart(failure)

    # ---- weights ------------------------------------------------------------------------------

    def load_weights(self) -> None:
        """A LoRA policy: the child loads the adapters the sync left. Else nothing to do: the sink loaded the weights
        during the sync. Records how long that took."""
        version = self.next_adapter()
        if version is None:
            self.last_sync_s = self.sink.last_sync_s
            return
        t0 = time.perf_counter()
        self._request("loading the LoRA adapters", "adapter", version)
        assert self.adapters is not None
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
        """sample() with one given seed per row (the rows of several ranks sampled in one call)."""
        tokens, logprobs = cast(  # the child's reply to "generate" (rlrun.engines.vllm.child)
            "tuple[list[list[int]], list[list[float]]]",
            self._request("generating", "generate", prompts, seeds, self.sampling_for(stop, max_new_tokens), images),
        )
        if self.sleeps:  # GPU --vllm_enable_sleep: asleep through scoring and training; the next push wakes it
            self._request("sleeping", "sleep")
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


# ---- tensor parallel ---------------------------------------------------------------------------------------------
# One vLLM engine over an engine's T ranks (--vllm_tensor_parallel_size T > 1).
#
# The engine's first rank hosts the vLLM child with T tensor-parallel workers and alone takes the actor's weights
# (its sink writes the file the workers read; the other ranks keep nothing, and only join the actor's gathers when
# they are actor ranks too); every rank still produces its own share of the rollouts. On each sample() call the ranks
# hand their prompts and seeds to the first rank, which samples all rows in one call, with every row keeping the seed
# its own rank gave it, and hands each rank its rows back. Every rank of
# the engine must therefore call sample() the same number of times (single-turn generation and evaluation do;
# multi-turn episodes are refused with tensor parallel > 1 before anything starts).


class RowExchange(Protocol):
    """Provided by rlrun.launch.transfer.EngineRowExchange (the engine's process group stays there)."""

    @property
    def is_leader(self) -> bool: ...

    def to_leader(self, mine: object) -> list[object] | None: ...

    def from_leader(self, parts: list[object] | None) -> object: ...


class TensorParallelEngine:
    def __init__(
        self, model: nn.Module, sampling: SamplingSettings, exchange: RowExchange, leader: VLLMEngine | None
    ) -> None:
        assert (leader is not None) == exchange.is_leader
        self.model = model  # on the meta device: the parameters' names and shapes
        self.weights = leader.weights if leader is not None else None  # the first rank takes them for the engine
        self.sampling = sampling
        self.exchange = exchange
        self.leader = leader

    def sample(
        self,
        prompts: list[list[int]],
        seed: int,
        *,
        max_new_tokens: int | None = None,
        stop: tuple[str, ...] = (),
        vision: RowVision | None = None,
        keys: list[int] | None = None,
    ) -> Generation:
        refuse_images(vision, "tensor-parallel vLLM")  # planning refuses vision-language runs on them
        if keys is not None:  # planning refuses agents on tensor-parallel vLLM engines
            raise ValueError("tensor-parallel vLLM engines seed each rank's share of a call; they take no row keys")
        parts = self.exchange.to_leader({"prompts": prompts, "seed": seed})
        answers: list[object] | None = None
        if self.leader is not None:
            assert parts is not None
            shares: list[dict[str, Any]] = parts  # type: ignore[assignment]
            rows = [p for share in shares for p in share["prompts"]]
            seeds = [s for share in shares for s in request_seeds(share["seed"], len(share["prompts"]))]
            # The sampling settings may have been changed on this object (evaluation's temperature): use them.
            self.leader.sampling = self.sampling
            out = self.leader.sample_seeded(rows, seeds, max_new_tokens=max_new_tokens, stop=stop)
            answers, start = [], 0
            for share in shares:
                end = start + len(share["prompts"])
                answers.append(
                    {
                        "responses": out.responses[start:end],
                        "log_probs": out.log_probs[start:end] if out.log_probs is not None else None,
                    }
                )
                start = end
        mine: dict[str, Any] = self.exchange.from_leader(answers)  # type: ignore[assignment]
        return Generation(mine["responses"], mine["log_probs"])

    def generate(self, prompts: list[list[int]], seed: int) -> list[list[int]]:
        return self.sample(prompts, seed).responses

    @property
    def restarts(self) -> int:
        return self.leader.restarts if self.leader is not None else 0

    def load_weights(self) -> None:
        if self.leader is not None:
            self.leader.load_weights()

    def sleep(self) -> None:
        if self.leader is not None:
            self.leader.sleep()

    def wake(self) -> None:
        if self.leader is not None:
            self.leader.wake()

    def close(self) -> None:
        if self.leader is not None:
            self.leader.close()
