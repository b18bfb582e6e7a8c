"""Hub ids resolved through a real hub cache laid out as `hf download` leaves it (blobs, refs, snapshot symlinks),
with HF_HUB_OFFLINE=1 (nothing is downloaded here): models load from it, and what cannot resolve says where it looked
and what to do."""

from __future__ import annotations

import pytest
from peer_data import lay_out_hub_cache
from transformers import AutoModelForCausalLM

from rlrun.config.model import PretrainedConfig
from rlrun.models import hub
from rlrun.models.loading import load_causal_lm, load_tokenizer
from rlrun.models.tiny import build_byte_tokenizer, build_causal_lm, tiny_model_config
from rlrun.runtime.errors import ConfigError


@pytest.fixture
def offline_cache(tmp_path, monkeypatch):
    cache = tmp_path / "hub"
    monkeypatch.setenv("HF_HUB_CACHE", str(cache))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.resolve.cache_clear()
    yield cache
    hub.resolve.cache_clear()


def test_a_cached_model_id_resolves_to_its_snapshot_and_loads(tmp_path, offline_cache):
    saved = tmp_path / "saved"
    build_causal_lm(tiny_model_config(), seed=5).save_pretrained(saved)
    build_byte_tokenizer().save_pretrained(saved)
    snapshot = lay_out_hub_cache(offline_cache, "tiny-org/Tiny-Qwen2", saved)
    section = hub.resolve_models(PretrainedConfig(pretrain="tiny-org/Tiny-Qwen2"))
    assert section.pretrain == str(snapshot)
    model = load_causal_lm(section, seed=0)
    expected = AutoModelForCausalLM.from_pretrained(saved)
    assert all((a == b).all() for a, b in zip(model.state_dict().values(), expected.state_dict().values()))
    assert load_tokenizer(section).encode("hi") == build_byte_tokenizer().encode("hi")
    assert hub.resolve(str(saved), "model", "pretrain") == str(saved)  # a local path is itself


def test_offline_and_not_cached_names_the_cache_and_the_way_out(offline_cache):
    with pytest.raises(ConfigError) as err:
        hub.resolve("Qwen/Qwen2.5-7B", "model", "pretrain")
    text = str(err.value)
    assert text.startswith("--pretrain Qwen/Qwen2.5-7B: Qwen/Qwen2.5-7B is not in the Hugging Face cache")
    assert str(offline_cache) in text and "HF_HUB_OFFLINE=1" in text and "hf download Qwen/Qwen2.5-7B" in text
    with pytest.raises(ConfigError, match="hf download --repo-type dataset OpenRLHF/prompt-collection-v0.1"):
        hub.resolve("OpenRLHF/prompt-collection-v0.1", "dataset", "prompt_data")


@pytest.mark.parametrize("name", ["./models/qwen", "/no/such/dir", "~/model"])
def test_a_missing_path_is_not_taken_for_a_hub_id(name, offline_cache):
    with pytest.raises(ConfigError, match="no such file or directory, and not a Hugging Face Hub id"):
        hub.resolve(name, "model", "pretrain")


def test_repo_id_shapes():
    assert hub.parse_repo_id("Qwen/Qwen2.5-7B-Instruct") == ("Qwen/Qwen2.5-7B-Instruct", None)
    assert hub.parse_repo_id("gpt2") == ("gpt2", None)
    assert hub.parse_repo_id("org/name@v1.0") == ("org/name", "v1.0")
    assert hub.parse_repo_id("data/train.parquet") is None and hub.parse_repo_id("a/b/c") is None


def test_a_dry_run_names_an_uncached_owner_name_instead_of_failing(offline_cache):
    """`out/sft` (an earlier stage's output, not written yet) has a hub id's shape: a dry run keeps the name (planning
    says it is a path not written yet or a hub id not cached here); a real run still fails, naming the cache."""
    assert hub.resolve("out/sft", "model", "pretrain", download=False) == "out/sft"
    note = hub.missing_note("pretrain", "out/sft", "model")
    assert note is not None and note.startswith("--pretrain out/sft: not on this machine: a path not written yet")
    assert "Hugging Face Hub id not in this machine's cache" in note
    hub.resolve.cache_clear()
    with pytest.raises(ConfigError, match="out/sft is not in the Hugging Face cache"):
        hub.resolve("out/sft", "model", "pretrain")
    assert hub.missing_note("pretrain", "/elsewhere/sft", "model") == \
        "--pretrain /elsewhere/sft: not found on this machine (another host's path?)"


def test_an_online_dry_run_keeps_a_name_the_hub_does_not_know(offline_cache, monkeypatch):
    import httpx2
    from huggingface_hub import HfApi
    from huggingface_hub.errors import GatedRepoError, RepositoryNotFoundError

    monkeypatch.delenv("HF_HUB_OFFLINE")
    response = httpx2.Response(404, request=httpx2.Request("GET", "https://huggingface.co/api/models/out/sft"))

    def unknown(self, repo_id, **kwargs):
        raise RepositoryNotFoundError(f"404: {repo_id}", response=response)

    monkeypatch.setattr(HfApi, "repo_info", unknown)
    assert hub.resolve("out/sft", "model", "pretrain", download=False) == "out/sft"

    def gated(self, repo_id, **kwargs):
        raise GatedRepoError(f"403: {repo_id}", response=response)

    monkeypatch.setattr(HfApi, "repo_info", gated)
    with pytest.raises(ConfigError, match="that this machine may read \\(GatedRepoError\\)"):
        hub.resolve("meta-llama/Meta-Llama-3-8B", "model", "pretrain", download=False)

    def no_network(self, repo_id, **kwargs):  # what a login node without DNS raised: a traceback wall before
        raise httpx2.ConnectError("[Errno -2] Name or service not known")

    monkeypatch.setattr(HfApi, "repo_info", no_network)
    assert hub.resolve("Qwen/Qwen3-30B-A3B", "model", "pretrain", download=False) == "Qwen/Qwen3-30B-A3B"


def test_cached_reads_the_hub_cache_layout_under_hf_hub_cache_or_hf_home(tmp_path, monkeypatch):
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text("{}\n")
    home = tmp_path / "home"
    snapshot = lay_out_hub_cache(home / "hub", "org/pairs", files, repo_type="dataset")
    monkeypatch.delenv("HF_HUB_CACHE", raising=False)
    monkeypatch.delenv("HUGGINGFACE_HUB_CACHE", raising=False)
    monkeypatch.setenv("HF_HOME", str(home))  # read now, not when huggingface_hub was imported
    assert hub.cache_dir() == str(home / "hub")
    assert hub.cached("org/pairs", "dataset") == str(snapshot)
    assert hub.cached("org/pairs@0123456789abcdef0123456789abcdef01234567", "dataset") == str(snapshot)
    assert hub.cached("org/pairs", "model") is None  # a dataset repo is not a model repo
    assert hub.cached("org/pairs@v2", "dataset") is None and hub.cached("org/other", "dataset") is None
    assert hub.cached("data/train.parquet", "dataset") is None  # not a hub id's shape
    assert hub.missing_note("dataset", "org/pairs", "dataset") is None
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "elsewhere"))  # HF_HUB_CACHE wins over HF_HOME
    assert hub.cached("org/pairs", "dataset") is None
    assert "Hub dataset id not in this machine's cache" in hub.missing_note("dataset", "org/pairs", "dataset")
