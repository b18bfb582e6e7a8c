"""safetensors files written one tensor at a time from a layout planned without the tensors
(rlrun.models.safetensors): the same files, split and index as transformers' save_pretrained, readable by
safetensors and transformers, and nothing a loader would take for a model until every tensor is in."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM

from rlrun.models.safetensors import SafetensorsLayout, StreamedSafetensors, TensorSpec
from rlrun.models.tiny import build_causal_lm, tiny_model_config


def _specs(state: dict[str, torch.Tensor]) -> dict[str, TensorSpec]:
    return {k: TensorSpec(tuple(v.shape), v.dtype) for k, v in state.items()}


def _write(layout: SafetensorsLayout, state: dict[str, torch.Tensor], directory) -> list[str]:
    files = StreamedSafetensors(layout, str(directory))
    for name in reversed(list(state)):  # any order: the layout fixed every offset beforehand
        files.write(name, state[name])
    return files.commit()


def test_a_sharded_layout_is_save_pretrained_s_and_loads_back(tmp_path):
    """At max_shard_size 100 kB the tiny model takes several files: the same names, tensors per file and index
    as save_pretrained's at that size; every tensor reads back bit for bit; each header starts the data 8-byte
    aligned; transformers loads the folder (config written by save_pretrained) to the same weights."""
    model = build_causal_lm(tiny_model_config(), seed=2)
    state = model.state_dict()
    ref, out = tmp_path / "ref", tmp_path / "out"
    model.save_pretrained(ref, max_shard_size="100KB")
    model.save_pretrained(out, state_dict={})  # config.json and generation_config.json only
    layout = SafetensorsLayout(_specs(state), max_shard_size="100KB", total_parameters=model.num_parameters())
    written = _write(layout, state, out)
    assert len(written) > 2 and sorted(p.name for p in out.glob("*.safetensors")) == sorted(p.name for p in ref.glob("*.safetensors"))
    index, want = (json.loads((d / "model.safetensors.index.json").read_text()) for d in (out, ref))
    assert index == want
    for f in written:
        with safe_open(str(out / f), "pt") as mine, safe_open(str(ref / f), "pt") as theirs:
            assert sorted(mine.keys()) == sorted(theirs.keys()) and mine.metadata() == theirs.metadata() == {"format": "pt"}
            for k in theirs.keys():
                assert torch.equal(mine.get_tensor(k), theirs.get_tensor(k)), k
        header = (out / f).read_bytes()
        assert (8 + struct.unpack("<Q", header[:8])[0]) % 8 == 0
    loaded = AutoModelForCausalLM.from_pretrained(out)
    assert all(torch.equal(loaded.state_dict()[k], v) for k, v in state.items())
    assert not list(out.glob(".*"))  # no temporary file left


def test_odd_dtypes_shapes_and_stale_files(tmp_path):
    """bf16, bool, int64, a 0-dim and an empty tensor read back exactly. A folder holding a previous save keeps
    nothing a loader would read instead: shards of a larger split and a lone model.safetensors go when the new
    save is sharded; an index goes when it is one file."""
    state = {"a": torch.randn(3, 5).to(torch.bfloat16), "mask": torch.tensor([True, False, True]),
             "steps": torch.arange(7), "scale": torch.tensor(2.5), "empty": torch.zeros(0, 4), "b": torch.randn(300)}
    (tmp_path / "model.safetensors.index.json").write_text("{}")
    _write(SafetensorsLayout(_specs(state)), state, tmp_path)
    got = load_file(tmp_path / "model.safetensors")
    assert got.keys() == state.keys() and all(got[k].dtype == v.dtype and torch.equal(got[k], v) for k, v in state.items())
    assert not (tmp_path / "model.safetensors.index.json").exists()

    for stale in ("model-00001-of-00009.safetensors", "model-00009-of-00009.safetensors"):
        (tmp_path / stale).write_bytes(b"old")
    (tmp_path / "notes-00001-of-00002.safetensors").write_bytes(b"not ours")
    written = _write(SafetensorsLayout(_specs(state), max_shard_size=1000), state, tmp_path)
    assert sorted(p.name for p in tmp_path.glob("*.safetensors")) == sorted([*written, "notes-00001-of-00002.safetensors"])
    assert not (tmp_path / "model.safetensors").exists()
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert sorted(weight_map) == sorted(state) and set(weight_map.values()) == set(written)


def test_an_unfinished_stream_leaves_no_model(tmp_path):
    """A commit with a tensor missing raises naming it and removes the temporary files; so does abort; a tensor of
    the wrong shape or dtype is refused before anything is written."""
    state = {"w": torch.ones(4, 4), "v": torch.ones(4)}
    files = StreamedSafetensors(SafetensorsLayout(_specs(state)), str(tmp_path))
    with pytest.raises(ValueError, match=r"w: got \(4,\) torch.float32, the layout planned \(4, 4\)"):
        files.write("w", torch.ones(4))
    files.write("w", state["w"])
    with pytest.raises(RuntimeError, match=r"1 tensors never written, e.g. \['v'\]"):
        files.commit()
    assert list(tmp_path.iterdir()) == []
    files = StreamedSafetensors(SafetensorsLayout(_specs(state)), str(tmp_path))
    files.write("v", state["v"])
    files.abort()
    assert list(tmp_path.iterdir()) == []
    with pytest.raises(ValueError, match="complex64 has no safetensors name"):
        SafetensorsLayout({"z": TensorSpec((2,), torch.complex64)})
