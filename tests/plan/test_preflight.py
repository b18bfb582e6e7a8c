"""--dry_run as the Slurm scripts' preflight: it reads the prompt data in the peers' schemas, renders the first prompt
as the policy will see it, and imports the reward source, so what would fail at step 0 on allocated nodes fails on
the login node, with one error line and a non-zero exit (real files, the embedded tokenizer, in-process)."""

from __future__ import annotations

import os
import re

import pytest
from helpers import REPO
from peer_data import lay_out_hub_cache, write_verl_gsm8k

import rlrun.ppo
from rlrun.cli.parser import parse_args
from rlrun.models import hub
from rlrun.models.tiny import build_byte_tokenizer, tiny_model_config
from rlrun.plan.preflight import preflight
from rlrun.runtime.errors import RlrunError

LAUNCH_VARS = re.compile(r"^(RANK|LOCAL_RANK|WORLD_SIZE|LOCAL_WORLD_SIZE|MASTER_ADDR|MASTER_PORT|TORCHELASTIC_\w+|SLURM_\w+)$")


@pytest.fixture
def single_process(monkeypatch):
    for key in list(os.environ):
        if LAUNCH_VARS.match(key):
            monkeypatch.delenv(key)


def test_verl_parquet_is_read_rendered_and_scored_by_name(tmp_path):
    data = write_verl_gsm8k(tmp_path / "train.parquet", [("Tom has 9 apples and eats 2. How many are left?", "7")] * 4)
    cfg = parse_args([f"data.train_files={data}", "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2",
                      "data.train_batch_size=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4"]).config
    data_line, reward_line = preflight(cfg)
    assert f"--prompt_data {data}: 4 prompts" in data_line
    # the message list went through the (byte tokenizer's) chat template, with the generation prompt
    assert "sees it: 'User: Tom has 9 apples" in data_line and "Assistant: '; its label: '7'" in data_line
    assert reward_line.startswith("reward: built-in rule scores (verl's default_compute_score)")


def test_the_main_entry_point_prints_the_preflight_and_exits_zero(tmp_path, single_process, capsys):
    data = tmp_path / "p.jsonl"
    data.write_text('{"question": "What is 2+3?", "answer": "5"}\n' * 2)
    rc = rlrun.ppo.main(["--dry_run", "--prompt_data", str(data), "--input_key", "question", "--label_key", "answer",
                         "--remote_rm_url", str(REPO / "examples" / "reward.py"), "--rollout_batch_size", "2",
                         "--micro_rollout_batch_size", "2", "--train_batch_size", "2", "--micro_train_batch_size", "2"])
    out = capsys.readouterr()
    assert rc == 0, out.err
    assert "the first as the policy sees it: 'What is 2+3?'; its label: '5'" in out.out + out.err
    assert f"reward: {REPO / 'examples' / 'reward.py'}" in out.out + out.err


@pytest.mark.parametrize("flags, message", [
    (["--input_key", "prompt", "--remote_rm_url", "demo"], "has no input_key 'prompt'; keys present: ['question', 'answer']"),
    (["--input_key", "question", "--remote_rm_url", str(REPO / "tests" / "fixtures" / "reward_import_error.py")],
     "reward_import_error.py"),
    (["--input_key", "question", "--compute_score", "scorer.py"], "compute_score"),
])
def test_what_would_fail_at_step_0_fails_the_dry_run(tmp_path, single_process, capsys, monkeypatch, flags, message):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "scorer.py").write_text("def score(data_source, solution_str, ground_truth, extra_info=None):\n"
                                        "    return 0.0\n")  # verl's signature under another name
    data = tmp_path / "p.jsonl"
    data.write_text('{"question": "What is 2+3?", "answer": "5"}\n')
    with pytest.raises(RlrunError, match=re.escape(message)):
        preflight(parse_args(["--prompt_data", str(data), *flags]).config)
    rc = rlrun.ppo.main(["--dry_run", "--prompt_data", str(data), *flags])
    err = capsys.readouterr()
    assert rc == 2
    errors = [line for line in (err.out + err.err).splitlines() if "error" in line]
    assert len(errors) == 1 and message in errors[0], errors


def test_hub_ids_resolve_from_the_cache_and_an_offline_miss_is_named_not_failed(tmp_path, single_process, capsys,
                                                                                monkeypatch):
    """Cached hub ids (model and dataset) are read, with no warning; an id not cached here with HF_HUB_OFFLINE=1 may
    as well be a path an earlier stage writes (`out/sft`): the dry run names it, plans without it and passes (the
    job itself still fails on it, naming the cache: tests/models/test_hub.py)."""
    monkeypatch.setenv("HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    hub.resolve.cache_clear()
    model = tmp_path / "model"
    build_byte_tokenizer().save_pretrained(model)
    (model / "config.json").write_text(tiny_model_config().to_json_string())
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/policy", model)
    files = tmp_path / "files"
    files.mkdir()
    (files / "train.jsonl").write_text('{"question": "What is 2+3?", "answer": "5"}\n')
    lay_out_hub_cache(tmp_path / "hub", "tiny-org/questions", files, repo_type="dataset")
    argv = ["--dry_run", "--pretrain", "tiny-org/policy", "--prompt_data", "tiny-org/questions", "--input_key",
            "question", "--label_key", "answer", "--apply_chat_template", "--remote_rm_url", "demo"]
    assert rlrun.ppo.main(argv) == 0
    out = capsys.readouterr()
    assert "the first as the policy sees it: 'User: What is 2+3?\\nAssistant: '; its label: '5'" in out.out + out.err
    assert "not on this machine" not in out.out + out.err and "not in this machine's cache" not in out.out + out.err
    assert rlrun.ppo.main([*argv[:2], "out/sft", *argv[3:]]) == 0
    out = "".join(capsys.readouterr())
    assert "--pretrain out/sft: not on this machine: a path not written yet (an earlier stage's output?), or a " \
           "Hugging Face Hub id not in this machine's cache" in out, out
    assert "memory plan skipped: --pretrain out/sft is not on this machine" in out, out
    assert "--prompt_data tiny-org/questions: 1 records read (not rendered: --pretrain out/sft is not on this " \
           "machine" in out, out
    hub.resolve.cache_clear()


def test_a_dry_run_plans_vllm_engines_where_vllm_is_not_installed(single_process, capsys, monkeypatch):
    from rlrun.engines.vllm import adapter as vllm_adapter

    monkeypatch.setattr(vllm_adapter, "installed_version", lambda: None)  # as on a login node, or CI
    argv = ["--generation_backend", "vllm", "--remote_rm_url", "demo", "--gpu_memory_gb", "80"]
    assert rlrun.ppo.main([*argv, "--dry_run"]) == 0
    out = "".join(capsys.readouterr())
    assert out.count("vLLM is not installed here: the plan assumes it is on the nodes that run the job") == 1, out
    assert re.search(r"^ranks .*\| vllm \|", out, re.M) and re.search(r"^0 +\| 0 +\| actor,critic,ref,engine \|", out,
                                                                       re.M), out  # vLLM's memory on the engine rank
    assert rlrun.ppo.main(argv) == 2  # the job itself refuses, in one line, before anything starts
    errors = [line for line in "".join(capsys.readouterr()).splitlines() if "error" in line]
    assert len(errors) == 1 and errors[0].endswith("--generation_backend vllm needs the optional package 'vllm', which "
                                                   "is not installed. Install it with: pip install 'rlrun[vllm]'"), errors
