"""Models built on the meta device and filled from the files `save_pretrained` writes (safetensors single and
sharded with an index, zip `.bin`), in bf16 and fp32: the same weights as `from_pretrained`'s load, and under FSDP2
on 3 real gloo ranks each rank reads only the rows it keeps and trains the same as a whole-model start (the
embeddings and the head are FSDP units of their own).
Run as a script (`python test_weights.py RANK WORLD PORT OUTDIR`) it is one rank of the sharded test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import (
    AutoModelForCausalLM,
    AutoModelForSequenceClassification,
    MixtralConfig,
    Qwen2MoeConfig,
    Qwen3MoeConfig,
)

from rlrun.config.model import PretrainedConfig
from rlrun.models.loading import load_causal_lm, policy_weights, unfilled_causal_lm, unfilled_scalar_model
from rlrun.models.tiny import build_causal_lm, tiny_model_config
from rlrun.models.weights import FileWeights, params_on_meta

SAVES = {"bf16": dict(dtype=torch.bfloat16), "fp32-sharded": dict(max_shard_size="100KB"),
         "bin": dict(bin=True), "tied": dict(tied=True)}


def _save(path: Path, kind: str) -> Path:
    opts = dict(SAVES[kind])
    config = tiny_model_config()
    if opts.pop("tied", False):
        config.tie_word_embeddings = True
    model = build_causal_lm(config, seed=7).to(opts.pop("dtype", torch.float32))
    as_bin = opts.pop("bin", False)
    model.save_pretrained(path, **opts)
    if as_bin:  # what older save_pretrained wrote (transformers 5 writes safetensors only)
        torch.save(load_file(path / "model.safetensors"), path / "pytorch_model.bin")
        (path / "model.safetensors").unlink()
    return path


class Counting:
    """A weight source that records what was read (elements per name)."""

    def __init__(self, inner: FileWeights) -> None:
        self.inner, self.read_elements = inner, {}

    def shape(self, name):
        return self.inner.shape(name)

    def read(self, name, rows):
        t = self.inner.read(name, rows)
        self.read_elements[name] = self.read_elements.get(name, 0) + t.numel()
        return t


@pytest.mark.parametrize("kind", list(SAVES))
def test_a_filled_model_equals_from_pretrained(tmp_path, kind):
    path = _save(tmp_path / kind, kind)
    if kind == "fp32-sharded":
        assert (path / "model.safetensors.index.json").exists()
    if kind == "bin":
        assert (path / "pytorch_model.bin").exists()
    got = load_causal_lm(PretrainedConfig(pretrain=str(path)), seed=0)
    want = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    assert not got.training and got.dtype == torch.float32
    gs, ws = got.state_dict(), want.state_dict()
    assert gs.keys() == ws.keys()
    assert all(torch.equal(gs[k], ws[k]) for k in ws)
    assert all(torch.equal(a, b) for (_, a), (_, b) in zip(got.named_buffers(), want.named_buffers()))
    ids = torch.arange(30, 42).view(2, 6)
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)


def test_a_meta_build_allocates_no_parameter():
    with params_on_meta():
        model = AutoModelForCausalLM.from_config(tiny_model_config())
    assert all(p.is_meta for p in model.parameters())
    assert not any(b.is_meta for b in model.buffers())  # rotary frequencies are computed, never stored


MOE = {"bos_token_id": 2, "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 3, "num_attention_heads": 4,
       "num_key_value_heads": 2, "num_experts_per_tok": 2, "pad_token_id": 0, "eos_token_id": 1}
MOE_CONFIGS = {
    "qwen3_moe": lambda: Qwen3MoeConfig(**MOE, head_dim=8, intermediate_size=48, moe_intermediate_size=16,
                                        num_experts=12, mlp_only_layers=[1]),
    "qwen2_moe": lambda: Qwen2MoeConfig(**MOE, intermediate_size=48, moe_intermediate_size=16,
                                        shared_expert_intermediate_size=24, num_experts=6),
    "mixtral": lambda: MixtralConfig(**MOE, intermediate_size=16, num_local_experts=4),
}


@pytest.mark.parametrize("kind", sorted(MOE_CONFIGS))
def test_moe_checkpoints_per_expert_are_read_into_the_fused_experts_a_slice_at_a_time(tmp_path, kind):
    """save_pretrained writes one tensor per expert (Mixtral's under block_sparse_moe.experts.E.w1/w2/w3);
    transformers 5 builds one fused tensor per layer. rlrun reads them by transformers' own conversion rules without
    loading the checkpoint whole (no note): the same weights and logits as from_pretrained, and the rows of a
    fused tensor (a sharded rank's experts) read only those experts' tensors (12 experts: their names sort by
    number, not as text)."""
    torch.manual_seed(5)
    AutoModelForCausalLM.from_config(MOE_CONFIGS[kind]()).save_pretrained(tmp_path)
    stored = load_file(tmp_path / "model.safetensors")
    assert any(".experts.3." in name for name in stored)  # the per-expert layout
    source = PretrainedConfig(pretrain=str(tmp_path))
    unfilled = unfilled_causal_lm(source, 0, policy_weights(source, 0))
    assert unfilled.note is None
    got = unfilled.fill(torch.device("cpu")).float()
    want = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    gs, ws = got.state_dict(), want.state_dict()
    assert gs.keys() == ws.keys() and all(torch.equal(gs[k], ws[k]) for k in ws)
    ids = torch.arange(30, 42).view(2, 6)
    with torch.no_grad():
        assert torch.equal(got(input_ids=ids).logits, want(input_ids=ids).logits)
    counting = Counting(unfilled.weights.source)
    unfilled.weights.source = counting
    fused = next(n for n in unfilled.weights.merges if n.endswith("gate_up_proj"))
    assert torch.equal(unfilled.weights.read(fused, (1, 3)), ws[fused][1:3])
    experts = {name.split(".experts.")[1].split(".")[0] for name in counting.read_elements}
    assert experts == {"1", "2"} and sum(counting.read_elements.values()) == ws[fused][1:3].numel()


def test_names_the_checkpoint_lacks_fall_back_to_a_whole_load_with_a_note(tmp_path):
    path = _save(tmp_path / "m", "bf16")
    tensors = load_file(path / "model.safetensors")
    tensors["renamed.lm_head.weight"] = tensors.pop("lm_head.weight")
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    source = PretrainedConfig(pretrain=str(path))
    unfilled = unfilled_causal_lm(source, 0, policy_weights(source, 0))
    assert unfilled.note is not None and "lm_head.weight" in unfilled.note and "whole on every rank" in unfilled.note


def test_a_critic_from_a_causal_lm_gets_a_seeded_head_and_a_reward_model_keeps_its_own(tmp_path):
    lm = _save(tmp_path / "lm", "bf16")
    critic = unfilled_scalar_model(str(lm), PretrainedConfig(), seed=5, fresh_head=True).fill(torch.device("cpu"))
    again = unfilled_scalar_model(str(lm), PretrainedConfig(), seed=5, fresh_head=True).fill(torch.device("cpu"))
    assert torch.equal(critic.score.weight, again.score.weight) and critic.score.weight.abs().sum() > 0
    body = AutoModelForCausalLM.from_pretrained(lm, dtype=torch.float32).model.state_dict()
    assert all(torch.equal(critic.model.state_dict()[k], v) for k, v in body.items())
    critic.save_pretrained(tmp_path / "rm")
    rm = unfilled_scalar_model(str(tmp_path / "rm"), PretrainedConfig(), seed=9).fill(torch.device("cpu"))
    want = AutoModelForSequenceClassification.from_pretrained(tmp_path / "rm", num_labels=1, dtype=torch.float32)
    assert all(torch.equal(rm.state_dict()[k], v) for k, v in want.state_dict().items())


# ---- FSDP2 on 3 ranks -------------------------------------------------------------------------------------------


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist

    from rlrun.strategies.blocks import full_tensor
    from rlrun.strategies.fsdp import FSDPStrategy

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    source = PretrainedConfig(pretrain=str(outdir / "model"))
    out = {}
    for stage in (2, 3):
        counting = Counting(FileWeights(source.pretrain))
        unfilled = unfilled_causal_lm(source, 0, counting)
        strategy = FSDPStrategy(dist.group.WORLD, torch.device("cpu"), bf16=False, zero_stage=stage, offload=False,
                                gradient_checkpointing=False)
        model, optimizer = strategy.wrap_trainable(unfilled, lambda m: torch.optim.AdamW(m.parameters(), lr=1e-3))
        local = {name: p.to_local().numel() for name, p in model.named_parameters()}
        ids = torch.arange(30, 54).view(4, 6)[rank::world]
        for _ in range(2):
            loss = model(input_ids=ids, labels=ids).logits.float().pow(2).mean()
            loss.backward()
            optimizer.step()
            optimizer.zero_grad()
        from torch.distributed.fsdp import FSDPModule

        out[stage] = {"read": counting.read_elements, "local": local,
                      "vocab_units": [isinstance(m, FSDPModule) for m in (model.model.embed_tokens, model.lm_head)],
                      "full": {n: full_tensor(p.detach()) for n, p in model.named_parameters()}}
    torch.save(out, outdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_fsdp_ranks_read_only_their_rows_and_train_like_a_whole_start(tmp_path):
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    _save(tmp_path / "model", "bf16")
    run_file_as_ranks(__file__, 3, tmp_path, timeout=180)
    want = AutoModelForCausalLM.from_pretrained(tmp_path / "model", dtype=torch.float32)
    total = sum(p.numel() for p in want.parameters())
    results = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(3)]
    # the whole-model reference: one process, same data, same steps
    opt = torch.optim.AdamW(want.parameters(), lr=1e-3)
    ids = torch.arange(30, 54).view(4, 6)
    want.train()
    for _ in range(2):
        # FSDP averages gradients over ranks; each rank's loss is its rows' mean, so the reference averages those
        loss = sum(want(input_ids=ids[r::3], labels=ids[r::3]).logits.float().pow(2).mean() for r in range(3)) / 3
        loss.backward()
        opt.step()
        opt.zero_grad()
    for stage in (2, 3):
        for res in results:
            read = res[stage]["read"]
            assert read == {n: k for n, k in res[stage]["local"].items() if k}  # its rows, nothing more
            assert res[stage]["vocab_units"] == [True, True]  # not gathered with the root through a whole step
            assert sum(read.values()) < 0.5 * total
            for name, p in want.named_parameters():
                torch.testing.assert_close(res[stage]["full"][name], p.detach(), rtol=2e-4, atol=2e-5)


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
