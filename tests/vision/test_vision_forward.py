"""A tiny Qwen2.5-VL (built from config, saved as save_pretrained lays it out) through rlrun's vision path: image
preprocessing and token expansion, HF generation with images, response log-probs on padded and packed rows against
the model's own unpadded forward (values and gradients), the rows' images across a real 3-rank gloo world
(checksums), and the frozen vision tower. Run as a script (`python test_vision_forward.py RANK WORLD PORT OUTDIR`)
it is one rank of the exchange test."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from rlrun.data.vision_batch import PromptVision, RowVision

COLOURS = [(255, 0, 0), (0, 0, 255), (0, 200, 0)]


def _vision(patches: int, images: int, seed: int) -> PromptVision:
    """`images` images of `patches` patches each (a 2 x patches/2 grid), 8 features per patch."""
    g = torch.Generator().manual_seed(seed)
    return PromptVision(torch.randn(patches * images, 8, generator=g), torch.tensor([[1, 2, patches // 2]] * images))


@pytest.fixture(scope="module")
def vlm(tmp_path_factory):
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoTokenizer

    from rlrun.vision.inputs import ImageInputs
    from rlrun.vision.demo import save_tiny_vl

    folder = save_tiny_vl(tmp_path_factory.mktemp("tiny_vl"), seed=1)
    config = AutoConfig.from_pretrained(folder)
    model = AutoModelForImageTextToText.from_pretrained(folder).eval()
    return folder, config, AutoTokenizer.from_pretrained(folder), model, ImageInputs(folder, config)


def _prompt_ids(tokenizer, images: int, text: str = "Colour?") -> list[int]:
    content = [{"type": "image"}] * images + [{"type": "text", "text": text}]
    rendered = tokenizer.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                             add_generation_prompt=True)
    return tokenizer(rendered, add_special_tokens=False)["input_ids"]


def test_preprocessing_expands_each_image_token_by_its_grid(vlm):
    from rlrun.runtime.errors import DataError
    from rlrun.vision.inputs import ImageInputs

    folder, config, tokenizer, _, images = vlm
    ids = _prompt_ids(tokenizer, 2)
    small, wide = Image.new("RGB", (56, 56), COLOURS[0]), Image.new("RGB", (112, 56), COLOURS[1])
    expanded, vision = images.prepare(ids, (small, wide), "r0")
    assert vision.grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]  # 14-pixel patches
    assert vision.pixel_values.shape == (16 + 32, 3 * 2 * 14 * 14)
    assert expanded.count(config.image_token_id) == 4 + 8 and len(expanded) == len(ids) - 2 + 12  # 2x2 merge
    capped = ImageInputs(folder, config, max_pixels=56 * 56)  # OpenRLHF-M's --max_pixels: fewer tokens per image
    assert capped.prepare(ids, (small, wide), "r0")[0].count(config.image_token_id) < 12
    with pytest.raises(DataError, match="r9: the prompt renders 2 image tokens for 1 images"):
        images.prepare(ids, (small,), "r9")


def _batch(vlm, rows: int = 4, new_tokens: int = 10):
    from rlrun.data.rollout import pack_rows, unpack_rows
    from rlrun.engines.hf import HFEngine
    from rlrun.engines.protocol import SamplingSettings

    _, config, tokenizer, model, images = vlm
    prompts = []
    for i, (size, count) in enumerate([((56, 56), 1), ((84, 56), 2)]):
        ids = _prompt_ids(tokenizer, count, "Which?" if i else "Colour?")
        prompts.append(images.prepare(ids, tuple(Image.new("RGB", size, COLOURS[j]) for j in range(count)), f"r{i}"))
    ids = [prompts[i % 2][0] for i in range(rows)]
    vision = RowVision.of_rows([prompts[i % 2][1] for i in range(rows)])
    engine = HFEngine(model, SamplingSettings(1.0, 1.0, new_tokens, tokenizer.pad_token_id, (tokenizer.eos_token_id,)),
                      torch.device("cpu"), tokenizer)
    responses = engine.sample(ids, seed=3, vision=vision).responses
    batch = unpack_rows(pack_rows(ids, responses, 64, new_tokens, tokenizer.pad_token_id), 64)
    batch.vision = vision
    return batch, ids, responses, prompts


def test_generation_with_images_never_samples_a_vision_token(vlm):
    """A sampled image token would be read as an image without pixels by every later forward: generation
    suppresses the vision tokens (a fresh tiny model gives each ~1/263 probability)."""
    from rlrun.vision.inputs import vision_token_ids

    batch, _, responses, _ = _batch(vlm, rows=8, new_tokens=24)
    banned = set(vision_token_ids(vlm[3]))
    assert len(banned) == 4 and not banned & {t for r in responses for t in r}
    assert sum(len(r) for r in responses) > 8  # it did generate


def test_log_probs_padded_and_packed_match_the_models_own_forward(vlm):
    """Left-padded prompts, right-padded responses, rows with one or two images of different sizes: each row's
    response log-probs equal the model's forward on that sequence alone (which computes its own multimodal positions);
    packed rows give the same values and the same gradients."""
    from helpers import assert_close_to_scale  # not at the top: the ranks run this file as __main__

    from rlrun.roles.forward import policy_log_probs

    _, config, _, model, _ = vlm
    batch, ids, responses, prompts = _batch(vlm)
    padded, _ = policy_log_probs(model, batch, 1.0)
    packed, _ = policy_log_probs(model, batch, 1.0, packing=True)
    mask = batch.action_mask.bool()
    for i, (prompt, response) in enumerate(zip(ids, responses)):
        seq = torch.tensor([prompt + response])
        vision = prompts[i % 2][1]
        with torch.no_grad():
            logits = model(input_ids=seq, pixel_values=vision.pixel_values, image_grid_thw=vision.grid_thw,
                           mm_token_type_ids=(seq == config.image_token_id).int()).logits[0, len(prompt) - 1:-1]
        own = torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(response)[:, None])[:, 0]
        torch.testing.assert_close(padded[i, :len(response)], own, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(packed[mask], padded[mask], rtol=1e-5, atol=1e-5)

    model.requires_grad_(True)  # the engine froze it

    def grads(packing: bool) -> dict[str, torch.Tensor]:
        model.zero_grad()
        logp, _ = policy_log_probs(model, batch, 1.0, packing=packing)
        (logp * batch.action_mask).sum().backward()
        return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    a, b = grads(False), grads(True)
    assert any("visual" in n for n in a), "the vision tower gets gradients"
    for name in a:
        assert_close_to_scale(b[name], a[name], msg=name)
    model.zero_grad()
    model.requires_grad_(False)


def test_row_vision_selects_rows_and_round_trips_through_state():
    a, b, empty = _vision(4, 1, 0), _vision(8, 2, 1), PromptVision.empty(8)
    rows = RowVision.of_rows([a, a, b, b, empty])
    assert len(rows.entries) == 3 and rows.row_entry.tolist() == [0, 0, 1, 1, 2]
    picked = rows[torch.tensor([3, 0])]
    inputs = picked.model_inputs(torch.device("cpu"), torch.float32)
    assert torch.equal(inputs["pixel_values"], torch.cat([b.pixel_values, a.pixel_values]))
    assert torch.equal(inputs["image_grid_thw"], torch.cat([b.grid_thw, a.grid_thw]))
    assert rows[torch.tensor([4])].model_inputs(torch.device("cpu"), torch.float32) == {}
    assert torch.equal(picked.grids(), inputs["image_grid_thw"]) and rows[torch.tensor([4])].grids() is None
    back = RowVision.from_state(rows.state())
    assert back.digest() == rows.digest() and back.row_entry.tolist() == rows.row_entry.tolist()
    both = RowVision.concat([rows, RowVision.of_rows([b])])
    assert both.row_entry.tolist() == [0, 0, 1, 1, 2, 3] and both.digest()[-1] == rows.digest()[2]


def test_freezing_the_vision_tower_freezes_it_alone(vlm):
    from rlrun.models.tiny import build_causal_lm, tiny_model_config
    from rlrun.runtime.errors import ConfigError
    from rlrun.vision.demo import tiny_vl_config
    from rlrun.vision.tower import freeze_vision_tower

    model = build_causal_lm(tiny_vl_config(), seed=0)
    frozen = freeze_vision_tower(model)
    names = {n for n, p in model.named_parameters() if not p.requires_grad}
    assert frozen == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    assert names == {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
    assert any("merger" in n for n in names)  # the projector too, as OpenRLHF's --freeze_visual_encoder
    with pytest.raises(ConfigError, match="has no vision tower"):
        freeze_vision_tower(build_causal_lm(tiny_model_config(), seed=0))


def test_freeze_prefix_matches_checkpoint_names_as_openrlhf_m_writes_them():
    """OpenRLHF-M's --freeze_prefix visual names the hub checkpoint's `visual.*`, which transformers 5 builds as
    `model.visual.*`: both spellings freeze the same parameters; a prefix matching nothing is an error."""
    from rlrun.models.tiny import build_causal_lm
    from rlrun.runtime.errors import ConfigError
    from rlrun.vision.demo import tiny_vl_config
    from rlrun.vision.tower import freeze_by_prefix

    for prefix in ("visual", "model.visual"):
        model = build_causal_lm(tiny_vl_config(), seed=0)
        frozen = freeze_by_prefix(model, (prefix,))
        assert {n for n, p in model.named_parameters() if not p.requires_grad} == \
            {n for n, _ in model.named_parameters() if n.startswith("model.visual.")}
        assert frozen == sum(p.numel() for n, p in model.named_parameters() if n.startswith("model.visual."))
    with pytest.raises(ConfigError, match="--freeze_prefix vision_model matches no parameter"):
        freeze_by_prefix(build_causal_lm(tiny_vl_config(), seed=0), ("vision_model",))


# ---- the rows' images across ranks ---------------------------------------------------------------------------


def _share(rank: int) -> RowVision:
    """Engine rank r's share: prompts of different sizes, some rows sharing a prompt, one prompt without images."""
    if rank == 0:
        a, b = _vision(4, 1, 10), _vision(12, 2, 11)
        return RowVision.of_rows([a, a, b, b])
    c, d = _vision(6, 1, 12), PromptVision.empty(8)
    return RowVision.of_rows([c, c, d, d])


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist

    from rlrun.launch.transfer import gather_vision

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    engines = [1, 2]  # rank 0 is a learner: it only receives
    local = _share(engines.index(rank)).state() if rank in engines else None
    states = gather_vision(engines, local, dist.group.WORLD, torch.device("cpu"))
    batch = RowVision.concat([RowVision.from_state(s) for s in states])
    torch.save({"digest": batch.digest(), "row_entry": batch.row_entry}, outdir / f"rank{rank}.pt")
    dist.barrier()
    dist.destroy_process_group()


def test_rows_images_arrive_intact_on_every_rank(tmp_path):
    """Two engine ranks send shares of different sizes (one prompt per entry, not per sample); every rank of the
    world, learners included, rebuilds the same rows with the same pixels (checksums)."""
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, 3, tmp_path, timeout=120)
    want = RowVision.concat([_share(0), _share(1)])
    for rank in range(3):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        assert got["digest"] == want.digest(), rank
        assert got["row_entry"].tolist() == [0, 0, 1, 1, 2, 2, 3, 3]


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
