"""A PEFT LoRA adapter directory as --pretrain (models/loading.py): its config names the base (a folder or a hub id in
the cache); the config, weights and (lacking the adapter's own) tokenizer are the base's; the trained policy is the
base with the saved adapters, equal to the model that was saved; every frozen copy (engines, a critic's body) is base +
adapter merged on read, equal to the merged export; settings given that disagree with the adapter, and adapters rlrun
cannot merge, are refused in one line."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peer_data import lay_out_hub_cache
from safetensors.torch import load_file, save_file
from torch import nn

from helpers import save_tiny_base, save_trained_adapter
from rlrun.config.model import PretrainedConfig
from rlrun.models import hub
from rlrun.models.loading import (AdapterMerged, load_model_config, load_tokenizer, lora_settings, policy_weights,
                                  resolve_adapter_pretrain, tokenizer_missing, unfilled_causal_lm, unfilled_scalar_model,
                                  unfilled_trained_policy)
from rlrun.models.lora import adapter_dir, is_adapter
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.roles.export import save_causal_lm
from rlrun.runtime.errors import ConfigError

CPU = torch.device("cpu")
pytest.importorskip("peft")


save_base = save_tiny_base


export = save_trained_adapter


@pytest.fixture
def saved(tmp_path) -> tuple[Path, nn.Module]:
    out = tmp_path / "lora"
    model = export(PretrainedConfig(pretrain=save_base(tmp_path / "base"), lora_rank=4, lora_alpha=8,
                                    target_modules=("q_proj", "v_proj", "down_proj")), out)
    return out, model


def test_an_adapter_directory_as_pretrain_round_trips(saved):
    out, model = saved
    source = resolve_adapter_pretrain(PretrainedConfig(pretrain=str(out)))
    assert (source.lora_rank, source.lora_alpha, source.target_modules) == (4, 8, ("down_proj", "q_proj", "v_proj"))
    assert source.pretrain == str(out)  # the loaders follow the base themselves
    weights = policy_weights(source, 0)
    assert isinstance(weights, AdapterMerged)

    policy = unfilled_trained_policy(source, 0, weights).fill(CPU)  # training goes on from the saved adapters
    got, want = policy.state_dict(), model.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert {n for n, p in policy.named_parameters() if p.requires_grad} == {n for n in got if is_adapter(n)}

    engine = unfilled_causal_lm(source, 0, weights).fill(CPU).state_dict()  # frozen copies: merged on read
    merged = load_file(out / "merged" / "model.safetensors")
    assert engine.keys() == merged.keys() and all(torch.equal(engine[k], merged[k]) for k in merged)
    name = "model.layers.0.self_attn.q_proj.weight"
    assert torch.equal(weights.read(name, (3, 9)), merged[name][3:9])  # a shard's rows merge alone

    body = unfilled_scalar_model(str(out), source, 0, fresh_head=True).fill(CPU).state_dict()  # a critic's start
    assert torch.equal(body["model.layers.1.mlp.down_proj.weight"], merged["model.layers.1.mlp.down_proj.weight"])

    base = load_model_config(PretrainedConfig(pretrain=json.loads((out / "adapter_config.json").read_text())
                                              ["base_model_name_or_path"]))
    assert load_model_config(source).to_dict() == base.to_dict()


def test_the_adapters_tokenizer_wins_else_the_bases(saved):
    out, _ = saved
    source = PretrainedConfig(pretrain=str(out))
    tok = build_byte_tokenizer()
    tok.add_special_tokens({"additional_special_tokens": ["<tool>"]})
    tok.save_pretrained(out)
    assert tokenizer_missing(source) is None and "<tool>" in load_tokenizer(source).get_vocab()
    for name in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
        (out / name).unlink(missing_ok=True)
    assert tokenizer_missing(source) is None and "<tool>" not in load_tokenizer(source).get_vocab()


def test_a_hub_base_is_found_in_the_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.resolve.cache_clear()
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/Tiny-Qwen2", Path(save_base(tmp_path / "saved")))
    section = hub.resolve_models(PretrainedConfig(pretrain="tiny-org/Tiny-Qwen2", lora_rank=2))
    model = export(section, tmp_path / "lora")
    source = resolve_adapter_pretrain(PretrainedConfig(pretrain=str(tmp_path / "lora")))
    got = unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(CPU).state_dict()
    assert all(torch.equal(got[k], v) for k, v in model.state_dict().items())
    hub.resolve.cache_clear()
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "empty"))  # another machine, without the base
    with pytest.raises(ConfigError) as err:
        resolve_adapter_pretrain(PretrainedConfig(pretrain=str(tmp_path / "lora")))
    assert "is a LoRA adapter on tiny-org/Tiny-Qwen2, which cannot be read" in str(err.value)
    assert "\n" not in str(err.value)
    hub.resolve.cache_clear()


def _edit_config(out: Path, **changes: object) -> None:
    path = out / "adapter_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **changes}))


@pytest.mark.parametrize("given, message", [
    (dict(lora_rank=8), "--lora_rank 8: --pretrain {out} is a LoRA adapter of rank 4 (adapter_config.json), trained "
                        "further as it is; drop --lora_rank or pass --lora_rank 4"),
    (dict(lora_alpha=32), "--lora_alpha 32: --pretrain {out} was trained with lora_alpha 8; drop --lora_alpha"),
    (dict(target_modules=("k_proj",)), "--target_modules k_proj: --pretrain {out} adapts down_proj q_proj v_proj; "
                                       "drop --target_modules"),
])
def test_settings_that_disagree_with_the_adapter_are_refused(saved, given, message):
    out, _ = saved
    with pytest.raises(ConfigError) as err:
        resolve_adapter_pretrain(PretrainedConfig(pretrain=str(out), **given))
    assert str(err.value).startswith(message.format(out=out)) and "\n" not in str(err.value)
    with pytest.raises(ConfigError):
        lora_settings(PretrainedConfig(pretrain=str(out), **given))
    same = resolve_adapter_pretrain(PretrainedConfig(pretrain=str(out), lora_rank=4, lora_alpha=8,
                                                     target_modules=("q_proj", "v_proj", "down_proj")))
    assert same.lora_rank == 4


@pytest.mark.parametrize("edit, message", [
    (dict(use_dora=True), "the adapter uses DoRA (use_dora); rlrun loads plain LoRA adapters only"),
    (dict(use_rslora=True), "the adapter uses rank-stabilised scaling (use_rslora)"),
    (dict(modules_to_save=["lm_head"]), "whole modules saved with it (modules_to_save: ['lm_head'])"),
    (dict(base_model_name_or_path="/no/such/base"), "its base model /no/such/base (adapter_config.json's "
                                                    "base_model_name_or_path) is not on this machine"),
])
def test_adapters_rlrun_cannot_load_are_refused(saved, edit, message):
    out, _ = saved
    _edit_config(out, **edit)
    source = PretrainedConfig(pretrain=str(out))
    with pytest.raises(ConfigError) as err:
        unfilled_trained_policy(source, 0, policy_weights(source, 0))
    assert message in str(err.value) and str(err.value).startswith(f"--pretrain {out}") and "\n" not in str(err.value)


def test_an_adapter_that_does_not_fit_its_model_is_refused(saved):
    out, _ = saved
    source = PretrainedConfig(pretrain=str(out))
    tensors = load_file(out / "adapter_model.safetensors")
    name = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"
    save_file({**tensors, name: tensors[name][:2]}, out / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match=r"the adapter lacks .*q_proj.lora_A.weight of shape \[4, 64\] \(it has "
                                          r"\[2, 64\]; 1 tensors differ\)"):
        unfilled_trained_policy(source, 0, policy_weights(source, 0))
    save_file({**tensors, "base_model.model.model.layers.0.self_attn.k_proj.lora_A.weight": tensors[name].clone()},
              out / "adapter_model.safetensors")
    with pytest.raises(ConfigError, match="the adapter holds .*k_proj.lora_A.weight"):
        unfilled_trained_policy(source, 0, policy_weights(source, 0))


def test_a_model_directory_is_no_adapter(tmp_path):
    base = save_base(tmp_path / "base")
    assert adapter_dir(base) is None
    source = PretrainedConfig(pretrain=base)
    assert resolve_adapter_pretrain(source) is source and lora_settings(source) is None


def test_hub_snapshot_folders_name_their_repo(tmp_path):
    commit = "0123456789abcdef0123456789abcdef01234567"
    folder = tmp_path / "models--Qwen--Qwen2.5-0.5B" / "snapshots" / commit
    folder.mkdir(parents=True)
    assert hub.snapshot_repo(str(folder)) == ("Qwen/Qwen2.5-0.5B", commit)
    assert hub.snapshot_repo(str(tmp_path)) is None
    (tmp_path / "snapshots" / "abc").mkdir(parents=True)
    assert hub.snapshot_repo(str(tmp_path / "snapshots" / "abc")) is None
