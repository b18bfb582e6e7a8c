"""Exports of LoRA-trained models (roles/export.py): PEFT's adapter layout in --save_path, which PEFT and transformers
load onto the base and which computes what the in-memory model computes; --save_merged's plain HF model in
<save_path>/merged, equal to base + alpha/r * B @ A; a critic or reward model as a SEQ_CLS adapter carrying its score
head; a base no folder holds written beside the adapter; a hub base named by its id; and an export without adapters
exactly as before. One process: the strategy only hands over the model's whole state."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from peer_data import lay_out_hub_cache
from safetensors.torch import load_file
from torch import nn
from transformers import AutoModelForCausalLM, AutoModelForSequenceClassification

from helpers import WholeStrategy, save_tiny_base
from rlrun.config.model import PretrainedConfig
from rlrun.models import hub
from rlrun.models.loading import (ScalarHeadModel, load_tokenizer, policy_weights, unfilled_causal_lm,
                                  unfilled_scalar_model, unfilled_trained_policy)
from rlrun.models.lora import LoraSettings, add_scalar_adapters, is_adapter
from rlrun.models.tiny import build_byte_tokenizer
from rlrun.models.weights import Unfilled
from rlrun.roles.export import save_causal_lm, save_scalar_model

CPU = torch.device("cpu")
IDS = torch.arange(30, 42).view(2, 6)
peft = pytest.importorskip("peft")


save_base = save_tiny_base


def trained(model: nn.Module, seed: int = 1, head: bool = False) -> nn.Module:
    """`model` as after some training: every adapter tensor (and the score head) moved off its initial value."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if is_adapter(name) or (head and name.endswith("score.weight")):
                p.add_(torch.randn(p.shape, generator=gen) * 0.1)
    return model


def lora_policy(source: PretrainedConfig) -> nn.Module:
    return trained(unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(CPU))


def export_policy(source: PretrainedConfig, out: Path, merged: bool = True) -> nn.Module:
    model = lora_policy(source)
    save_causal_lm(model, load_tokenizer(source), str(out), is_writer=True, strategy=WholeStrategy(), merged=merged)
    return model


def logits(model: nn.Module) -> torch.Tensor:
    with torch.no_grad():
        return model(input_ids=IDS).logits


def test_a_lora_policy_saves_as_a_peft_adapter_and_a_merged_model(tmp_path):
    base = save_base(tmp_path / "base")
    out = tmp_path / "out"
    model = export_policy(PretrainedConfig(pretrain=base, lora_rank=4, lora_alpha=8), out)
    files = {p.name for p in out.iterdir()}
    assert {"adapter_model.safetensors", "adapter_config.json", "tokenizer.json", "merged"} <= files
    assert "config.json" not in files  # transformers would take the folder for a whole model
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == base and config["revision"] is None
    assert (config["r"], config["lora_alpha"], config["task_type"], config["peft_type"]) == (4, 8, "CAUSAL_LM", "LORA")
    saved = load_file(out / "adapter_model.safetensors")
    assert saved and all(k.startswith("base_model.model.model.layers.") and ".lora_" in k for k in saved)
    want = logits(model)

    loaded = peft.PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(base), out)
    torch.testing.assert_close(logits(loaded), want)
    auto = AutoModelForCausalLM.from_pretrained(out)  # transformers reads the adapter config and loads the base
    assert auto.peft_config["default"].r == 4
    torch.testing.assert_close(logits(auto), want)

    merged = AutoModelForCausalLM.from_pretrained(out / "merged")
    assert not hasattr(merged, "peft_config")
    torch.testing.assert_close(logits(merged), want)
    weights = dict(model.named_parameters())
    layer = "base_model.model.model.layers.1.mlp.down_proj"
    by_hand = weights[f"{layer}.base_layer.weight"] + 2.0 * weights[f"{layer}.lora_B.default.weight"] \
        @ weights[f"{layer}.lora_A.default.weight"]
    torch.testing.assert_close(merged.model.layers[1].mlp.down_proj.weight, by_hand)
    torch.testing.assert_close(merged.model.embed_tokens.weight, weights["base_model.model.model.embed_tokens.weight"],
                               rtol=0, atol=0)
    assert (out / "merged" / "tokenizer.json").is_file()


def test_without_save_merged_only_the_adapter(tmp_path):
    out = tmp_path / "out"
    export_policy(PretrainedConfig(pretrain=save_base(tmp_path / "base"), lora_rank=2), out, merged=False)
    assert not (out / "merged").exists() and (out / "adapter_model.safetensors").is_file()


def test_without_adapters_the_export_is_as_before(tmp_path):
    source = PretrainedConfig(pretrain=save_base(tmp_path / "base"))
    model = unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(CPU)
    out = tmp_path / "out"
    save_causal_lm(model, load_tokenizer(source), str(out), is_writer=True, strategy=WholeStrategy(), merged=True)
    assert {"config.json", "model.safetensors", "tokenizer.json"} <= {p.name for p in out.iterdir()}
    assert not (out / "adapter_config.json").exists() and not (out / "merged").exists()
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model), rtol=0, atol=0)


def test_the_embedded_models_base_is_written_beside_its_adapter(tmp_path):
    out = tmp_path / "out"
    model = export_policy(PretrainedConfig(lora_rank=4), out, merged=False)
    config = json.loads((out / "adapter_config.json").read_text())
    assert config["base_model_name_or_path"] == str((out / "base").resolve())
    assert {"config.json", "model.safetensors"} <= {p.name for p in (out / "base").iterdir()}
    torch.testing.assert_close(logits(AutoModelForCausalLM.from_pretrained(out)), logits(model))
    source = PretrainedConfig(pretrain=str(out))  # and back as --pretrain
    again = unfilled_trained_policy(source, 0, policy_weights(source, 0)).fill(CPU).state_dict()
    assert all(torch.equal(again[k], v) for k, v in model.state_dict().items())


def test_a_hub_base_is_named_by_its_id_and_commit(tmp_path, monkeypatch):
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    hub.resolve.cache_clear()
    snapshot = lay_out_hub_cache(tmp_path / "hub", "tiny-org/Tiny-Qwen2", Path(save_base(tmp_path / "saved")))
    section = hub.resolve_models(PretrainedConfig(pretrain="tiny-org/Tiny-Qwen2", lora_rank=2))
    assert section.pretrain == str(snapshot)
    export_policy(section, tmp_path / "out", merged=False)
    config = json.loads((tmp_path / "out" / "adapter_config.json").read_text())
    assert (config["base_model_name_or_path"], config["revision"]) == ("tiny-org/Tiny-Qwen2", snapshot.name)
    hub.resolve.cache_clear()


def lora_critic(base: str) -> ScalarHeadModel:
    """A critic as the builders make one (rl/build.py): the policy's body, a fresh score head, LoRA on the body."""
    hf = unfilled_scalar_model(base, PretrainedConfig(pretrain=base), 0, fresh_head=True)
    unfilled = Unfilled(ScalarHeadModel(hf.model), hf.weights, prefix="hf.")
    model = add_scalar_adapters(unfilled, LoraSettings(4, 8.0, ("all-linear",)), 0).fill(CPU)
    return trained(model, head=True)


def test_a_lora_critic_saves_as_a_seq_cls_adapter_with_its_score_head(tmp_path):
    base = save_base(tmp_path / "base")
    critic = lora_critic(base)
    critic.hf.config.mean, critic.hf.config.std = 0.5, 2.0  # what the reward-model trainer stores
    out = tmp_path / "critic"
    tokenizer = build_byte_tokenizer()
    save_scalar_model(critic, str(out), is_writer=True, strategy=WholeStrategy(), flag="--save_value_network",
                      tokenizer=tokenizer, merged=True)
    config = json.loads((out / "adapter_config.json").read_text())
    assert (config["task_type"], config["modules_to_save"], config["base_model_name_or_path"]) == ("SEQ_CLS", ["score"], base)
    assert "base_model.model.score.weight" in load_file(out / "adapter_model.safetensors")
    assert json.loads((out / "reward_norm.json").read_text()) == {"mean": 0.5, "std": 2.0}
    mask = torch.ones_like(IDS)
    with torch.no_grad():
        want = critic(IDS, attention_mask=mask)[:, -1]
        body = AutoModelForSequenceClassification.from_pretrained(base, num_labels=1)
        loaded = peft.PeftModel.from_pretrained(body, out)
        torch.testing.assert_close(loaded(input_ids=IDS, attention_mask=mask).logits[:, 0], want)
        merged = AutoModelForSequenceClassification.from_pretrained(out / "merged")
        torch.testing.assert_close(merged(input_ids=IDS, attention_mask=mask).logits[:, 0], want)
        assert (merged.config.mean, merged.config.std) == (0.5, 2.0)
        # Back as a reward model (--reward_pretrain): the adapter merged on read, the saved head, the saved mean/std.
        again = unfilled_scalar_model(str(out), PretrainedConfig(pretrain=base), 0)
        model = ScalarHeadModel(again.fill(CPU), normalize=True)
        torch.testing.assert_close(model(IDS, attention_mask=mask)[:, -1], (want - 0.5) / 2.0)


def test_an_engine_policy_from_the_export_equals_the_merged_export(tmp_path):
    """The merged export and the frozen policy read from the adapter directory are one set of weights."""
    out = tmp_path / "out"
    export_policy(PretrainedConfig(pretrain=save_base(tmp_path / "base"), lora_rank=4), out)
    source = PretrainedConfig(pretrain=str(out))
    engine = unfilled_causal_lm(source, 0, policy_weights(source, 0)).fill(CPU).state_dict()
    merged = load_file(out / "merged" / "model.safetensors")
    assert engine.keys() == merged.keys() and all(torch.equal(engine[k], merged[k]) for k in merged)
