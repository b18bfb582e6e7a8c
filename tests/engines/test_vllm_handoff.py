"""The vLLM child host's weight hand-off and its /dev/shm checks, and --vllm_seeded_requests: the parts that need no
vLLM (main venv). The CUDA side of the hand-off runs in bench/gpu/harness.py's check_cuda_ipc on a GPU; its CPU
twin runs here, through the same functions."""

from __future__ import annotations

import os
import shutil
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file

from rlrun.cli.parser import parse_args
from rlrun.models.safetensors import unshared
from rlrun.engines.vllm import adapter as vllm_adapter
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.vllm.adapter import Sampling, batch_seed, request_kwargs, write_weights
from rlrun.engines.vllm.engine import VLLMEngine, VLLMEngineBase, VLLMOptions, request_seeds
from rlrun.engines.vllm.handoff import (SHM_DIR, SharedMemoryError, check_shm, free_bytes, memory_key, pack, unpack,
                                        unshared_bytes)
from rlrun.models.tiny import EOS_ID, PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config
from rlrun.runtime.errors import RlrunError

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
needs_shm = pytest.mark.skipif(free_bytes(SHM_DIR) is None, reason=f"no {SHM_DIR} on this machine")


def _bucket_views() -> tuple[torch.Tensor, list[tuple[str, torch.Tensor]]]:
    """One uint8 bucket holding three parameters as views (as WeightSync binds an engine's parameters), plus one
    parameter with a storage of its own."""
    bucket = torch.zeros(4096, dtype=torch.uint8)
    named = [("w", bucket[:1024].view(torch.float32).view(16, 16)),
             ("h", bucket[1024:1536].view(torch.bfloat16)),
             ("b", bucket[1536:1600].view(torch.float32)),
             ("own", torch.arange(10, dtype=torch.float32))]
    return bucket, named


# ---- tensor files ------------------------------------------------------------------------------------------------


def test_unshared_keeps_disjoint_bucket_views_and_clones_only_overlaps(tmp_path):
    bucket, named = _bucket_views()
    tied = named + [("w_tied", named[0][1])]  # the same memory under two names (tied weights)
    out = unshared(tied)
    for name, t in named:  # not copied: the bucket is written as it is
        assert out[name].data_ptr() == t.data_ptr(), name
    assert out["w_tied"].data_ptr() != named[0][1].data_ptr() and torch.equal(out["w_tied"], named[0][1])
    save_file(out, str(tmp_path / "m.safetensors"))  # safetensors takes disjoint views of one storage
    back = load_file(str(tmp_path / "m.safetensors"))
    assert all(torch.equal(back[n].view(torch.uint8), t.view(torch.uint8)) for n, t in tied)


def test_write_weights_replaces_the_file_without_a_second_copy(tmp_path):
    _, named = _bucket_views()
    write_weights(named, str(tmp_path))
    named[0][1].fill_(2.0)
    write_weights(named, str(tmp_path))
    assert os.listdir(tmp_path) == ["model.safetensors"]  # no temporary file beside it
    back = load_file(str(tmp_path / "model.safetensors"))
    assert set(back) == {n for n, _ in named} and torch.equal(back["w"], torch.full((16, 16), 2.0))


# ---- free space --------------------------------------------------------------------------------------------------


def test_check_shm_compares_with_the_real_free_space(tmp_path):
    """A real statvfs on a real directory: a need one byte over what is free there is refused, with both numbers."""
    free = free_bytes(str(tmp_path))
    assert free is not None and free > 0
    check_shm(free // 2, "a test hand-off", str(tmp_path))  # fits: nothing raised
    with pytest.raises(SharedMemoryError, match=rf"a test hand-off needs {free + 1} bytes .* in {tmp_path}, but only "
                                                rf"\d+ bytes .* are free: free space there, or use a smaller model"):
        check_shm(free + 1, "a test hand-off", str(tmp_path))
    check_shm(10**30, "nothing", str(tmp_path / "missing"))  # no such directory: shared memory lives elsewhere


@needs_shm
def test_check_shm_on_dev_shm_names_the_docker_fix():
    free = free_bytes(SHM_DIR)
    with pytest.raises(SharedMemoryError) as err:
        check_shm(free + 2**30, "handing the vLLM engine child its weights on CPU (shared memory)")
    line = str(err.value)
    assert "\n" not in line and isinstance(err.value, RlrunError)
    assert f"needs {free + 2**30} bytes" in line and f"in {SHM_DIR}, but only" in line
    assert "docker run --shm-size=" in line and "--ipc=host" in line and "smaller model" in line


def _huge_meta_model():
    """A model far bigger than any /dev/shm, on the meta device (no memory): what an engine start must refuse."""
    config = tiny_model_config()
    config.vocab_size = 2**36 // (config.hidden_size * 4)  # a 64 GiB embedding alone
    with torch.device("meta"):
        from transformers import AutoModelForCausalLM

        return AutoModelForCausalLM.from_config(config)


@needs_shm
def test_engine_start_refuses_a_model_dev_shm_cannot_hold(monkeypatch):
    """The real /dev/shm (statvfs), a model whose weights file (tensor parallel 2: the workers read every sync from
    it) cannot fit it: refused at engine start, before any file is written and before the child is spawned. (At
    tensor parallel 1 a sync puts two buckets in /dev/shm, checked when the child is handed them.)"""
    tp = 2
    model = _huge_meta_model()
    need = sum(p.numel() * p.element_size() for p in model.parameters())
    if need < free_bytes(SHM_DIR):
        pytest.skip(f"{SHM_DIR} is larger than {need} bytes")
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: "0.32.0")  # the version gate only
    spawned = []
    monkeypatch.setattr("rlrun.engines.vllm.engine.EngineChild", lambda *a, **k: spawned.append(a))
    before = set(os.listdir(SHM_DIR))
    sampling = SamplingSettings(1.0, 1.0, 4, PAD_ID, (EOS_ID,))
    with pytest.raises(SharedMemoryError, match=r"needs \d+ bytes .* in /dev/shm, but only \d+ bytes .* are free: .*"
                                                r"docker run --shm-size="):
        VLLMEngine(model, build_byte_tokenizer(), sampling, torch.device("cpu"),
                   VLLMOptions(0, 0, 64, tensor_parallel_size=tp, timeout_s=10))
    assert not spawned and not [n for n in set(os.listdir(SHM_DIR)) - before if n.startswith("rlrun_vllm_w")]


# ---- the hand-off (CPU: shared memory) ---------------------------------------------------------------------------


def test_pack_sends_each_storage_once_and_views_share_the_memory():
    bucket, named = _bucket_views()
    assert unshared_bytes(t for _, t in named) == 4096 + 40
    before = memory_key(named)
    handoff = pack(named)
    assert len(handoff.storages) == 2 and [v.storage for v in handoff.views] == [0, 0, 0, 1]
    assert bucket.is_shared() and all(t.is_shared() for _, t in named)  # moved in place: the bucket followed
    assert unshared_bytes(t for _, t in named) == 0 and memory_key(named) != before  # now in shared memory
    same = memory_key(named)
    named[0][1].add_(1.0)  # a sync written in place: nothing to send again
    assert memory_key(named) == same
    received = dict(unpack(handoff))
    assert all(received[n].data_ptr() == t.data_ptr() and received[n].dtype == t.dtype for n, t in named)
    named[3] = ("own", named[3][1].clone())  # rebound to new memory: the key changes, a new hand-off is due
    assert memory_key(named) != same


def test_harness_check_cuda_ipc_cpu_twin_hands_over_across_processes():
    """bench/gpu/harness.py's check_cuda_ipc with --cpu: bucket views to a spawned process through pack/unpack, read
    there, rewritten in place here, re-read there without a resend."""
    sys.path.insert(0, os.path.join(REPO, "bench", "gpu"))  # the spawned process imports harness too
    try:
        import harness

        result = harness.check_cuda_ipc(True)
    finally:
        sys.path.remove(os.path.join(REPO, "bench", "gpu"))
    assert result.status == "pass", result
    assert result.numbers["storages_sent"] == 4 and result.numbers["views"] == 7


# ---- --vllm_seeded_requests --------------------------------------------------------------------------------------


def test_requests_carry_seeds_only_when_seeded():
    seeds = request_seeds(7, 4)
    plain = request_kwargs(Sampling(0.7, 0.9, 16, (EOS_ID,), stop=("\n",)), seeds)
    seeded = request_kwargs(Sampling(0.7, 0.9, 16, (EOS_ID,), stop=("\n",), seeded=True), seeds)
    assert len(plain) == len(seeded) == 4
    assert all("seed" not in kw for kw in plain)  # vLLM's batched sampler; one seed for the call instead
    assert [kw["seed"] for kw in seeded] == seeds  # one per request: the row does not depend on the batch
    for a, b in zip(plain, seeded):
        assert {k: v for k, v in b.items() if k != "seed"} == a
        assert a["temperature"] == 0.7 and a["max_tokens"] == 16 and a["logprobs"] == 0 and a["stop"] == ["\n"]
    assert plain[0]["stop_token_ids"] is not plain[1]["stop_token_ids"]  # no list shared between requests
    assert plain[0]["stop_token_ids"] == [EOS_ID]
    # every id that ends a response (Qwen's <|im_end|> and <|endoftext|>) stops vLLM's request too
    assert request_kwargs(Sampling(1.0, 1.0, 4, (151645, 151643)), [0])[0]["stop_token_ids"] == [151645, 151643]


def test_batch_seed_is_a_function_of_the_rows_seeds():
    seeds = request_seeds(3, 8)
    assert batch_seed(seeds) == batch_seed(list(seeds)) and 0 <= batch_seed(seeds) < 2**63
    assert len({batch_seed(seeds), batch_seed(seeds[:7]), batch_seed(seeds[::-1]), batch_seed(request_seeds(4, 8))}) == 4


def test_vllm_seeded_requests_flag_reaches_the_engines_sampling(monkeypatch):
    assert parse_args([]).config.generation.vllm_seeded_requests is False
    assert parse_args(["--vllm_seeded_requests"]).config.generation.vllm_seeded_requests is True
    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: "0.32.0")
    model = build_causal_lm(tiny_model_config(), seed=0)
    sampling = SamplingSettings(1.0, 1.0, 4, PAD_ID, (EOS_ID,))
    engines = [VLLMEngineBase(model, build_byte_tokenizer(), sampling, torch.device("cpu"), VLLMOptions(0, 0, 64, seeded_requests=seeded))
               for seeded in (False, True)]
    try:
        assert engines[0].sampling_for((), None).seeded is False  # the default
        assert engines[1].sampling_for((), 3) == Sampling(1.0, 1.0, 3, (EOS_ID,), (), seeded=True)
    finally:
        for engine in engines:
            shutil.rmtree(engine.workdir, ignore_errors=True)
