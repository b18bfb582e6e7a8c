"""configs/recipes: each recipe's launch line (the `torchrun` line in its header) is dry-run for its world size
against copies of its models' config.json (configs/recipes/models/, no weights): the layout and the memory plan
print, and every trainer rank fits the 80 GB GPUs the recipes are sized for. The engines are planned twice: as
the dry run here plans them (no vLLM installed: the native engine) and as vLLM, which --generation_backend auto
picks on GPU nodes with vLLM installed (planned through rlrun.rl.memory_plan, which needs no vLLM)."""

from __future__ import annotations

import dataclasses
import re
import shlex

import pytest
from doc_env import MODELS, REPO, dry_run, environment, fake_hub, launch_of, model_ids

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
    rc, out = dry_run(module, [*args, *(["--gpu_memory_gb", str(GPU_GB)] if module == "rlrun.ppo" else [])],
                      world, per_node, env=hub_env)
    assert rc == 0, out[-3000:]
    if module != "rlrun.ppo":  # SFT/RM/DPO: data-parallel on every rank, no layout table or memory plan yet
        assert f"{world} ranks (launcher torchrun), every rank trains one data-parallel shard" in out, out
        assert "holds no tokenizer files (a config-only copy)" in out, out  # data read where the tokenizer is
        return
    assert f"layout for world size {world} ({per_node} ranks per node" in out, out[-3000:]
    assert f"memory plan, GiB per rank at its peak phase, for GPUs of {GPU_GB}.0 GiB" in out, out[-3000:]
    assert re.search(r"policy: \d+\.\d\dB parameters", out), out[-3000:]
    # planned with the native engine (no vLLM here): only engine ranks may be short of memory
    misfits = [line for line in out.splitlines() if "does not fit:" in line]
    assert all("does not fit: engine on ranks" in line for line in misfits), misfits


@pytest.mark.parametrize("recipe", [r for r in RECIPES if _launch(r)[0] == "rlrun.ppo"], ids=lambda p: p.stem)
def test_recipe_fits_with_vllm_engines(recipe, hub_env):
    from rlrun.cli.parser import parse_args
    from rlrun.models.hub import resolve, resolve_models
    from rlrun.rl.memory_estimate import GIB, Target
    from rlrun.rl.memory_plan import plan_memory
    from rlrun.rl.memory_text import problem_lines, read_shapes
    from rlrun.rl.planning import plan

    _, args, world, per_node = _launch(recipe)
    with environment(hub_env):
        resolve.cache_clear()
        cfg = parse_args([*args, "--generation_backend", "vllm"]).config
        cfg = dataclasses.replace(cfg, model=resolve_models(cfg.model, download=False))
        resolve.cache_clear()
    layout = plan(cfg, world, per_node).layout
    shapes, _ = read_shapes(cfg, layout)
    memory = plan_memory(cfg, layout, shapes, Target(True, GPU_GB * GIB, "recipe"))
    assert memory.fits, problem_lines(memory)


def test_a_config_json_alone_is_enough_for_the_dry_run(tmp_path):
    model = tmp_path / "Meta-Llama-3-8B"
    model.mkdir()
    (model / "config.json").write_text((MODELS / "meta-llama" / "Meta-Llama-3-8B" / "config.json").read_text())
    rc, out = dry_run("rlrun.ppo", ["--pretrain", str(model), "--remote_rm_url", "demo", "--gpu_memory_gb", "80"],
                      8, 8, env={"HF_HUB_OFFLINE": "1"})
    assert rc == 0 and "memory plan, GiB per rank" in out, out[-2000:]
