"""Skipping the actor's "old log-probs" pass when the update is exactly on-policy (assembly.skips_old_log_probs):
when it applies, and that it changes neither the trained weights nor the logged KL."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch
from transformers import AutoModelForCausalLM

from helpers import REPO, subprocess_env, update_actor, update_actor_seen
from rlrun.config.fields import build_config
from rlrun.config.tree import Config
from rlrun.data.rollout import pack_rows, unpack_rows
from rlrun.models.tiny import PAD_ID, build_causal_lm, tiny_model_config
from rlrun.rl.assembly import skips_old_log_probs
from rlrun.roles.actor import Actor, PolicyData, PolicyLossSettings
from rlrun.roles.update import make_optimizer, warmup_cosine
from rlrun.roles.update import Updater

ON_POLICY = {"rollout_batch_size": 4, "n_samples_per_prompt": 4, "train_batch_size": 16}


def _cfg(train: dict, algo: dict):
    return build_config({**ON_POLICY, **train, **algo}, Config)


@pytest.mark.parametrize(("train", "algo", "skips"), [
    ({}, {"use_kl_loss": True, "init_kl_coef": 0.04}, True),  # GRPO: KL as a loss
    ({}, {"init_kl_coef": 0.0}, True),  # no reference model at all
    ({}, {"init_kl_coef": 0.01}, False),  # KL penalty in the reward reads old log-probs before training
    ({}, {"init_kl_coef": 0.01, "kl_target": 0.1}, False),  # adaptive KL penalty in the reward
    ({"train_batch_size": 8}, {"use_kl_loss": True}, False),  # two mini-batches: the second is off-policy
    ({"max_epochs": 2}, {"use_kl_loss": True}, False),  # second epoch is off-policy
    ({}, {"use_kl_loss": True, "router_replay": "R2"}, False),  # R2's training pass replays the scoring pass's routing
])
def test_when_the_pass_is_skipped(train, algo, skips):
    cfg = _cfg(train, algo)
    assert skips_old_log_probs(cfg.train, cfg.algo) is skips


def _batch():
    g = torch.Generator().manual_seed(0)
    lens = [(3, 5), (6, 2), (2, 7), (4, 4)]
    prompts = [torch.randint(0, 256, (p,), generator=g).tolist() for p, _ in lens]
    responses = [torch.randint(0, 256, (r,), generator=g).tolist() for _, r in lens]
    return unpack_rows(pack_rows(prompts, responses, 8, 8, PAD_ID), 8)


class _Clip:
    def clip_grad_norm(self, model, max_norm):
        return float(torch.nn.utils.clip_grad_norm_(list(model.parameters()), max_norm))


def _actor() -> Actor:
    model = build_causal_lm(tiny_model_config(), seed=1)
    opt = make_optimizer(model, 1e-2, (0.9, 0.95), 0.0)
    updater = Updater(model, _Clip(), opt, warmup_cosine(opt, 4, 0.0), 1.0, micro_batch=2, dp_rank=0, dp_size=1)
    return Actor(model, updater, PolicyLossSettings(0.2, None, "token-mean", 1.0, None, True, "k3"), torch.device("cpu"))


def test_actor_step_without_old_log_probs_is_the_same_step():
    batch = _batch()
    adv = torch.linspace(-1, 1, batch.action_mask.numel()).view_as(batch.action_mask)
    ref = torch.full_like(adv, -5.0)
    scored, skipped = _actor(), _actor()
    old = scored.log_probs(batch, 2)
    stats_scored = update_actor(scored, PolicyData(batch, old, adv, ref), [torch.arange(4)], kl_coef=0.04)
    stats_skipped, got = update_actor_seen(skipped, PolicyData(batch, None, adv, ref), [torch.arange(4)], kl_coef=0.04)
    for p, q in zip(scored.model.parameters(), skipped.model.parameters()):
        torch.testing.assert_close(q, p, atol=1e-6, rtol=0)
    assert abs(stats_scored["actor/policy_loss"] - stats_skipped["actor/policy_loss"]) < 1e-6
    # The skipped run hands back its pre-update log-probs: [row index, log-probs], the scored pass's values.
    assert sorted(got[:, 0].tolist()) == [0.0, 1.0, 2.0, 3.0]
    rows = got[:, 0].long()
    torch.testing.assert_close(got[rows.argsort(), 1:] * batch.action_mask, old * batch.action_mask, atol=1e-6, rtol=0)
    with pytest.raises(ValueError, match="exactly one mini-batch, got 2"):
        update_actor(skipped, PolicyData(batch, None, adv, ref), [torch.arange(2), torch.arange(2, 4)], kl_coef=0.04)


ARGS = ["--config", "configs/demo.yaml", "--max_steps", "2", "--rollout_batch_size", "4", "--n_samples_per_prompt", "4",
        "--train_batch_size", "16", "--micro_train_batch_size", "8", "--micro_rollout_batch_size", "8",
        "--use_kl_loss", "--kl_estimator", "k3", "--init_kl_coef", "0.04"]
# The same entry point with the skip turned off (the assembly decides the branch once, from this function).
NO_SKIP = ("import sys, rlrun.rl.assembly as a; a.skips_old_log_probs = lambda *args, **kwargs: False; "
           "from rlrun.ppo import main; sys.exit(main(sys.argv[1:]))")


def _run(tmp_path, skip: bool) -> tuple[list[dict], dict[str, torch.Tensor]]:
    out = tmp_path / ("skip" if skip else "scored")
    cmd = [sys.executable, "-m", "rlrun.ppo"] if skip else [sys.executable, "-c", NO_SKIP]
    proc = subprocess.run(cmd + ARGS + ["--save_path", str(out)], cwd=REPO, env=subprocess_env(), capture_output=True,
                          text=True, timeout=240)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-3000:]
    metrics = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    return metrics, dict(AutoModelForCausalLM.from_pretrained(out).named_parameters())


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_trainer_skip_changes_neither_weights_nor_kl(tmp_path):
    skipped, weights_skipped = _run(tmp_path, skip=True)
    scored, weights_scored = _run(tmp_path, skip=False)
    for name, p in weights_scored.items():
        torch.testing.assert_close(weights_skipped[name], p, atol=1e-6, rtol=0, msg=name)
    assert [m["step"] for m in skipped] == [1, 2]
    for a, b in zip(scored, skipped):
        assert "kl" in b and abs(a["kl"] - b["kl"]) < 1e-6
        assert abs(a["actor/kl_loss"] - b["actor/kl_loss"]) < 1e-6
    assert skipped[1]["kl"] > 0  # after one update the policy has moved away from the reference
