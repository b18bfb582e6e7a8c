"""Ulysses sequence parallelism in the supervised trainers (torchrun, gloo, the embedded tiny model): 4 ranks in 2
sequence-parallel blocks of 2 (OpenRLHF's --ring_attn_size and --ds.ring_attn_size spellings) train step for step
like 2 data-parallel ranks on packed rows: the same losses, gradient norms, evaluation and exported weights. The
sequence-parallel checks of the command line fail before any process group."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from helpers import run_rlrun, untimed
from rlrun.config.supervised import SFTConfig
from rlrun.plan.checks import check_supervised
from rlrun.runtime.errors import ConfigError
from rlrun.supervised.datasets import write_all

COMMON = ["--train_batch_size", "8", "--micro_train_batch_size", "2", "--max_len", "48", "--max_steps", "2",
          "--dist_timeout", "60", "--lr_warmup_ratio", "0"]
ARGS = {
    "rlrun.sft": ["--output_key", "output", "--input_template", "{}", "--learning_rate", "3e-3"],
    "rlrun.rm": ["--learning_rate", "1e-3"],
    "rlrun.dpo": ["--learning_rate", "1e-3"],
}


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> dict[str, str]:
    return write_all(str(tmp_path_factory.mktemp("data")), sft=32, pairs=32, eval_pairs=8)



@pytest.mark.parametrize("module, spelling", [("rlrun.sft", "--ring_attn_size"), ("rlrun.rm", "--ds.ring_attn_size"),
                                              ("rlrun.dpo", "--sequence_parallel_size")])
def test_two_blocks_of_two_train_like_two_data_parallel_ranks(module, spelling, data, tmp_path) -> None:
    files = ["--dataset", data["sft"]] if module == "rlrun.sft" else ["--dataset", data["pairs"], "--eval_dataset",
                                                                      data["pairs_eval"]]
    args = [*files, *ARGS[module], *COMMON]
    plain = run_rlrun(2, [*args, "--packing_samples"], tmp_path / "dp", module=module)
    assert plain.returncode == 0, plain.output[-3000:]
    split = run_rlrun(4, [*args, spelling, "2"], tmp_path / "sp", module=module)
    assert split.returncode == 0, split.output[-3000:]
    assert "sequence parallelism 2: Ulysses" in split.output and "not ring attention" in split.output
    assert "--packing_samples is on" in split.output  # packed rows are what the blocks split
    a, b = untimed(plain.metrics), untimed(split.metrics)
    assert len(a) == len(b) == (2 if module == "rlrun.sft" else 3)  # pair trainers evaluate after the last step
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert y[key] == pytest.approx(x[key], rel=1e-5, abs=1e-6), (key, x, y)
    config = json.loads((tmp_path / "sp" / "config.json").read_text())
    assert config.get("_attn_implementation", "sdpa") != "rlrun_ulysses"  # the export loads anywhere
    want, got = load_file(tmp_path / "dp" / "model.safetensors"), load_file(tmp_path / "sp" / "model.safetensors")
    assert want.keys() == got.keys()
    for name in want:  # Adam's update of a near-zero gradient magnifies float-order differences: 1e-4 after 2 steps
        torch.testing.assert_close(got[name], want[name], atol=1e-4, rtol=1e-3)


def test_sizes_that_do_not_split_the_world_or_the_batch_are_errors_naming_the_numbers() -> None:
    def check(world: int, *argv: str) -> str:
        with pytest.raises(ConfigError) as err:
            cfg = SFTConfig()
            cfg.data.dataset = "x.jsonl"
            for flag, value in zip(argv[::2], argv[1::2]):
                setattr(cfg.train, flag.removeprefix("--"), int(value))
            check_supervised(cfg, world, "python -m rlrun.sft")
        return str(err.value)

    assert "--sequence_parallel_size 3 does not divide the 4 ranks" in check(4, "--sequence_parallel_size", "3")
    text = check(8, "--sequence_parallel_size", "2", "--train_batch_size", "6")
    assert "--train_batch_size 6 must be a multiple of the 4 data-parallel shares (8 ranks / --sequence_parallel_size 2)" in text
    assert "use e.g. 4" in text
    assert "must be > 0" in check(4, "--sequence_parallel_size", "0")
