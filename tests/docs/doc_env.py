"""What the documentation tests run commands in (a module name no other test folder uses).

- `fake_hub(root)`: a Hugging Face hub cache (HF_HUB_OFFLINE=1) holding every model the recipes and docs name, as
  `configs/recipes/models/<hub id>/config.json` alone (copies of the published files; no weights, no tokenizer:
  what a login node may hold to plan a job), and the hub datasets they name, a few rows each in the dataset's own schema (tests/peer_data.py).
- `dry_run(module, argv, world, per_node)`: `python -m <module> <argv> --dry_run` in this process, planned for a
  world of `world` ranks with `per_node` per node the way scripts/slurm/train.sh plans it (RANK=0 WORLD_SIZE=...
  LOCAL_WORLD_SIZE=...: no process per rank, no process group); returns (exit status, everything it printed).
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import shutil
import sys
from pathlib import Path

from helpers import REPO
from peer_data import lay_out_hub_cache, write_openrlhf_prompt_collection, write_parquet

MODELS = REPO / "configs" / "recipes" / "models"
# Hub models the recipes name whose config.json is not copied here: the published model they were trained from
# has the same architecture (OpenRLHF's Llama-3-8b SFT and reward models are Meta-Llama-3-8B fine-tunes).
SAME_ARCHITECTURE = {"OpenRLHF/Llama-3-8b-sft-mixture": "meta-llama/Meta-Llama-3-8B",
                     "OpenRLHF/Llama-3-8b-rm-mixture": "meta-llama/Meta-Llama-3-8B"}
LAUNCH_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT", "GROUP_RANK",
               "ROLE_RANK", "TORCHELASTIC_RESTART_COUNT", "SLURM_PROCID", "SLURM_STEP_ID")


def model_ids() -> dict[str, Path]:
    """hub id -> the folder holding its config.json copy."""
    ids = {str(p.parent.relative_to(MODELS)): p.parent for p in MODELS.rglob("config.json")}
    return {**ids, **{alias: ids[real] for alias, real in SAME_ARCHITECTURE.items()}}


def fake_hub(root: Path) -> dict[str, str]:
    """Lay out the cache under root; returns the environment that reads it."""
    cache, staging = root / "hub", root / "staging"
    for repo_id, folder in model_ids().items():
        files = staging / repo_id
        files.mkdir(parents=True)
        shutil.copy(folder / "config.json", files / "config.json")
        lay_out_hub_cache(cache, repo_id, files)
    prompts = staging / "prompt-collection" / "data"
    prompts.mkdir(parents=True)
    rows = write_openrlhf_prompt_collection(root / "collection.jsonl", [
        {"prompt": "Write a haiku about GPUs.", "label": ""}, {"prompt": "What is 12 * 7?", "label": "84"}],
        system="You are a helpful assistant.")
    write_parquet(prompts / "train-00000-of-00001.parquet", [json.loads(x) for x in rows.read_text().splitlines()])
    lay_out_hub_cache(cache, "OpenRLHF/prompt-collection-v0.1", prompts.parent, repo_type="dataset")
    pairs = staging / "preference" / "data"
    pairs.mkdir(parents=True)
    question = {"role": "user", "content": "How do I boil an egg?"}
    write_parquet(pairs / "train-00000-of-00001.parquet", [
        {"chosen": [question, {"role": "assistant", "content": "Simmer it for 9 minutes, then cool it in cold water."}],
         "rejected": [question, {"role": "assistant", "content": "Eggs cannot be boiled."}]}] * 4)
    lay_out_hub_cache(cache, "OpenRLHF/preference_dataset_mixture2_and_safe_pku", pairs.parent, repo_type="dataset")
    return {"HF_HUB_CACHE": str(cache), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
            "HF_DATASETS_CACHE": str(root / "datasets"), "RLRUN_CACHE": str(root / "rlrun")}  # --model_preset tiny-vl


@contextlib.contextmanager
def environment(values: dict[str, str]):
    saved = dict(os.environ)
    for key in LAUNCH_VARS:
        os.environ.pop(key, None)
    os.environ.update(values)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)


def entry(module: str):
    """The in-process main of `python -m <module>`."""
    import importlib

    if module in ("rlrun.ppo", "rlrun.sft", "rlrun.rm", "rlrun.dpo"):
        return importlib.import_module(module).main
    if module == "rlrun.tinker":  # a package: its __main__ holds main
        return importlib.import_module("rlrun.tinker.__main__").main
    raise ValueError(f"{module} has no dry run")


def dry_run(module: str, argv: list[str], world: int = 1, per_node: int | None = None,
            env: dict[str, str] | None = None) -> tuple[int, str]:
    from rlrun.models import hub

    launch = {} if world == 1 and per_node is None else {
        "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(per_node or world)}
    out = io.StringIO()
    # The run is imported here, not started: a PYTHONPATH the command sets reaches this interpreter's path instead
    added = [str(REPO / p) for p in (env or {}).get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[:0] = added
    with environment({**(env or {}), **launch}), contextlib.redirect_stdout(out), contextlib.redirect_stderr(out):
        hub.resolve.cache_clear()
        try:
            rc = entry(module)([*argv, "--dry_run"])
        except SystemExit as exc:  # argparse
            rc = exc.code if isinstance(exc.code, int) else 1
        finally:
            hub.resolve.cache_clear()
            for path in added:
                sys.path.remove(path)
    return rc, out.getvalue()


SHELL_FENCES = ("bash", "sh", "shell")
TORCHRUN_FLAGS_WITH_VALUE = {"nproc_per_node", "nproc-per-node", "nnodes", "max-restarts", "max_restarts", "rdzv_backend",
                             "rdzv-backend", "rdzv_endpoint", "rdzv-endpoint", "rdzv_id", "rdzv-id", "node_rank",
                             "node-rank", "master_addr", "master-addr", "master_port", "master-port", "log-dir", "log_dir",
                             "redirects", "tee", "rdzv_conf", "rdzv-conf", "monitor-interval", "monitor_interval"}
TRAINERS = ("rlrun.ppo", "rlrun.sft", "rlrun.rm", "rlrun.dpo", "rlrun.tinker")


def shell_commands(markdown: str) -> list[tuple[int, str]]:
    """(line number, command) for every command of every ```bash/sh/shell block: continuation lines joined,
    comments and blank lines dropped, `a && b` split into a and b."""
    import re

    out = []
    for match in re.finditer(r"^```(\w*)[^\n]*\n(.*?)^```", markdown, re.S | re.M):
        if match.group(1) not in SHELL_FENCES:
            continue
        first = markdown[:match.start(2)].count("\n") + 1
        pending, start = "", first
        for offset, line in enumerate(match.group(2).splitlines()):
            text = line.split(" #")[0].rstrip() if not line.lstrip().startswith("#") else ""
            if not pending:
                start = first + offset
            if text.endswith("\\"):
                pending += text[:-1] + " "
                continue
            command = (pending + text).strip()
            pending = ""
            if command:
                out += [(start, part.strip()) for part in command.split(" && ")]
    return out


def split_env(command: str) -> tuple[dict[str, str], list[str]]:
    """Leading VAR=value words (the command's environment) and the argv after them."""
    import shlex

    words = shlex.split(command)
    env = {}
    while words and "=" in words[0] and words[0].split("=", 1)[0].isidentifier():
        key, _, value = words.pop(0).partition("=")
        env[key] = value
    return env, words


def launch_of(argv: list[str], env: dict[str, str] | None = None) -> tuple[str, list[str], int, int | None] | None:
    """(module, its arguments, world size, ranks per node) when argv starts an rlrun trainer under torchrun or
    python, else None. torchrun's world is --nnodes (the largest of MIN:MAX) x --nproc_per_node; python's is
    WORLD_SIZE and LOCAL_WORLD_SIZE of the command's environment `env` when set, else 1."""
    env = env or {}
    if not argv:
        return None
    prog, rest = os.path.basename(argv[0]), argv[1:]
    if prog.startswith("python") and rest[:2] == ["-m", "torch.distributed.run"]:
        prog, rest = "torchrun", rest[2:]
    if prog.startswith("python"):
        if len(rest) >= 2 and rest[0] == "-m" and rest[1] in TRAINERS:
            world = int(env.get("WORLD_SIZE", "1"))
            return rest[1], rest[2:], world, int(env.get("LOCAL_WORLD_SIZE", world)) if "WORLD_SIZE" in env else None
        return None
    if prog != "torchrun":
        return None
    options: dict[str, str] = {}
    while rest and rest[0] != "-m":
        name, eq, value = rest.pop(0).lstrip("-").partition("=")
        if name in TORCHRUN_FLAGS_WITH_VALUE and not eq:
            value = rest.pop(0)
        options[name.replace("-", "_")] = value
    if len(rest) < 2 or rest[1] not in TRAINERS:
        return None
    per_node = int(options.get("nproc_per_node", "1"))
    nodes = int(options.get("nnodes", "1").split(":")[-1])
    return rest[1], rest[2:], nodes * per_node, per_node


if __name__ == "__main__":  # python tests/docs/doc_env.py WORLD PER_NODE MODULE ARGS...: one dry run, as the tests do
    import tempfile

    sys.path.insert(0, str(REPO / "tests"))
    with tempfile.TemporaryDirectory() as tmp:
        code, text = dry_run(sys.argv[3], sys.argv[4:], int(sys.argv[1]), int(sys.argv[2]), fake_hub(Path(tmp)))
    print(text)
    sys.exit(code)
