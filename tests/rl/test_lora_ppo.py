"""LoRA (--lora_rank) in rlrun.ppo with real processes (torchrun, gloo, the embedded tiny model).

One colocated 2-rank GRPO run with a KL penalty (the issue's command, fewer steps) proves at once: it learns, the
layout has no reference ranks (the actor's base, adapters off, is the reference, and the KL it gives is live), the
engines generate from the merged weights (their log-probs equal the actor's), the base weights come out of training
bit-identical and the optimizer holds the adapters only, and --save_path holds PEFT's adapter layout. A GAE run
with actor, critic and engine on ranks of their own (merged weights cross the wire, checked after every sync; the
critic trains adapters and its head) resumes exactly. In-process: the reference's log-probs equal a separately loaded base model's; a sync that delivers nothing
is caught (the fault is injected, said there).
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

from helpers import run_rlrun, save_tiny_base, save_trained_adapter, untimed
from test_resume import SMALL, _copy_checkpoints, _ok, torchrun
from rlrun.config.model import PretrainedConfig
from rlrun.data.rollout import RolloutBatch
from rlrun.models.loading import load_causal_lm, unfilled_policy
from rlrun.models.lora import LoraSettings, add_adapters, hf_name, is_adapter
from rlrun.roles.actor import Reference

SEED = 42  # configs/demo.yaml's seed: the base model and the adapters' A matrices are drawn from it
LORA = ["--lora_rank", "8", "--lora_alpha", "16", "--target_modules", "all-linear"]


def _state(step_dir: Path, tmp_path: Path) -> dict:
    dcp_to_torch_save(str(step_dir / "actor"), str(tmp_path / "actor.pt"))
    return torch.load(tmp_path / "actor.pt", weights_only=False)


def test_lora_grpo_learns_with_the_base_as_reference_and_leaves_the_base_untouched(tmp_path) -> None:
    steps = 30
    out = tmp_path / "out"
    run = run_rlrun(2, ["--config", "configs/demo.yaml", *LORA, "--init_kl_coef", "0.01", "--max_steps", str(steps),
                        "--save_steps", str(steps), "--ckpt_path", str(tmp_path / "ckpt")], out, timeout=400)
    assert run.returncode == 0, run.output[-4000:]
    rewards = [m["reward/mean"] if "reward/mean" in m else m["reward"] for m in run.metrics if "kl" in m or "reward" in m]
    assert len(rewards) == steps
    assert sum(rewards[-5:]) / 5 > sum(rewards[:5]) / 5 + 0.25, rewards
    assert "ref" not in run.output.split("groups", 1)[1].split("[rlrun", 1)[0], run.output[:2000]  # the layout table
    kls = [m["kl"] for m in run.metrics if "kl" in m]
    assert max(kls) > 1e-3, kls  # the reference scores with the adapters off: the trained policy moves away from it
    diffs = [m["rollout/engine_vs_actor_logprob_diff"] for m in run.metrics]
    assert max(diffs) < 1e-4, diffs  # the engines hold base + adapter as the actor computes it

    state = _state(next((tmp_path / "ckpt").glob("step_*")), tmp_path)
    trained, optim = state["model"], state["optim"]
    base = load_causal_lm(PretrainedConfig(), SEED).state_dict()
    frozen = {hf_name(n): t for n, t in trained.items() if not is_adapter(n)}
    assert frozen.keys() == base.keys()
    assert [n for n in base if not torch.equal(frozen[n], base[n])] == []
    adapters = {n for n in trained if is_adapter(n)}
    assert len(adapters) == 2 * 7 * 2 and set(optim["state"]) == adapters  # 2 layers x 7 linear x (A, B)
    assert (out / "adapter_config.json").is_file() and (out / "adapter_model.safetensors").is_file()


def test_lora_critic_and_actor_resume_exactly_with_roles_on_their_own_ranks(tmp_path) -> None:
    """GAE on 3 ranks (actor, critic, engine each on its own): the merged weights travel by broadcast (and are
    checked), the critic trains adapters and its value head. Resuming from the step-2 checkpoint of a 4-step run
    reproduces its steps 3 and 4 and its exported adapters (the critic's with its head)."""
    args = [*SMALL, *LORA, "--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--critic_learning_rate", "1e-3",
            "--save_value_network", "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1",
            "--vllm_num_engines", "1", "--max_steps", "4", "--save_steps", "2"]
    straight = torchrun(3, args, tmp_path / "straight")
    _ok(straight)
    _copy_checkpoints(straight, tmp_path / "resumed" / "ckpt", 2)
    resumed = torchrun(3, [*args, "--load_checkpoint"], tmp_path / "resumed")
    _ok(resumed)
    assert "resumed from" in resumed.output and [m["step"] for m in resumed.metrics] == [3, 4]
    assert untimed(resumed.metrics) == untimed(straight.metrics[2:])
    for sub in ("", "critic"):
        adapters = [load_file(run.save / sub / "adapter_model.safetensors") for run in (straight, resumed)]
        assert adapters[0].keys() == adapters[1].keys()
        assert all(torch.equal(adapters[0][k], adapters[1][k]) for k in adapters[0]), sub
    critic = load_file(straight.save / "critic" / "adapter_model.safetensors")
    assert any(k.endswith("score.weight") for k in critic), sorted(critic)[:4]  # the value head, trained whole
    assert any(m["critic/value_loss"] > 0 for m in straight.metrics if "critic/value_loss" in m)


def _rows() -> RolloutBatch:
    torch.manual_seed(0)
    seq = torch.randint(3, 200, (3, 10))
    return RolloutBatch(seq, torch.ones_like(seq), torch.ones(3, 4), torch.full((3,), 6), torch.full((3,), 4))


def test_reference_with_adapters_off_equals_the_base_model() -> None:
    source = PretrainedConfig(lora_rank=4, lora_alpha=8)
    model = add_adapters(unfilled_policy(source, SEED), LoraSettings.of(source), SEED).fill(torch.device("cpu"))
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.normal_(0, 0.5)  # a trained adapter: the policy is no longer its base
    cpu = torch.device("cpu")
    base_lp = Reference(load_causal_lm(PretrainedConfig(), SEED), 1.0, cpu).log_probs(_rows(), 2)
    ref_lp = Reference(model, 1.0, cpu, adapters_off=True).log_probs(_rows(), 2)
    torch.testing.assert_close(ref_lp, base_lp, rtol=0, atol=1e-6)
    policy_lp = Reference(model, 1.0, cpu).log_probs(_rows(), 2)
    assert (policy_lp - base_lp).abs().max() > 1e-2  # and the adapters are on again afterwards
    assert all(p.requires_grad for n, p in model.named_parameters() if is_adapter(n))


def test_an_adapter_directory_with_a_kl_term_is_refused_in_one_line(tmp_path) -> None:
    """Its adapters-off forward (the reference) would be the adapter's base, not the policy the run starts from."""
    import json

    import pytest

    from rlrun.config.tree import Config
    from rlrun.plan.plan import check_adapter_reference
    from rlrun.runtime.errors import ConfigError

    (tmp_path / "adapter_config.json").write_text(json.dumps({"peft_type": "LORA", "r": 8, "lora_alpha": 16,
                                                              "base_model_name_or_path": "Qwen/Qwen2.5-0.5B"}))
    cfg = Config()
    cfg.model.pretrain, cfg.model.lora_rank, cfg.algo.init_kl_coef = str(tmp_path), 8, 0.01
    with pytest.raises(ConfigError, match="is a LoRA adapter directory: the run has a KL term .* or drop the KL term"):
        check_adapter_reference(cfg)
    cfg.algo.init_kl_coef = 0.0
    check_adapter_reference(cfg)  # no KL term: the adapter trains on


def test_an_adapter_directory_goes_on_training_on_native_engines_that_run_its_adapters(tmp_path) -> None:
    """--pretrain an adapter directory with native engines, which run the adapters beside their base weights: the
    engines start from the base alone (the frozen copies' start is base + adapter merged) and the first sync gives them
    the saved adapters, so they sample the actor's policy; started from the merged base, every sync's adapters were
    added a second time."""
    lora = tmp_path / "lora"
    save_trained_adapter(PretrainedConfig(pretrain=save_tiny_base(tmp_path / "base"), lora_rank=4, lora_alpha=8,
                                          target_modules=("q_proj", "v_proj", "down_proj")), lora)
    run = run_rlrun(2, ["--config", "configs/demo.yaml", "--pretrain", str(lora), "--remote_rm_url", "demo",
                        "--max_steps", "3"], tmp_path / "out")
    assert run.returncode == 0, run.output[-4000:]
    assert "weight sync: LoRA adapters only (the native engines" in run.output, run.output[-3000:]
    diffs = [m["rollout/engine_vs_actor_logprob_diff"] for m in run.metrics]
    assert len(diffs) == 3 and max(diffs) < 1e-4, diffs
