"""Ulysses sequence parallelism (rlrun.strategies.ulysses) on real gloo worlds: log-probs, entropy, values, scores and
the gradients of a loss on them at sp = 2 and 4 equal sp = 1 on the same packed batch (fp32, 1e-5), for GQA models
whose KV heads sp divides and ones it does not (repeated), a sliding-window model, with gradient checkpointing and
with LoRA adapters; attended with the dense packed mask and sequence by sequence (wide rows). Run as a script (`python test_ulysses.py RANK WORLD PORT OUTDIR`) it is one rank of a 4-rank world
that checks sp = 2 (ranks 0-1 and 2-3) and sp = 4."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

from rlrun.strategies.ulysses import UlyssesCall, kv_repeats

TOL = 1e-5


@pytest.mark.parametrize("kv, sp, repeat", [(4, 2, 1), (2, 4, 2), (1, 4, 4), (3, 2, 2), (8, 4, 1), (6, 4, 2)])
def test_kv_heads_are_repeated_until_sp_divides_them(kv: int, sp: int, repeat: int) -> None:
    assert kv_repeats(kv, sp) == repeat and (kv * repeat) % sp == 0


def test_the_full_mask_is_the_packed_block_diagonal_causal_mask() -> None:
    pos = torch.tensor([[0, 1, 2, 0, 1, 0, 1, 2]])  # sequences of 3, 2, 3 tokens in one row
    call = UlyssesCall(None, pos)  # type: ignore[arg-type]  # the mask reads positions only
    mask = call.mask(None)[0, 0]
    expected = torch.zeros(8, 8, dtype=torch.bool)
    for start, n in ((0, 3), (3, 2), (5, 3)):
        expected[start:start + n, start:start + n] = torch.ones(n, n, dtype=torch.bool).tril()
    assert torch.equal(mask, expected)
    windowed = call.mask(2)[0, 0]  # each token sees itself and the one before
    assert windowed[2].tolist() == [False, True, True, False, False, False, False, False]
    assert call.segments() == [[(0, 3), (3, 5), (5, 8)]]  # the same sequences, for rows attended one by one


def test_every_rank_of_sp_2_and_4_matches_the_unsplit_forward_and_its_gradients(tmp_path) -> None:
    from helpers import run_file_as_ranks

    run_file_as_ranks(__file__, 4, tmp_path, timeout=300)
    results = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    assert all(r["checked"] == results[0]["checked"] for r in results)
    assert len(results[0]["checked"]) == 16, results[0]["checked"]  # 7 models x sp 2 and 4, 2 of them both ways


def _models():
    """(name, fp32 model factory, kind): GQA whose KV heads sp divides / does not, MQA, a sliding window, and a
    scalar-head critic; gradient checkpointing and LoRA on two of them."""
    from transformers import AutoModelForSequenceClassification, MistralConfig, Qwen2Config

    from rlrun.config.model import PretrainedConfig
    from rlrun.models.loading import ScalarHeadModel
    from rlrun.models.lora import LoraSettings, add_adapters
    from rlrun.models.tiny import build_causal_lm

    def qwen(heads: int, kv: int, **extra):
        return Qwen2Config(vocab_size=300, hidden_size=8 * heads, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256,
                           tie_word_embeddings=False, attn_implementation="sdpa", **extra)

    def causal(config, checkpointing=False):
        def build():
            model = build_causal_lm(config, seed=5)
            if checkpointing:
                model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
            return model
        return build

    def critic():
        config = qwen(8, 4)
        config.num_labels = 1
        torch.manual_seed(7)
        return ScalarHeadModel(AutoModelForSequenceClassification.from_config(config))

    def lora():
        from rlrun.models.weights import Unfilled, params_on_meta, state_dict_weights

        weights = state_dict_weights(build_causal_lm(qwen(8, 2), seed=5))
        with params_on_meta():
            skeleton = build_causal_lm(qwen(8, 2), seed=5)
        settings = LoraSettings.of(PretrainedConfig(lora_rank=4, lora_alpha=8))
        return add_adapters(Unfilled(skeleton, weights), settings, 5).fill(torch.device("cpu"))

    mistral = MistralConfig(vocab_size=300, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                            num_attention_heads=8, num_key_value_heads=2, sliding_window=5,
                            max_position_embeddings=256, tie_word_embeddings=False, attn_implementation="sdpa")
    return [
        ("qwen2_8h_4kv", causal(qwen(8, 4)), "policy"),
        ("qwen2_8h_2kv", causal(qwen(8, 2)), "policy"),
        ("qwen2_4h_1kv_checkpointed", causal(qwen(4, 1), checkpointing=True), "policy"),
        ("qwen2_12h_3kv", causal(qwen(12, 3)), "policy"),  # KV 3: repeated at sp 2 and 4
        ("mistral_window5", causal(mistral), "policy"),
        ("qwen2_lora", lora, "policy"),
        ("critic", critic, "values"),
    ]


def _batch():
    from rlrun.data.rollout import pack_rows, unpack_rows
    from rlrun.models.tiny import PAD_ID

    g = torch.Generator().manual_seed(0)
    prompts, responses = [], []
    for i in range(6):
        p, r = int(torch.randint(1, 12, (1,), generator=g)), (0 if i == 2 else int(torch.randint(1, 15, (1,), generator=g)))
        prompts.append(torch.randint(0, 256, (p,), generator=g).tolist())
        responses.append(torch.randint(0, 256, (r,), generator=g).tolist())
    return unpack_rows(pack_rows(prompts, responses, 12, 15, PAD_ID), 12)


def _outputs(model, kind, batch, sp):
    """(per-token outputs, the gradients of a loss on them) of one forward and backward."""
    from rlrun.roles.forward import policy_log_probs, sequence_scores, token_values

    model.zero_grad()
    if kind == "values":
        values = token_values(model, batch, packing=True, sp=sp)
        scores = sequence_scores(model, batch, packing=True, sp=sp)
        outs = [values, scores]
        loss = (values * batch.action_mask).pow(2).sum() + scores.sum()
    else:
        logp, entropy = policy_log_probs(model, batch, 0.8, with_entropy=True, packing=True, logits_chunk=7, sp=sp)
        outs = [logp, entropy]
        weights = torch.linspace(-1, 1, logp.numel()).view_as(logp)
        loss = (logp * weights).sum() + 0.1 * entropy.sum()
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return outs, grads


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    import os

    import torch.distributed as dist

    from rlrun.strategies import ulysses
    from rlrun.launch.groups import SequenceParallel

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    groups = {2: [dist.new_group([0, 1]), dist.new_group([2, 3])], 4: [dist.new_group([0, 1, 2, 3])]}
    batch = _batch()
    checked = []
    for name, build, kind in _models():
        reference, ref_grads = _outputs(build(), kind, batch, None)
        # sp 2 attends sequence by sequence (the path of rows wider than DENSE_MASK_COLUMNS), sp 4 with the dense
        # mask, and the windowed and repeated-KV models both ways at 4
        both = name in ("mistral_window5", "qwen2_12h_3kv")
        for size, dense in [(2, False), (4, True), *([(4, False)] if both else [])]:
            ulysses.DENSE_MASK_COLUMNS = 1 << 30 if dense else 0
            model = build()
            ulysses.enable(model)
            sp = SequenceParallel(groups[size][rank // size], size, rank % size)
            outs, grads = _outputs(model, kind, batch, sp)
            for got, want in zip(outs, reference):
                torch.testing.assert_close(got, want, atol=TOL, rtol=0, msg=f"{name} sp={size}")
            # each rank holds sp x its own tokens' share of the one loss: their sum over the group / sp is the whole
            for key, grad in grads.items():
                dist.all_reduce(grad, group=sp.group)
                torch.testing.assert_close(grad / size, ref_grads[key], atol=TOL, rtol=1e-4, msg=f"{name} sp={size} {key}")
            assert set(grads) == set(ref_grads)
            checked.append(f"{name}@{size}{'' if dense else '/by-sequence'}")
    (outdir / f"rank{rank}.json").write_text(json.dumps({"checked": checked}))
    dist.destroy_process_group()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
