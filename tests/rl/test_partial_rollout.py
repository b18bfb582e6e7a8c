"""--partial_rollout: the engine's pool of sequences in flight across weight syncs (rlrun.rl.partial_rollout), its
checks, and a real run.

The pool runs on the real native and HF engines over the real tiny model with long-tailed lengths
(helpers.save_long_tailed_base); the run is torchrun + gloo with the actor on rank 0 and the engine on rank 1."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from rlrun.cli.parser import parse_args
from rlrun.data.prompts import PromptSampler
from rlrun.engines.hf import HFEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.engines.native.engine import NativeEngine
from rlrun.models.tiny import BUILTIN_PROMPTS, EOS_ID, PAD_ID, build_byte_tokenizer
from rlrun.rl.partial_rollout import PoolSettings, SequencePool
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError

from helpers import untimed
from test_resume import _ok, torchrun

TOK = build_byte_tokenizer()
IDS = [TOK.encode(r["prompt"]) for r in BUILTIN_PROMPTS]
CAP, N, PROMPTS_PER_STEP = 32, 2, 8
# The pool tests' cap: at 32 tokens ~43% of this base's responses reach the cap (both engines, 1,280 draws), so a
# decode that waits for half its groups often meets that only at the cap, and no row is left to carry over a sync
# (seeds 0 and 2 of five); at 64 (~18% at the cap) every seed tried leaves rows running.
POOL_CAP = 64


@pytest.fixture(scope="module")
def base(long_tailed_base) -> str:
    return long_tailed_base


def _pool(base: str, staleness: int, native: bool = True) -> SequencePool:
    model = AutoModelForCausalLM.from_pretrained(base)
    sampling = SamplingSettings(1.0, 1.0, POOL_CAP, PAD_ID, (EOS_ID,))
    engine = (NativeEngine if native else HFEngine)(model, sampling, torch.device("cpu"), TOK)
    sampler = PromptSampler(len(IDS), 2 * PROMPTS_PER_STEP, seed=1, num_episodes=1)  # 2 engines: this is slot 1
    return SequencePool(engine, IDS, sampler, 1, 2, PoolSettings(N, PROMPTS_PER_STEP, POOL_CAP, 8, staleness, (EOS_ID,), 7))


def _steps(pool: SequencePool, steps: int, ahead: int = 0) -> list[list]:
    """take() as the async loop calls it: step 0 with the initial weights, then step s while version s-1 is loaded,
    the learners' flag rising after the engine looked at it `ahead` times (chunks it generates ahead)."""
    def flag() -> Callable[[], bool]:
        looks = iter(range(ahead + 1))
        return lambda: next(looks, ahead) >= ahead

    return [pool.take(step, max(step - 1, 0), flag() if step else None) for step in range(steps)]


@pytest.mark.parametrize("native,ahead", [(True, 0), (True, 2), (False, 1)], ids=["native", "native-ahead", "hf-ahead"])
def test_pool_hands_whole_finished_groups_within_the_staleness_bound(base, native, ahead):
    pool = _pool(base, staleness=2, native=native)
    batches = _steps(pool, 6, ahead)
    mine = pool.sampler.indices(0)[PROMPTS_PER_STEP:]  # slot 1's share of step 0's prompts
    assert {row.record for row in batches[0]} <= set(mine) | set(pool.sampler.indices(1)[PROMPTS_PER_STEP:])
    spans = 0
    for step, rows in enumerate(batches):
        assert len(rows) == N * PROMPTS_PER_STEP
        for g in range(PROMPTS_PER_STEP):  # whole groups, each of one prompt
            assert len({row.record for row in rows[g * N:(g + 1) * N]}) == 1
        for row in rows:
            assert row.done and (row.tokens[-1] == EOS_ID or len(row.tokens) == POOL_CAP), row.tokens
            assert EOS_ID not in row.tokens[:-1] and len(row.tokens) == len(row.log_probs) == len(row.versions)
            assert row.versions == sorted(row.versions) and 0 <= row.staleness(step) <= 2
            assert row.prompt == IDS[row.record]
            spans += len(set(row.versions)) > 1
    assert spans > 0  # long responses did carry over a weight sync and continue
    lengths = sorted(len(row.tokens) for rows in batches for row in rows)
    assert lengths[len(lengths) // 4] < POOL_CAP // 4 and lengths[-1] == POOL_CAP  # long-tailed, as the workload should be


def test_stale_groups_restart(base):
    """A group holding a token older than --max_staleness allows starts over from its prompt (rows tagged by hand:
    the engine's own rows rarely get that old)."""
    pool = _pool(base, staleness=2, native=False)
    _steps(pool, 2)
    group = pool.active[0] if pool.active else pool.ready[0]
    for row in group:
        row.tokens, row.log_probs, row.versions, row.done = [65, 66], [-1.0, -1.0], [0, 0], False
    pool._restart_stale(3)  # trained at 3 with K=2: tokens of version 0 are too old
    assert all(row.restarted and row.tokens == [] and row.versions == [] for row in group)
    assert group in pool.active and group not in pool.ready


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_staleness_one_is_async_train(tmp_path):
    """K=1 allows no response across a sync: the run is --async_train's, metric for metric (and says so)."""
    small = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
             "--train_batch_size", "8", "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4",
             "--generate_max_len", "8", "--actor_num_gpus_per_node", "1", "--vllm_num_engines", "1", "--async_train",
             "--max_steps", "3", "--dist_timeout", "60"]
    plain = torchrun(2, small, tmp_path / "async")
    bounded = torchrun(2, small + ["--partial_rollout", "--max_staleness", "1"], tmp_path / "k1")
    _ok(plain)
    _ok(bounded)
    assert untimed(plain.metrics) == untimed(bounded.metrics)
    assert "--max_staleness 1 is --async_train's loop" in bounded.output


def _plan(*argv: str):
    return lay_out(parse_args(["--n_samples_per_prompt", "2", "--advantage_estimator", "group_norm", "--init_kl_coef",
                            "0", *argv]).config, 4, 4)


def test_checks_before_launch():
    disjoint = ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2"]
    assert _plan("--async_train", "--partial_rollout", *disjoint).layout.asynchronous
    # the engines' "trained" flag has a group of its own only where something waits for it
    assert "ready" in {g.name for g in _plan("--async_train", "--partial_rollout", *disjoint).layout.groups}
    assert "ready" not in {g.name for g in _plan("--async_train", *disjoint).layout.groups}
    tensor_parallel = _plan("--async_train", "--partial_rollout", "--actor_num_gpus_per_node", "2",
                            "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2").layout
    assert tensor_parallel.asynchronous and tensor_parallel.engines == ((2, 3),)
    cases = {
        ("--partial_rollout", *disjoint): "--partial_rollout needs --async_train",
        ("--async_train", "--partial_rollout"): "needs the engines on ranks of their own",
        ("--async_train", "--partial_rollout", *disjoint, "--rollout_batch_size", "3", "--train_batch_size", "6",
         "--micro_train_batch_size", "1", "--micro_rollout_batch_size", "1"): "must be a multiple of the 2 engines",
        ("--async_train", "--partial_rollout", "--max_staleness", "0", *disjoint): "--max_staleness must be",
    }
    for argv, message in cases.items():
        with pytest.raises(ConfigError, match=message):
            _plan(*argv)
    cfg = parse_args(["--train.async_enable", "--train.partial_rollout_enable"]).config  # OpenRLHF 0.11's names
    assert cfg.train.async_train and cfg.train.partial_rollout


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_run_streams_partial_rollouts_and_resumes(base, tmp_path):
    """8 steps with a checkpoint at 4: every batch after the first is generated before the last update and no sample
    is more than --max_staleness versions old; the resumed run continues from step 8 with the batch that was in
    flight (the sequences still being generated at the save are dropped and their prompts start over: documented).
    Whether samples span versions depends on how far the engine gets before the actor's flag (timing): the pool
    tests check that part deterministically."""
    args = ["--config", "configs/demo.yaml", "--pretrain", base, "--remote_rm_url", "demo", "--generate_max_len",
            str(CAP), "--rollout_batch_size", "8", "--n_samples_per_prompt", "2", "--train_batch_size", "16",
            "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8", "--actor_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--async_train", "--partial_rollout", "--partial_rollout_tokens", "8",
            "--actor_learning_rate", "1e-4", "--dist_timeout", "60"]
    run = torchrun(2, args + ["--max_steps", "8", "--save_steps", "4"], tmp_path / "a")
    _ok(run)
    steps = run.metrics
    assert [m["step"] for m in steps] == list(range(1, 9))
    assert all(1 <= m["async/staleness_mean"] <= m["async/staleness_max"] <= 2 for m in steps[1:])
    assert steps[0]["async/staleness_max"] == 0 and all(0 <= m["async/partial_frac"] <= 1 for m in steps)
    assert all("rollout/engine_vs_actor_logprob_diff" in m for m in steps)
    resumed = torchrun(2, args + ["--max_steps", "10", "--load_checkpoint"], tmp_path / "b",
                       ckpt_path=run.ckpt)
    _ok(resumed)
    assert "at step 8" in resumed.output
    assert [m["step"] for m in resumed.metrics] == [9, 10]
    assert all(m["async/staleness_max"] <= 2 for m in resumed.metrics)


def test_verl_fully_async_keys():
    """verl's fully-async trainer keys (verl/experimental/fully_async_policy): partial_rollout turns the async loop
    and partial rollouts on; the keys rlrun does differently are reported with what rlrun does instead."""
    parsed = parse_args(["async_training.partial_rollout=True", "async_training.staleness_threshold=0.5",
                         "async_training.trigger_parameter_sync_step=4", "rollout.n_gpus_per_node=4"])
    assert parsed.config.train.async_train and parsed.config.train.partial_rollout
    ignored = {line.split(":")[0]: line for line in parsed.ignored}
    assert "--max_staleness" in ignored["async_training.staleness_threshold"]
    assert {"async_training.trigger_parameter_sync_step", "rollout.n_gpus_per_node"} <= ignored.keys()
    off = parse_args(["async_training.partial_rollout=false"]).config.train
    assert off.async_train and not off.partial_rollout
