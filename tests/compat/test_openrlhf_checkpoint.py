"""Reading OpenRLHF DeepSpeed checkpoints (rlrun.compat.openrlhf_checkpoint) made by real DeepSpeed engines.

The checkpoints are written here the way OpenRLHF 0.11 writes them: the actor engine wraps a module holding
the HF causal LM as `.model` (models/actor.py), the critic engine wraps a sequence-classification model
(`model.*` + bias-free `score`, models/model.py), `save_checkpoint(ckpt_path/_actor, tag="global_stepN",
client_state={...})` as in trainer/ray/ppo_actor.py. One gloo process for ZeRO-0/1/2/3 (+ ZeRO-2 bf16) and
two for ZeRO-2/3 partitions over ranks. The reader must return the engine's fp32 master weights bit for bit.

Run as a script (`python test_openrlhf_checkpoint.py RANK WORLD PORT OUTDIR`) it is one rank that writes
the checkpoints listed in OUTDIR/spec.json.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

STEP_CLIENT_STATE = {"episode": 0, "global_step": 3, "total_consumed_prompts": 24,
                     "data_loader_state_dict": {"sampler": [1, 2]}, "best_eval_metric_key": None,
                     "best_eval_metric_value": float("-inf"), "latest_eval_metric_value": None}
TAG = "global_step3"


# ---- the per-rank worker: real DeepSpeed engines saving OpenRLHF-style checkpoints ---------------------------


class OpenRLHFActorLike(torch.nn.Module):
    """OpenRLHF's Actor: the HF model under `.model` (so DeepSpeed's keys are `model.<HF name>`)."""

    def __init__(self, hf: torch.nn.Module) -> None:
        super().__init__()
        self.model = hf

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.model(input_ids=ids, use_cache=False).logits


def _engine(module: torch.nn.Module, stage: int, bf16: bool):
    import deepspeed

    cfg = {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1,
           "zero_optimization": {"stage": stage}, "zero_allow_untested_optimizer": True,
           "bf16": {"enabled": bf16}, "checkpoint": {"tag_validation": "Ignore"}}
    opt = torch.optim.AdamW(module.parameters(), lr=1e-2)
    engine, *_ = deepspeed.initialize(model=module, optimizer=opt, config=cfg)
    return engine


def _fp32_masters(engine, stage: int) -> dict[str, torch.Tensor]:
    from deepspeed.utils import safe_get_full_fp32_param

    if stage == 0:
        return {n: p.detach().float().clone() for n, p in engine.module.named_parameters()}
    return {n: safe_get_full_fp32_param(p).clone() for n, p in engine.module.named_parameters()}


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    os.environ.update(DS_ACCELERATOR="cpu", LOCAL_RANK="0")
    import torch.distributed as dist
    from transformers import AutoModelForSequenceClassification

    from rlrun.models.tiny import build_causal_lm, tiny_model_config

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    spec = json.loads((outdir / "spec.json").read_text())
    ids = (torch.arange(12).view(2, 6) * 11 + rank) % 250
    for name, (stage, bf16) in spec.items():
        root = outdir / name
        expected = {}
        for part, build in (("actor", lambda: OpenRLHFActorLike(build_causal_lm(tiny_model_config(), seed=0))),
                            ("critic", lambda: _critic(AutoModelForSequenceClassification))):
            engine = _engine(build(), stage, bf16)
            out = engine(ids)
            out = out if isinstance(out, torch.Tensor) else out.logits
            engine.backward(out.float().pow(2).mean())
            engine.step()
            # OpenRLHF: the actor carries the trainer's client_state, the critic none (ppo_critic.py).
            engine.save_checkpoint(str(root / f"_{part}"), tag=TAG,
                                   client_state=STEP_CLIENT_STATE if part == "actor" else {})
            expected[part] = _fp32_masters(engine, stage)
        if rank == 0:
            torch.save(expected, root / "expected.pt")
    dist.barrier()
    dist.destroy_process_group()


def _critic(cls):
    """OpenRLHF's CriticModel is the HF model itself (`model.*` + bias-free `score`), wrapped directly."""
    from rlrun.models.tiny import tiny_model_config

    config = tiny_model_config()
    config.num_labels = 1
    torch.manual_seed(1)
    return cls.from_config(config)


# ---- fixtures ---------------------------------------------------------------------------------------------


def _needs_deepspeed() -> None:
    if importlib.util.find_spec("deepspeed") is None:
        pytest.skip("deepspeed is not installed")


def _write(outdir: Path, world: int, spec: dict[str, tuple[int, bool]], worlds: int = 1) -> Path:
    """The checkpoints of `spec`, written by `worlds` independent worlds of `world` ranks at once (each DeepSpeed
    engine starts single-threaded, so two one-rank worlds use both cores), each config in OUTDIR/<name>."""
    from concurrent.futures import ThreadPoolExecutor

    from helpers import run_file_as_ranks

    names = list(spec)
    parts = [outdir / f"world{i}" for i in range(worlds)]
    for i, part in enumerate(parts):
        part.mkdir(parents=True, exist_ok=True)
        (part / "spec.json").write_text(json.dumps({name: spec[name] for name in names[i::worlds]}))
    env_before = os.environ.get("DS_ACCELERATOR")
    os.environ["DS_ACCELERATOR"] = "cpu"
    try:
        with ThreadPoolExecutor(worlds) as pool:
            list(pool.map(lambda part: run_file_as_ranks(__file__, world, part, timeout=400), parts))
    finally:
        if env_before is None:
            os.environ.pop("DS_ACCELERATOR", None)
    for part in parts:
        for name in json.loads((part / "spec.json").read_text()):
            (part / name).rename(outdir / name)
    return outdir


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory) -> Path:
    _needs_deepspeed()
    spec = {"z0": (0, False), "z1": (1, False), "z2": (2, False), "z3": (3, False), "z2bf16": (2, True)}
    return _write(tmp_path_factory.mktemp("orl1"), 1, spec, worlds=2)


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory) -> Path:
    _needs_deepspeed()
    return _write(tmp_path_factory.mktemp("orl2"), 2, {"z2": (2, False), "z3": (3, False)})


@pytest.fixture(scope="module")
def pretrain_dir(tmp_path_factory) -> Path:
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    out = tmp_path_factory.mktemp("pretrain")
    build_causal_lm(tiny_model_config(), seed=5).save_pretrained(out)
    build_byte_tokenizer().save_pretrained(out)
    return out


def _assert_same(got: dict[str, torch.Tensor], want: dict[str, torch.Tensor], prefix: str) -> None:
    assert set(got) == {k[len(prefix):] if k.startswith(prefix) else k for k in want}
    for key, tensor in want.items():
        name = key[len(prefix):]
        assert got[name].dtype == torch.float32, name
        assert torch.equal(got[name], tensor), name


# ---- weights --------------------------------------------------------------------------------------------


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,stage", [("z0", 0), ("z1", 1), ("z2", 2), ("z3", 3), ("z2bf16", 2)])
def test_one_rank_checkpoints_read_bit_identical(one_rank, name, stage):
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    ckpt = read_openrlhf_checkpoint(str(one_rank / name))
    expected = torch.load(one_rank / name / "expected.pt", weights_only=True)
    assert (ckpt.tag, ckpt.zero_stage, ckpt.dp_world_size, ckpt.global_step) == (TAG, stage, 1, 3)
    assert ckpt.client_state["total_consumed_prompts"] == 24
    assert ckpt.client_state["data_loader_state_dict"] == {"sampler": [1, 2]}
    assert ckpt.exact_fp32
    assert not any(t.requires_grad for t in [*ckpt.actor.values(), *ckpt.critic.values()])
    _assert_same(ckpt.actor, expected["actor"], "model.")
    assert ckpt.critic is not None
    _assert_same(ckpt.critic, expected["critic"], "")
    assert "score.weight" in ckpt.critic and ckpt.critic["score.weight"].shape == (1, 64)
    # The step moved the weights away from the seed-0 initialisation (so equality is not trivial).
    from rlrun.models.tiny import build_causal_lm, tiny_model_config

    init = build_causal_lm(tiny_model_config(), seed=0).state_dict()
    assert not torch.equal(init["model.norm.weight"], ckpt.actor["model.norm.weight"])


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("name,stage", [("z2", 2), ("z3", 3)])
def test_two_rank_partitions_merge(two_ranks, name, stage):
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    tag_dir = two_ranks / name / "_actor" / TAG
    optim = sorted(p.name for p in tag_dir.glob("*optim_states.pt"))
    assert optim == ["zero_pp_rank_0_mp_rank_00_optim_states.pt", "zero_pp_rank_1_mp_rank_00_optim_states.pt"]
    ckpt = read_openrlhf_checkpoint(str(two_ranks / name))
    expected = torch.load(two_ranks / name / "expected.pt", weights_only=True)
    assert (ckpt.zero_stage, ckpt.dp_world_size) == (stage, 2)
    _assert_same(ckpt.actor, expected["actor"], "model.")
    _assert_same(ckpt.critic, expected["critic"], "")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_converter_writes_hf_dirs_that_rlrun_trains_from(one_rank, pretrain_dir, tmp_path):
    from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

    from helpers import run_rlrun
    from rlrun.compat.openrlhf_checkpoint import main

    out = tmp_path / "converted"
    assert main([str(one_rank / "z2"), str(out), "--pretrain", str(pretrain_dir)]) == 0
    expected = torch.load(one_rank / "z2" / "expected.pt", weights_only=True)
    actor = AutoModelForCausalLM.from_pretrained(out / "actor", dtype=torch.float32).state_dict()
    critic = AutoModelForSequenceClassification.from_pretrained(out / "critic", num_labels=1,
                                                                dtype=torch.float32).state_dict()
    _assert_same(actor, expected["actor"], "model.")
    _assert_same(critic, expected["critic"], "")
    state = json.loads((out / "openrlhf_state.json").read_text())
    assert state["client_state"]["global_step"] == 3 and state["tag"] == TAG and state["zero_stage"] == 2
    assert (out / "actor" / "tokenizer.json").exists()

    res = run_rlrun(1, ["--config", "configs/demo.yaml", "--remote_rm_url", "demo", "--pretrain", str(out / "actor"),
                        "--critic_pretrain", str(out / "critic"), "--advantage_estimator", "gae", "--max_steps", "2",
                        "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
                        "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4",
                        "--generate_max_len", "8"], tmp_path / "run", timeout=300)
    assert res.returncode == 0, res.output[-3000:]
    assert [m["step"] for m in res.metrics] == [1, 2]
    assert "critic/value_loss" in res.metrics[-1]


# ---- --load_openrlhf_checkpoint on rlrun.ppo ----------------------------------------------------------------

FLAG_RUN = ["--config", "configs/demo.yaml", "--remote_rm_url", "demo", "--advantage_estimator", "gae",
            "--max_steps", "1", "--rollout_batch_size", "4", "--n_samples_per_prompt", "2", "--train_batch_size", "8",
            "--micro_train_batch_size", "4", "--micro_rollout_batch_size", "4", "--generate_max_len", "8",
            # learning rate 0: the saved models must then be exactly what the checkpoint held
            "--actor_learning_rate", "0", "--critic_learning_rate", "0", "--save_value_network"]


def _saved(save: Path) -> tuple[dict, dict]:
    from safetensors.torch import load_file

    return load_file(save / "model.safetensors"), load_file(save / "critic" / "model.safetensors")


@pytest.mark.slow
@pytest.mark.timeout(600)
@pytest.mark.parametrize("strategy,name,stage", [([], "z3", 3), ([], "z2", 2),
                                                 (["--strategy", "deepspeed", "--zero_stage", "2"], "z3", 3),
                                                 (["--strategy", "deepspeed", "--zero_stage", "1"], "z2", 2)],
                         ids=["fsdp-z3", "fsdp-z2", "deepspeed2-z3", "deepspeed1-z2"])
def test_flag_initialises_actor_and_critic_on_two_ranks(two_ranks, pretrain_dir, tmp_path, strategy, name, stage):
    """2 ranks, every role on both: FSDP2 shards (DTensor slices) or DeepSpeed ZeRO-1/2 partitions (fp32 masters)
    receive a 2-rank ZeRO-2/3 checkpoint's weights; the models saved after a step at lr 0 equal them exactly."""
    from helpers import run_rlrun

    root = two_ranks / name
    res = run_rlrun(2, FLAG_RUN + strategy + ["--pretrain", str(pretrain_dir), "--load_openrlhf_checkpoint", str(root)],
                    tmp_path / "run", timeout=400)
    assert res.returncode == 0, res.output[-4000:]
    assert (f"initialised the actor and critic from OpenRLHF checkpoint {root} tag {TAG} (ZeRO-{stage}, 2 ranks; OpenRLHF "
            "global_step 3); steps count from 0 here") in res.output
    assert [m["step"] for m in res.metrics] == [1]
    expected = torch.load(root / "expected.pt", weights_only=True)
    actor, critic = _saved(tmp_path / "run")
    _assert_same(actor, expected["actor"], "model.")
    _assert_same(critic, expected["critic"], "")


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_flag_errors_before_training(one_rank, pretrain_dir, tmp_path):
    from helpers import run_rlrun

    res = run_rlrun(1, FLAG_RUN + ["--load_openrlhf_checkpoint", str(tmp_path / "nope")], tmp_path / "a", timeout=200)
    assert res.returncode != 0 and res.metrics == []
    assert f"--load_openrlhf_checkpoint: OpenRLHF checkpoint {tmp_path / 'nope'}: not a directory" in res.output
    # A --pretrain whose MLP is narrower than the checkpoint's: refused naming the first tensor, before training.
    wider = tmp_path / "wider"
    from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config

    config = tiny_model_config()
    config.intermediate_size = 96
    build_causal_lm(config, seed=0).save_pretrained(wider)
    build_byte_tokenizer().save_pretrained(wider)
    res = run_rlrun(1, FLAG_RUN + ["--pretrain", str(wider), "--load_openrlhf_checkpoint", str(one_rank / "z1")],
                    tmp_path / "b", timeout=200)
    assert res.returncode != 0 and res.metrics == []
    assert ("(actor): tensor 'model.layers.0.mlp.gate_proj.weight' has shape (128, 64) in the checkpoint but (96, 64) "
            "in this run's model") in res.output


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_rlrun_checkpoint_wins_over_the_flag_on_restart(one_rank, pretrain_dir, tmp_path):
    """A restarted job repeats its command line: with --load_checkpoint, rlrun's own newer checkpoint is what
    it continues from, not the OpenRLHF weights again."""
    from helpers import run_rlrun

    args = FLAG_RUN[:-5] + ["--pretrain", str(pretrain_dir), "--load_openrlhf_checkpoint", str(one_rank / "z2"),
                            "--save_steps", "1", "--ckpt_path", str(tmp_path / "ckpt"), "--load_checkpoint"]
    first = run_rlrun(1, args, tmp_path / "a", timeout=300)
    assert first.returncode == 0, first.output[-3000:]
    assert "initialised the actor and critic from OpenRLHF checkpoint" in first.output
    again = run_rlrun(1, args + ["--max_steps", "2"], tmp_path / "b", timeout=300)  # the later flag wins
    assert again.returncode == 0, again.output[-3000:]
    assert "resumed from" in again.output and "at step 1" in again.output
    assert [m["step"] for m in again.metrics] == [2]


def test_apply_weights_names_the_first_mismatch():
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import apply_weights

    model = torch.nn.Sequential(torch.nn.Linear(2, 3), torch.nn.Linear(3, 1, bias=False))
    good = {"0.weight": torch.full((3, 2), 0.5), "0.bias": torch.ones(3), "1.weight": torch.full((1, 3), -1.0)}
    apply_weights(model, good, "W")
    assert torch.equal(model[0].weight, torch.full((3, 2), 0.5)) and torch.equal(model[1].weight, torch.full((1, 3), -1.0))
    with pytest.raises(CheckpointError, match=r"W: tensor '0.bias' has shape \(4,\) in the checkpoint but \(3,\) in "
                                              r"this run's model"):
        apply_weights(model, {**good, "0.bias": torch.ones(4)}, "W")
    with pytest.raises(CheckpointError, match=r"W: tensor '2.weight' has no counterpart in this run's model \(Sequential\)"):
        apply_weights(model, {**good, "2.weight": torch.ones(1)}, "W")
    with pytest.raises(CheckpointError, match=r"W: the checkpoint has no tensor '1.weight' \(1 missing\)"):
        apply_weights(model, {k: v for k, v in good.items() if k != "1.weight"}, "W")
    assert torch.equal(model[0].bias, torch.ones(3))  # a refused load wrote nothing


# ---- errors: each names the path and the fix --------------------------------------------------------------


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst)
    return dst


def test_not_a_directory(tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    with pytest.raises(CheckpointError, match=r"nope: not a directory \(pass the --ckpt_path of the OpenRLHF run"):
        read_openrlhf_checkpoint(str(tmp_path / "nope"))


def test_no_actor_dir_and_tag_dir_hint(tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    (tmp_path / "_critic").mkdir()
    with pytest.raises(CheckpointError, match=r"no _actor/ directory \(found \['_critic'\]\); pass the --ckpt_path"):
        read_openrlhf_checkpoint(str(tmp_path))
    tag = tmp_path / "global_step3"
    tag.mkdir()
    (tag / "mp_rank_00_model_states.pt").write_bytes(b"")
    with pytest.raises(CheckpointError, match="this looks like a tag directory itself: pass its grandparent"):
        read_openrlhf_checkpoint(str(tag))


def test_no_latest_and_no_tag(tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    (tmp_path / "_actor" / "global_step7").mkdir(parents=True)
    with pytest.raises(CheckpointError, match=r"latest is missing .* name one with --tag \(tags here: \['global_step7'\]\)"):
        read_openrlhf_checkpoint(str(tmp_path))


def test_tag_that_does_not_exist(tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    (tmp_path / "_actor" / "global_step7").mkdir(parents=True)
    (tmp_path / "_actor" / "latest").write_text("global_step9")
    with pytest.raises(CheckpointError, match=r"tag 'global_step9' does not exist in .*_actor \(tags here: \['global_step7'\]\)"):
        read_openrlhf_checkpoint(str(tmp_path))
    with pytest.raises(CheckpointError, match=r"tag 'global_step2' does not exist"):
        read_openrlhf_checkpoint(str(tmp_path), tag="global_step2")


def test_not_a_deepspeed_tag_dir(tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import inspect_tag

    (tmp_path / "t").mkdir()
    (tmp_path / "t" / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match=r"neither mp_rank_00_model_states.pt \(ZeRO-0/1/2\) nor .* \(ZeRO-3\)"):
        inspect_tag(str(tmp_path / "t"))
    torch.save({"weights": 1}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match=r"not a DeepSpeed model-states file \(keys \['weights'\]\)"):
        inspect_tag(str(tmp_path / "t"))
    torch.save({"module": {}, "param_shapes": [], "mp_world_size": 2}, tmp_path / "t" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="model \\(tensor\\) parallel size 2; rlrun reads data-parallel"):
        inspect_tag(str(tmp_path / "t"))
    torch.save([1, 2], tmp_path / "t" / "mp_rank_00_model_states.pt")
    with pytest.raises(CheckpointError, match="not a DeepSpeed checkpoint file \\(holds a list\\)"):
        inspect_tag(str(tmp_path / "t"))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_missing_shards_and_unreadable_file(two_ranks, one_rank, tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    z2 = _copy(two_ranks / "z2", tmp_path / "z2")
    (z2 / "_actor" / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"ZeRO-2 checkpoint of 2 ranks is missing 1 file\(s\), first "
                                              r"zero_pp_rank_1_mp_rank_00_optim_states.pt .* copy them all"):
        read_openrlhf_checkpoint(str(z2))
    z3 = _copy(two_ranks / "z3", tmp_path / "z3")
    (z3 / "_critic" / TAG / "zero_pp_rank_1_mp_rank_00_model_states.pt").unlink()
    with pytest.raises(CheckpointError, match=r"_critic/global_step3: ZeRO-3 checkpoint of 2 ranks is missing 1 "
                                              r"file\(s\), first zero_pp_rank_1_mp_rank_00_model_states.pt"):
        read_openrlhf_checkpoint(str(z3))
    assert read_openrlhf_checkpoint(str(z3), critic=False).critic is None  # the actor alone still reads
    bad = _copy(one_rank / "z1", tmp_path / "z1")
    meta = bad / "_actor" / TAG / "mp_rank_00_model_states.pt"
    meta.write_bytes(meta.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"cannot read .*mp_rank_00_model_states.pt: .* copy the tag directory again"):
        read_openrlhf_checkpoint(str(bad))
    bad2 = _copy(one_rank / "z1", tmp_path / "z1b")
    optim = bad2 / "_actor" / TAG / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    optim.write_bytes(optim.read_bytes()[:200])
    with pytest.raises(CheckpointError, match=r"zero_to_fp32 could not rebuild the weights"):
        read_openrlhf_checkpoint(str(bad2))


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_critic_without_the_actors_tag(one_rank, tmp_path):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import read_openrlhf_checkpoint

    root = _copy(one_rank / "z2", tmp_path / "z2")
    (root / "_critic" / TAG).rename(root / "_critic" / "global_step2")
    with pytest.raises(CheckpointError, match=r"_actor has tag 'global_step3' but _critic does not \(tags there: "
                                              r"\['global_step2'\]\).* pass an older --tag"):
        read_openrlhf_checkpoint(str(root))
    shutil.rmtree(root / "_critic")
    ckpt = read_openrlhf_checkpoint(str(root))  # an actor-only run (GRPO/RLOO/REINFORCE++): no critic
    assert ckpt.critic is None and ckpt.global_step == 3


def test_name_mapping_and_refusals():
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import actor_names, critic_names

    w = torch.zeros(2, 3)
    head = torch.ones(1, 3)
    assert list(actor_names({"model.model.embed_tokens.weight": w, "model.lm_head.weight": w}, "X")) == [
        "model.embed_tokens.weight", "lm_head.weight"]
    with pytest.raises(CheckpointError, match=r"X: parameter 'lm_head.weight' is not under OpenRLHF's Actor wrapper"):
        actor_names({"lm_head.weight": w}, "X")
    lora = {"model.base_model.model.model.layers.0.self_attn.q_proj.lora_A.default.weight": w}
    with pytest.raises(CheckpointError, match=r"X: holds LoRA adapter weights .*lora_A.* merge_and_unload"):
        actor_names(lora, "X")
    with pytest.raises(CheckpointError, match=r"holds LoRA adapter weights"):
        critic_names({"model.layers.0.mlp.up_proj.lora_B.default.weight": w, "score.weight": head}, "X")
    mapped = critic_names({"model.norm.weight": w, "value_head.weight": head}, "X", value_head_prefix="value_head")
    assert set(mapped) == {"model.norm.weight", "score.weight"} and torch.equal(mapped["score.weight"], head)
    with pytest.raises(CheckpointError, match=r"X: no value head 'score.weight' \(top-level modules: \['model', "
                                              r"'value_head'\]\); .* pass --value_head_prefix X"):
        critic_names({"model.norm.weight": w, "value_head.weight": head}, "X")
    with pytest.raises(CheckpointError, match=r"value head 'score.weight' has shape \(2, 3\), expected \(1, hidden\)"):
        critic_names({"score.weight": w}, "X")
    with pytest.raises(CheckpointError, match=r"value head has parameters besides its weight \(score.bias\)"):
        critic_names({"score.weight": head, "score.bias": torch.zeros(1)}, "X")


def test_load_weights_names_the_first_mismatch():
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import load_weights

    class Tied(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.emb = torch.nn.Embedding(4, 3)
            self.head = torch.nn.Linear(3, 4, bias=False)
            self.head.weight = self.emb.weight
            self.norm = torch.nn.LayerNorm(3)

    model = Tied()
    good = {"emb.weight": torch.full((4, 3), 2.0), "norm.weight": torch.full((3,), 3.0), "norm.bias": torch.zeros(3)}
    load_weights(model, good, "W")  # head.weight is tied to emb.weight: not needed
    assert torch.equal(model.head.weight, torch.full((4, 3), 2.0)) and torch.equal(model.norm.weight, torch.full((3,), 3.0))
    with pytest.raises(CheckpointError, match=r"W: tensor 'norm.weight' has shape \(5,\) in the checkpoint but \(3,\) "
                                              r"in --pretrain's architecture"):
        load_weights(model, {**good, "norm.weight": torch.zeros(5)}, "W")
    with pytest.raises(CheckpointError, match=r"W: tensor 'extra.weight' has no counterpart in --pretrain's "
                                              r"architecture \(Tied\)"):
        load_weights(model, {**good, "extra.weight": torch.zeros(1)}, "W")
    with pytest.raises(CheckpointError, match=r"W: the checkpoint has no tensor 'norm.bias' \(1 missing\)"):
        load_weights(model, {k: v for k, v in good.items() if k != "norm.bias"}, "W")


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_converter_errors(one_rank, pretrain_dir, tmp_path, capsys):
    from rlrun.checkpoint.store import CheckpointError
    from rlrun.compat.openrlhf_checkpoint import convert, main
    from rlrun.models.tiny import build_causal_lm, tiny_model_config

    with pytest.raises(CheckpointError, match=r"--pretrain .*missing: not a local HF model directory"):
        convert(str(one_rank / "z2"), str(tmp_path / "o1"), str(tmp_path / "missing"))
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    with pytest.raises(CheckpointError, match=r"output .*full exists and is not empty"):
        convert(str(one_rank / "z2"), str(tmp_path / "full"), str(pretrain_dir))
    other = tmp_path / "wider"
    config = tiny_model_config()
    config.intermediate_size = 96
    build_causal_lm(config, seed=0).save_pretrained(other)
    with pytest.raises(CheckpointError, match=r"tensor 'model.layers.0.mlp.gate_proj.weight' has shape \(128, 64\) in "
                                              r"the checkpoint but \(96, 64\) in --pretrain's architecture"):
        convert(str(one_rank / "z2"), str(tmp_path / "o2"), str(other))
    assert main([str(tmp_path / "nope"), str(tmp_path / "o3"), "--pretrain", str(pretrain_dir)]) == 2
    assert "error: OpenRLHF checkpoint" in capsys.readouterr().err


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
    # rlrun's own exit after DeepSpeed (launch/failures.leave): no interpreter finalization, whose teardown of the
    # process groups DeepSpeed keeps alive aborted a finished rank now and then (SIGABRT, a CI run failed so)
    from rlrun.launch.failures import leave

    leave(0)
