"""configs/recipes: each recipe's launch line (the `torchrun` line in its header) is dry-run for its world size
against copies of its models' config.json (configs/recipes/models/, no weights): the layout (rlrun.ppo) and the
memory plan print, and every trainer rank fits the 80 GB GPUs the recipes are sized for. The engines are planned
twice: as the dry run here plans them (no GPU here: auto picks the native engine) and with --generation_backend
vllm, which auto picks on GPU nodes with vLLM installed (the dry run plans it whether or not vLLM is installed)."""

from __future__ import annotations

import importlib.util
import re
import shlex

import pytest
from doc_env import MODELS, REPO, dry_run, fake_hub, launch_of, model_ids

RECIPES = sorted((REPO / "configs" / "recipes").glob("*.yaml"))
GPU_GB = 80


def _launch(recipe):
    lines = [line.lstrip("# ").strip() for line in recipe.read_text().splitlines()
             if line.startswith("#") and line.lstrip("# ").startswith("torchrun ")]
    assert len(lines) == 1, f"{recipe.name}: its header needs exactly one `#   torchrun ...` launch line"
    launch = launch_of(shlex.split(lines[0]))
    assert launch is not None and f"--config configs/recipes/{recipe.name}" in lines[0], lines[0]
    return launch


@pytest.fixture(scope="module")
def hub_env(tmp_path_factory):
    return fake_hub(tmp_path_factory.mktemp("recipe_hub"))


def test_there_is_a_recipe_per_job_and_real_model_configs():
    assert len(RECIPES) >= 5
    for repo_id, folder in model_ids().items():
        config = (folder / "config.json").read_text()
        assert '"architectures"' in config and '"vocab_size"' in config, repo_id
    assert (MODELS / "meta-llama" / "Meta-Llama-3-70B" / "config.json").exists()


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda p: p.stem)
def test_recipe_dry_run_prints_layout_and_memory_plan(recipe, hub_env):
    module, args, world, per_node = _launch(recipe)
    rc, out = dry_run(module, [*args, "--gpu_memory_gb", str(GPU_GB)], world, per_node, env=hub_env)
    assert rc == 0, out[-3000:]
    assert f"memory plan, GiB per rank at its peak phase, for GPUs of {GPU_GB}.0 GiB" in out, out[-3000:]
    assert re.search(r"(policy|model): \d+\.\d\dB parameters", out), out[-3000:]
    assert "id not in this machine's cache" not in out, out[-3000:]  # the hub ids named are in the (fake) cache
    if module != "rlrun.ppo":  # SFT/RM/DPO: data-parallel on every rank, no layout table; every rank fits
        assert f"{world} ranks (launcher torchrun), every rank trains one data-parallel shard" in out, out
        assert re.search(r"^[\d-]+ +\| [\d-]+ +\| (model|policy,ref) +\| train +\|", out, re.M), out[-3000:]
        assert "does not fit:" not in out, out[-3000:]
        assert "holds no tokenizer files (a config-only copy)" in out, out  # data read where the tokenizer is
        return
    assert f"layout: {world} rank{'s' if world > 1 else ''} ({per_node} per node" in out, out[-3000:]
    # planned with the native engine (no vLLM here): only engine ranks may be short of memory
    misfits = [line for line in out.splitlines() if "does not fit:" in line]
    assert all("does not fit: engine on ranks" in line for line in misfits), misfits


@pytest.mark.parametrize("recipe", [r for r in RECIPES if _launch(r)[0] == "rlrun.ppo"], ids=lambda p: p.stem)
def test_recipe_fits_with_vllm_engines(recipe, hub_env):
    _, args, world, per_node = _launch(recipe)
    rc, out = dry_run("rlrun.ppo", [*args, "--generation_backend", "vllm", "--gpu_memory_gb", str(GPU_GB)], world,
                      per_node, env=hub_env)
    assert rc == 0, out[-3000:]
    if importlib.util.find_spec("vllm") is None:  # planned all the same, and said once
        assert out.count("vLLM is not installed here: the plan assumes it is") == 1, out[-3000:]
    # The 70B job's engines (2 x TP 4) fit too: weight sync streams to vLLM, no engine rank keeps a policy copy
    misfits = [line for line in out.splitlines() if "does not fit:" in line]
    table = out[out.index("memory plan, GiB per rank"):]
    assert re.search(r"^ranks .*\| vllm \|", table, re.M), table[:2000]  # engines planned as vLLM
    assert not misfits, out[-3000:]


def test_a_config_json_alone_is_enough_for_the_dry_run(tmp_path):
    model = tmp_path / "Meta-Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text((MODELS / "meta-llama" / "Meta-Llama-3-8B" / "config.json").read_text())
    rc, out = dry_run("rlrun.ppo", ["--pretrain", str(model), "--remote_rm_url", "demo", "--gpu_memory_gb", "80"],
                      8, 8, env={"HF_HUB_OFFLINE": "1"})
    assert rc == 0 and "memory plan, GiB per rank" in out, out[-2000:]
