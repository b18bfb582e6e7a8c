"""bench/gpu/harness.py in --cpu mode, so the GPU harness never rots between the rare sessions with a GPU: every run
it knows is a valid rlrun job (parsed and planned as on its GPU, at its world size), and a real subset runs end to end
(the in-process native-vs-HF check and one torchrun job), writing its table, results.json and logs."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from helpers import REPO, subprocess_env

sys.path.insert(0, str(REPO / "bench" / "gpu"))
import harness  # noqa: E402

from rlrun.cli.parser import parse_args  # noqa: E402
from rlrun.plan.plan import lay_out  # noqa: E402


@pytest.mark.parametrize("run", harness.RUNS, ids=lambda r: r.name)
def test_every_run_is_a_valid_job_at_its_world_size(run: harness.Run) -> None:
    cfg = parse_args(["--config", str(REPO / "configs" / run.config), "--device", "cuda",
                      "--max_steps", str(run.steps), *run.flags]).config
    layout = lay_out(cfg, world_size=run.ranks, ranks_per_node=run.ranks).layout
    assert layout.world_size == run.ranks


def test_cpu_mode_runs_checks_and_writes_results(tmp_path) -> None:
    out = tmp_path / "gpu_check"
    proc = subprocess.run([sys.executable, str(REPO / "bench" / "gpu" / "harness.py"), "--cpu", "--out", str(out),
                           "--only", "engine_vs_hf", "grpo_packing", "decode_buckets", "packed_attention",
                           "native_moe_graph", "vs_trl_1.5b_qwen_vocab", "--jobs", "1"],
                          cwd=REPO, env=subprocess_env(), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-4000:]
    results = {r["name"]: r for r in json.loads((out / "results.json").read_text())}
    assert {name: r["status"] for name, r in results.items()} == {"env": "pass", "engine_vs_hf": "pass",
                                                                  "grpo_packing": "pass", "decode_buckets": "pass",
                                                                  "packed_attention": "pass",
                                                                  "native_moe_graph": "pass",
                                                                  "vs_trl_1.5b_qwen_vocab": "pass"}
    assert results["engine_vs_hf"]["numbers"]["lp_diff_max"] < 1e-3
    spans = results["decode_buckets"]["numbers"]
    assert spans["greedy_equal_whole_capacity"] and spans["spans_built_2048"] > 1  # several spans, as the rows grew
    packed = results["packed_attention"]["numbers"]
    assert packed["max_diff_packed_by_sequence"] < 1e-4 and packed["real_tokens"] < packed["padded_tokens"]
    assert results["native_moe_graph"]["numbers"]["greedy_rows_equal_loop"] == 4  # grouped experts: the loop's tokens
    assert results["grpo_packing"]["numbers"]["steps"] == 2
    # TRL's GRPOTrainer and rlrun.ppo on one Qwen-vocab folder (vs_trl_0.5b differs only in the model it saves)
    side = results["vs_trl_1.5b_qwen_vocab"]["numbers"]
    assert side["params"] == 9_798_208  # 2 layers of width 64 over the real vocabulary's 151,936 rows
    for trainer in ("trl", "rlrun"):  # both trained the job: phases within the step, MFU from the train phase
        phases = sum(side[f"{trainer}_{p}_s"] for p in ("generate", "score", "train"))
        assert 0 < phases <= side[f"{trainer}_s_per_step"] * 1.01, (trainer, side)
        assert 0 < side[f"{trainer}_train_mfu"] < 1 and 0 < side[f"{trainer}_response_length"] <= 8
    assert side["trl_over_rlrun"] == pytest.approx(side["trl_s_per_step"] / side["rlrun_s_per_step"], rel=0.05)
    assert (out / "logs.tar.gz").stat().st_size > 0
    assert "grpo_packing" in proc.stdout and "0 failed" in proc.stdout


def test_the_real_vocab_model_folder(tmp_path) -> None:
    """The 1.5B throughput runs' --pretrain (here in its CPU shape): Qwen2.5-1.5B-Instruct's published config with
    Qwen's real tokenizer and generation_config, read by rlrun as a user's Qwen folder."""
    from rlrun.config.model import PretrainedConfig
    from rlrun.models.loading import load_model_config, load_tokenizer, response_end_ids

    folder = harness.qwen_1_5b_folder(tmp_path, cpu=True)
    assert folder is not None and harness.qwen_1_5b_folder(tmp_path, cpu=True) == folder  # built once
    pretrained = PretrainedConfig(pretrain=str(folder))
    config, tokenizer = load_model_config(pretrained), load_tokenizer(pretrained)
    assert (config.vocab_size, config.tie_word_embeddings, config.num_hidden_layers) == (151936, True, 2)
    assert len(tokenizer) == 151669 and response_end_ids(pretrained, tokenizer) == (151645, 151643)


def test_each_check_starts_from_an_empty_run_folder(tmp_path) -> None:
    """A second harness run into the same --out: the first run's checkpoints and log are gone before a check starts
    (resume_exact met them and stopped with 'holds checkpoints of another run')."""
    old = tmp_path / "runs" / "resume_exact" / "ckpt" / "step_2"
    old.mkdir(parents=True)
    (old / "state.pt").write_text("first run")
    log = tmp_path / "logs" / "resume_exact.log"
    log.parent.mkdir()
    log.write_text("first run's log")
    folder = harness.fresh(tmp_path / "runs" / "resume_exact", log)
    assert folder.is_dir() and not any(folder.iterdir()) and not log.exists()
    assert harness.prebuild_deepspeed_op([r for r in harness.RUNS if "deepspeed" not in r.flags], True, 1) == ""
