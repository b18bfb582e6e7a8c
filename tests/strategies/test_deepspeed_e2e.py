"""`torchrun -m rlrun.ppo --strategy deepspeed` end to end on the embedded tiny model (real DeepSpeed, CPU, gloo):
a short GAE run that finishes and checkpoints, an exact resume from its checkpoint, ZeRO-3 with every role on every
rank (run and exact resume), and the ZeRO-3 refusal on role subgroups.
Skipped (with the reason) when deepspeed is not installed."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
from transformers import AutoModelForCausalLM

from helpers import run_rlrun, untimed
from rlrun.checkpoint import store as ckpt
from rlrun.config.tree import Config
from rlrun.plan.plan import lay_out
from rlrun.runtime.errors import ConfigError

pytestmark = pytest.mark.skipif(importlib.util.find_spec("deepspeed") is None,
                                reason="deepspeed is not installed (pip install 'rlrun[deepspeed]'): "
                                       "DeepSpeed strategy tests skipped")

N = 2  # checkpoint every N steps; the reference runs 2N
SMALL = ["--config", "configs/demo.yaml", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2",
         "--train_batch_size", "8", "--micro_train_batch_size", "2", "--micro_rollout_batch_size", "2",
         "--generate_max_len", "8", "--dist_timeout", "60"]
# 3 ranks: actor (+ reference, + generation) on ranks 0-1, so ZeRO-2 partitions over 2 ranks; the critic
# alone on rank 2, so it does not hold global rank 0.
LAYOUT = ["--actor_num_gpus_per_node", "2", "--critic_num_gpus_per_node", "1"]
DS = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--gradient_checkpointing",
      "--strategy", "deepspeed", "--zero_stage", "2"]



def _dcp(directory: Path, out: Path) -> dict:
    dcp_to_torch_save(str(directory), str(out))
    return torch.load(out, weights_only=False)


def _same_tensors(a: Path, b: Path) -> None:
    ta, tb = load_file(a), load_file(b)
    assert ta.keys() == tb.keys()
    different = [k for k in ta if not torch.equal(ta[k], tb[k])]
    assert not different, f"{len(different)} tensors differ between {a} and {b}, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    save = tmp_path_factory.mktemp("ds_reference")
    res = run_rlrun(3, SMALL + LAYOUT + DS + ["--max_steps", str(2 * N), "--save_steps", str(N), "--ckpt_path",
                                              str(save / "ckpt")], save, timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    return save, res


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_deepspeed_run_finishes_and_saves(reference, tmp_path):
    save, res = reference
    assert [m["step"] for m in res.metrics] == list(range(1, 2 * N + 1))
    assert all(torch.isfinite(torch.tensor(m["critic/value_loss"])) for m in res.metrics)
    assert res.metrics[-1]["kl"] > 0  # the DeepSpeed actor moved away from the reference
    assert sorted(p.name for p in (save / "ckpt").iterdir()) == ["latest", "step_00000002", "step_00000004"]
    meta = json.loads((save / "ckpt" / "step_00000004" / ckpt.COMPLETE).read_text())["meta"]
    assert meta["strategy"] == "deepspeed"
    # The final HF export (HF names, not DeepSpeed's "module." ones) holds exactly the fp32 master weights of the
    # last checkpoint, which rlrun wrote itself (DCP, by parameter name) without DeepSpeed's save_checkpoint.
    master = _dcp(save / "ckpt" / "step_00000004" / "actor", tmp_path / "actor.pt")["model"]
    exported = load_file(save / "model.safetensors")
    assert master and set(master) <= set(exported)
    assert all(torch.equal(master[k], exported[k]) for k in master)
    AutoModelForCausalLM.from_pretrained(save)


@pytest.mark.slow
@pytest.mark.timeout(330)
def test_deepspeed_resume_is_exact(reference, tmp_path):
    """Resuming from step N reproduces steps N+1..2N of the uninterrupted run and its final weights, bit for bit."""
    ref_save, ref = reference
    (tmp_path / "ckpt").mkdir()
    shutil.copytree(ckpt.step_dir(str(ref_save / "ckpt"), N), ckpt.step_dir(str(tmp_path / "ckpt"), N))
    res = run_rlrun(3, SMALL + LAYOUT + DS + ["--max_steps", str(2 * N), "--save_steps", str(N), "--load_checkpoint",
                                              "--ckpt_path", str(tmp_path / "ckpt")], tmp_path, timeout=300)
    assert res.returncode == 0, res.output[-4000:]
    assert f"resumed from {ckpt.step_dir(str(tmp_path / 'ckpt'), N)} at step {N}" in res.output
    assert [m["step"] for m in res.metrics] == list(range(N + 1, 2 * N + 1))
    assert untimed(res.metrics) == untimed(ref.metrics[N:])
    _same_tensors(tmp_path / "model.safetensors", ref_save / "model.safetensors")
    # The critic (rank 2 only): its step-2N checkpoint, weights and Adam moments, bit for bit.
    step = Path(ckpt.step_dir(str(tmp_path / "ckpt"), 2 * N)).name
    got, want = (_dcp(root / "ckpt" / step / "critic", tmp_path / f"{name}.pt")
                 for root, name in ((tmp_path, "got"), (ref_save, "want")))
    assert got["model"].keys() == want["model"].keys() and got["model"]
    assert all(torch.equal(got["model"][k], want["model"][k]) for k in want["model"])
    assert all(torch.equal(got["optim"][k][m], want["optim"][k][m]) for k in want["optim"] for m in want["optim"][k])
    assert float(got["meta"]["step"]) == float(want["meta"]["step"]) == 2 * N


@pytest.mark.timeout(120)
def test_zero3_on_a_role_subgroup_is_refused_before_anything_starts(tmp_path):
    disjoint = ["--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1"]  # actor: rank 0, critic: rank 1
    res = run_rlrun(2, SMALL + disjoint + DS[:-1] + ["3", "--max_steps", "1"], tmp_path, timeout=100)
    assert res.returncode != 0
    assert "--strategy deepspeed --zero_stage 3 needs the role (actor: rank 0) to span all 2 ranks" in res.output
    assert "Use --strategy fsdp --zero_stage 3" in res.output
    assert res.metrics == []


def _cfg(**train: object) -> Config:
    cfg = Config()
    cfg.train.strategy = "deepspeed"
    for key, value in train.items():
        setattr(cfg.train, key, value)
    return cfg


def test_zero3_refusal_names_the_role_its_ranks_and_the_alternative():
    cfg = _cfg(zero_stage=3, rollout_batch_size=8, train_batch_size=8, micro_train_batch_size=1,
               micro_rollout_batch_size=1)
    cfg.algo.advantage_estimator = "gae"
    cfg.resources.actor_num_gpus_per_node = 2
    cfg.resources.critic_num_gpus_per_node = 2
    with pytest.raises(ConfigError) as err:
        lay_out(cfg, world_size=4, ranks_per_node=4)
    text = str(err.value)
    assert "\n" not in text
    assert "(actor: ranks 0-1) to span all 4 ranks" in text
    assert "stage3.py:914" in text and "--strategy fsdp --zero_stage 3" in text
    cfg.resources.actor_num_gpus_per_node = cfg.resources.critic_num_gpus_per_node = None
    cfg.resources.colocate_all_models = True  # every role on every rank: ZeRO-3 plans
    lay_out(cfg, world_size=4, ranks_per_node=4)


ZERO3 = ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--colocate_all_models", "--strategy", "deepspeed",
         "--zero_stage", "3"]


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_zero3_with_every_role_on_every_rank_trains_and_resumes_exactly(tmp_path):
    """Actor, critic, reference and engine on both ranks, the trained and frozen models ZeRO-3 partitioned: a run
    of 2N steps that checkpoints at N, and a resume from N that reproduces steps N+1..2N and the final weights."""
    full = run_rlrun(2, SMALL + ZERO3 + ["--max_steps", str(2 * N), "--save_steps", str(N), "--ckpt_path",
                                         str(tmp_path / "full" / "ckpt")], tmp_path / "full", timeout=280)
    assert full.returncode == 0, full.output[-4000:]
    assert [m["step"] for m in full.metrics] == list(range(1, 2 * N + 1))
    assert full.metrics[-1]["kl"] > 0 and all(torch.isfinite(torch.tensor(m["critic/value_loss"])) for m in full.metrics)
    (tmp_path / "resumed" / "ckpt").mkdir(parents=True)
    shutil.copytree(ckpt.step_dir(str(tmp_path / "full" / "ckpt"), N), ckpt.step_dir(str(tmp_path / "resumed" / "ckpt"), N))
    res = run_rlrun(2, SMALL + ZERO3 + ["--max_steps", str(2 * N), "--save_steps", str(N), "--load_checkpoint",
                                        "--ckpt_path", str(tmp_path / "resumed" / "ckpt")], tmp_path / "resumed", timeout=280)
    assert res.returncode == 0, res.output[-4000:]
    assert untimed(res.metrics) == untimed(full.metrics[N:])
    _same_tensors(tmp_path / "resumed" / "model.safetensors", tmp_path / "full" / "model.safetensors")
    AutoModelForCausalLM.from_pretrained(tmp_path / "full")
