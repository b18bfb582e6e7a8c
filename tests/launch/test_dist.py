"""Process-group and device set-up: the default group binds no device (an eager communicator split on every new_group
hangs groups made by only some ranks and fails on gloo, as seen on an H200), --tf32 sets the GPU's fp32 matmul mode
while leaving the CPU alone, NCCL runs record their last collectives (PyTorch's flight recorder) for a timeout to
dump, and gloo's worker threads start no OpenMP team of their own (a fresh process)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from rlrun.cli.parser import parse_args
from rlrun.launch import dist
from rlrun.launch.env import DistEnv


def test_the_default_group_binds_no_device(monkeypatch) -> None:
    calls = []
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *args, **kwargs: calls.append(kwargs))
    monkeypatch.setattr(dist, "keep_worker_threads_serial", lambda: False)  # this process's threads stay as they are
    dist.init_distributed(DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "single"), "nccl", 60.0)
    assert len(calls) == 1 and calls[0].get("device_id") is None


def test_tf32_is_set_on_a_gpu_only(monkeypatch) -> None:
    matmul, cudnn = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        assert dist.resolve_device_and_precision("cpu", 0, tf32=True).type == "cpu"
        assert torch.backends.cuda.matmul.allow_tf32 is False  # the CPU run is left as it was
        monkeypatch.setattr(dist, "resolve_device", lambda requested, local_rank: torch.device("cuda", 0))
        dist.resolve_device_and_precision("cuda", 0, tf32=True)
        assert torch.backends.cuda.matmul.allow_tf32 and torch.backends.cudnn.allow_tf32
        dist.resolve_device_and_precision("cuda", 0, tf32=False)
        assert not torch.backends.cuda.matmul.allow_tf32 and not torch.backends.cudnn.allow_tf32
    finally:
        torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = matmul, cudnn
    assert parse_args([]).config.runtime.tf32 is True
    assert parse_args(["--tf32", "false"]).config.runtime.tf32 is False


def test_nccl_runs_turn_the_flight_recorder_on_without_overriding_the_user(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(dist.dist, "init_process_group", lambda *args, **kwargs: None)
    for name in ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE", "TORCH_NCCL_DUMP_ON_TIMEOUT",
                 "TORCH_NCCL_DEBUG_INFO_TEMP_FILE"):
        monkeypatch.setenv(name, "")  # recorded by monkeypatch, so what the code sets is undone after the test
        monkeypatch.delenv(name)
    single = DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "single")
    dist.init_distributed(single, "gloo", 60.0, str(tmp_path / "gloo"))
    assert "TORCH_NCCL_DUMP_ON_TIMEOUT" not in os.environ and not (tmp_path / "gloo").exists()
    dist.init_distributed(single, "nccl", 60.0, str(tmp_path / "first"))
    assert os.environ["TORCH_FR_BUFFER_SIZE"] == str(dist.NCCL_TRACE_ENTRIES)  # torch 2.11's name
    monkeypatch.delenv("TORCH_FR_BUFFER_SIZE")
    monkeypatch.delenv("TORCH_NCCL_DEBUG_INFO_TEMP_FILE")
    monkeypatch.setenv("TORCH_NCCL_TRACE_BUFFER_SIZE", "50")  # the user's own setting stays, under either name
    dist.init_distributed(single, "nccl", 60.0, str(tmp_path / "trace"))
    assert os.environ["TORCH_NCCL_TRACE_BUFFER_SIZE"] == "50" and "TORCH_FR_BUFFER_SIZE" not in os.environ
    assert os.environ["TORCH_NCCL_DUMP_ON_TIMEOUT"] == "1"
    assert os.environ["TORCH_NCCL_DEBUG_INFO_TEMP_FILE"] == str(tmp_path / "trace" / "nccl_trace_rank_")
    assert (tmp_path / "trace").is_dir()


def test_cpu_offload_gets_gloo_beside_nccl_and_tensors_go_where_nccl_is() -> None:
    """FSDP2 --adam_offload reduces its CPU gradients' norm over the role's group: an NCCL-only world refuses CPU
    tensors, so the world gets gloo beside NCCL (only then); group tensors still live on the GPU where NCCL is."""
    cuda, cpu = torch.device("cuda", 0), torch.device("cpu")
    offload = parse_args(["--adam_offload"]).config.train
    assert offload.reduces_on_cpu and not parse_args([]).config.train.reduces_on_cpu
    assert not parse_args(["--adam_offload", "--strategy", "deepspeed"]).config.train.reduces_on_cpu  # its own comm
    assert dist.resolve_dist_backend("auto", cuda, cpu_collectives=True) == "cpu:gloo,cuda:nccl"
    assert dist.resolve_dist_backend("nccl", cuda, cpu_collectives=True) == "cpu:gloo,cuda:nccl"
    assert dist.resolve_dist_backend("auto", cuda) == "nccl" and dist.resolve_dist_backend("auto", cpu, True) == "gloo"
    assert dist.resolve_dist_backend("gloo", cuda, cpu_collectives=True) == "gloo"
    assert dist.collective_device("cpu:gloo,cuda:nccl", cuda) == cuda and dist.collective_device("nccl", cuda) == cuda
    assert dist.collective_device("gloo", cuda) == cpu and dist.collective_device("gloo", cpu) == cpu


THREADS_PROBE = textwrap.dedent(
    """
    import os, sys, threading, torch
    from rlrun.launch import dist
    from rlrun.launch.env import DistEnv
    if sys.argv[1] == "unset":
        dist.keep_worker_threads_serial = lambda: False
    dist.init_distributed(DistEnv(0, 0, 1, 1, "127.0.0.1", 1, "single"), "gloo", 60.0)
    # a thread started by gloo's worker (an OpenMP worker takes its creator's name)
    gloos = lambda: {t for t in os.listdir("/proc/self/task") if open(f"/proc/self/task/{t}/comm").read().startswith("pt_gloo")}
    before = gloos()
    t = torch.zeros(1_000_000)
    dist.dist.all_gather_into_tensor(torch.empty_like(t), t)
    other = []
    threading.Thread(target=lambda: other.append(torch.get_num_threads())).start()
    print(len(gloos() - before), torch.get_num_threads(), other[0], flush=True)
    os._exit(0)  # gloo's threads would race the interpreter's finalization
    """
)


def test_gloos_worker_threads_start_no_openmp_team_of_their_own() -> None:
    """gloo's worker copies an all_gather's result into place, in parallel above 32k elements: left alone it starts
    an OpenMP worker of its own (a thread more, named after gloo's), after which libgomp manages more threads than
    CPUs and every barrier sleeps in the kernel (the slowdown measured in keep_worker_threads_serial). With rlrun's
    setting the copy runs serially (no such thread), the main thread keeps its 2 threads and another thread runs 1."""
    env = {**os.environ, "OMP_NUM_THREADS": "2"}
    runs = {}
    for mode in ("set", "unset"):
        out = subprocess.run(
            [sys.executable, "-c", THREADS_PROBE, mode], env=env, capture_output=True, text=True, timeout=120
        )
        assert out.returncode == 0, out.stderr[-2000:]
        runs[mode] = [int(v) for v in out.stdout.split()]
    assert runs["unset"] == [1, 2, 2]  # the problem, on this torch
    assert runs["set"] == [0, 2, 1]


def test_another_openmp_runtime_than_torchs_leaves_the_threads_as_they_were() -> None:
    """Were the libgomp found not torch's (a system copy loaded beside it), setting its count would leave this thread
    on torch's 1: the setting checks torch's count and undoes itself."""
    system = Path("/usr/lib/x86_64-linux-gnu/libgomp.so.1")
    if not system.exists():
        pytest.skip("no system libgomp here to stand for another OpenMP runtime")
    probe = textwrap.dedent(
        f"""
        import torch
        from rlrun.launch import dist
        dist._loaded_libraries = lambda: {{"libgomp": "{system}"}}
        print(dist.keep_worker_threads_serial(), torch.get_num_threads())
        """
    )
    out = subprocess.run([sys.executable, "-c", probe], env={**os.environ, "OMP_NUM_THREADS": "2"},
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["False", "2"]
