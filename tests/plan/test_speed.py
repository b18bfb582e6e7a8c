"""The speed settings a run resolves (rlrun.plan.speed, issue 50 item 1): left unset, token-budget micro-batches and
the captured native decode step are on with a CUDA device and off on CPU; a value given is kept as given; the
start-up line names each setting, why it has its value and the flag that turns it off."""

from __future__ import annotations

import pytest

from helpers import REPO
from rlrun.cli.parser import parse_args
from rlrun.launch.env import DistEnv
from rlrun.plan.checks import check_values
from rlrun.plan.plan import plan_ppo
from rlrun.plan.speed import resolve_speed, speed_line
from rlrun.runtime.errors import ConfigError

DEMO = ["--config", str(REPO / "configs" / "demo.yaml")]


@pytest.fixture(autouse=True)
def _one_process(monkeypatch):
    for name in ("WORLD_SIZE", "SLURM_NTASKS"):
        monkeypatch.delenv(name, raising=False)


def _resolved(*argv: str, cuda: bool):
    parsed = parse_args([*DEMO, *argv])
    return parsed.config, resolve_speed(parsed.config, cuda, parsed.explicit)


def _line(*argv: str, cuda: bool) -> str:
    parsed = parse_args([*DEMO, *argv])
    return speed_line(resolve_speed(parsed.config, cuda, parsed.explicit), cuda, parsed.explicit)


def test_unset_settings_take_the_devices_default():
    requested, cpu = _resolved(cuda=False)
    assert cpu == requested  # the fields' own defaults are the CPU's
    assert (cpu.train.dynamic_batch, cpu.generation.native_cuda_graph) == (False, False)
    assert cpu.train.train_max_tokens_per_gpu == requested.train.train_max_tokens_per_gpu
    assert cpu.train.packing_samples is False
    _, gpu = _resolved(cuda=True)
    assert (gpu.train.dynamic_batch, gpu.generation.native_cuda_graph, gpu.train.packing_samples) == (True, True, True)
    # the memory plan's micro-batches: the demo's 8 (training) and 16 (scoring) rows of 64 + 16 tokens
    assert (gpu.train.train_max_tokens_per_gpu, gpu.train.rollout_max_tokens_per_gpu) == (8 * 80, 16 * 80)
    check_values(gpu)


@pytest.mark.parametrize("argv", [
    ["--dynamic_batch", "false", "--native_cuda_graph", "false", "--packing_samples", "false"],
    ["--use_dynamic_batch=false", "--native_cuda_graph=false", "--ds.packing_samples=false"],
    ["--dynamic_batch", "false", "--native_cuda_graph", "false", "actor_rollout_ref.model.use_remove_padding=false"],
])
def test_a_value_given_is_kept_on_a_gpu(argv):
    _, gpu = _resolved(*argv, cuda=True)
    assert (gpu.train.dynamic_batch, gpu.generation.native_cuda_graph, gpu.train.packing_samples) == (False,) * 3
    _, cpu = _resolved("--dynamic_batch", "--native_cuda_graph", cuda=False)
    assert (cpu.train.dynamic_batch, cpu.generation.native_cuda_graph) == (True, True)


def test_a_default_budget_is_the_plans_micro_batch_and_a_given_one_is_checked():
    """32K-token responses: the default-on budgets are the fixed micro-batches the plan counts (rows x the longest
    row); a budget given below the longest row fails naming both numbers, --dynamic_batch asked for or not."""
    lengths = ["--prompt_max_len", "1024", "--generate_max_len", "32768", "--micro_train_batch_size", "2",
               "--micro_rollout_batch_size", "4"]
    _, gpu = _resolved(*lengths, cuda=True)
    assert (gpu.train.train_max_tokens_per_gpu, gpu.train.rollout_max_tokens_per_gpu) == (2 * 33792, 4 * 33792)
    check_values(gpu)
    _, given = _resolved(*lengths, "--rollout_max_tokens_per_gpu", "50000", cuda=True)
    assert (given.train.train_max_tokens_per_gpu, given.train.rollout_max_tokens_per_gpu) == (2 * 33792, 50000)
    for extra in (["--rollout_max_tokens_per_gpu", "8192"], ["--dynamic_batch"]):
        _, bad = _resolved(*lengths, *extra, cuda=True)
        with pytest.raises(ConfigError, match=r"_max_tokens_per_gpu \d+ is below .* = 33792 tokens"):
            check_values(bad)


def test_a_dry_run_for_gpus_off_a_gpu_node_resolves_as_the_gpu_run():
    planned = plan_ppo([*DEMO, "--dry_run", "--gpu_memory_gb", "80", "--save_path", "/tmp/rlrun-speed-plan"],
                       DistEnv(0, 0, 1, 1, "127.0.0.1", 29500, "single"))
    t = planned.config.train
    assert t.dynamic_batch and t.packing_samples and planned.config.generation.native_cuda_graph


def test_the_line_names_each_setting_why_and_its_flag():
    line = _line("--generation_backend", "native", cuda=True)
    assert line == ("speed settings: token-budget micro-batches (GPU default; <= 640 tokens to train, 1,280 to "
                    "score per rank, the memory plan's 8 and 16 rows of 80 tokens: --train_max_tokens_per_gpu, "
                    "--rollout_max_tokens_per_gpu; off: --dynamic_batch false); packed rows, each sequence attending by itself (GPU default; off: --packing_samples "
                    "false); log-probs over the vocabulary 1,024 positions at a time (--logits_chunk_size); native "
                    "decode steps captured as CUDA graphs (GPU default; off: --native_cuda_graph false)")
    line = _line("--generation_backend", "native", "--native_cuda_graph", "false", "--packing_samples", "false",
                 "--logits_chunk_size", "0", cuda=True)
    assert "padded rows, each micro-batch cut to its longest (as set; packed: --packing_samples)" in line
    assert "whole vocabulary at once (--logits_chunk_size 0)" in line
    assert line.endswith("native decode steps run eagerly (as set; captured: --native_cuda_graph)")
    assert "native decode" not in _line("--generation_backend", "vllm", cuda=True)


def test_the_plan_carries_the_resolved_settings_and_the_line():
    planned = plan_ppo([*DEMO, "--save_path", "/tmp/rlrun-speed-plan"], DistEnv(0, 0, 1, 1, "127.0.0.1", 29500, "single"))
    assert planned.config.train.dynamic_batch is False and planned.config.generation.native_cuda_graph is False
    assert planned.speed.startswith("speed settings: fixed micro-batches of 8 rows to train, 16 to score (CPU default")


def test_the_memory_plan_counts_a_given_budget_and_the_default_one_as_the_micro_batch():
    """The plan's activations follow --dynamic_batch's budget: the default-on budget plans what the fixed
    micro-batch does, and OpenRLHF's 16,192-token budget over 5,120-token rows plans 4 rows (rounded up), not 2."""
    from rlrun.plan.shapes import Target, budget_rows, knobs_of

    lengths = ["--prompt_max_len", "1024", "--generate_max_len", "4096", "--micro_train_batch_size", "2",
               "--micro_rollout_batch_size", "4"]
    target = Target(gpu=True, gpu_bytes=80 * 2**30, source="test")
    fixed = knobs_of(_resolved(*lengths, "--dynamic_batch", "false", cuda=True)[1], target)
    default = knobs_of(_resolved(*lengths, cuda=True)[1], target)
    given = knobs_of(_resolved(*lengths, "--dynamic_batch", "--train_max_tokens_per_gpu", "16192", cuda=True)[1],
                     target)
    assert (fixed.micro_train, fixed.micro_rollout) == (default.micro_train, default.micro_rollout) == (2, 4)
    assert (given.micro_train, given.micro_rollout) == (4, 4)  # scoring: the training budget, as OpenRLHF
    assert budget_rows(2, None, 5120) == 2 and budget_rows(2, 100, 5120) == 1
