"""bench/vs_trl.py's pieces that need no TRL: workload, reward, settings translation, parsing.

Never installs TRL and never trains: builds the 3.1M-parameter model once (about a second).
"""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[2] / "bench"


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, BENCH / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module  # dataclasses resolve their module by name
    spec.loader.exec_module(module)
    return module


vs_trl = _load("vs_trl")
reward = _load("vs_trl_reward")


def test_lowercase_fraction_by_hand():
    assert reward.lowercase_fraction("") == 0.0
    assert reward.lowercase_fraction("abC1") == 0.5  # a, b of 4 characters
    assert reward.lowercase_fraction("xyz") == 1.0
    assert reward.lowercase_fraction("ÄÉ 9!") == 0.0  # non-ASCII letters do not count


def test_both_signatures_score_the_same_completion():
    prompts = ["Say some words:", "List ten verbs:"]
    completions = [" hello World", "AB"]
    queries = [p + c for p, c in zip(prompts, completions)]
    # " hello World": h,e,l,l,o,o,r,l,d = 9 lowercase of 12 characters
    assert reward.reward_func(queries, prompts, [None, None]) == [0.75, 0.0]
    assert reward.trl_reward(prompts=prompts, completions=completions, completion_ids=[[], []]) == [0.75, 0.0]
    with pytest.raises(ValueError, match="queries\\[0\\]"):
        reward.reward_func(["other text"], ["Say:"], [None])


def test_prompts_are_distinct_and_deterministic():
    prompts = vs_trl.make_prompts(256)
    assert len({p["prompt"] for p in prompts}) == 256
    assert prompts[0] == {"prompt": "Write some words:"}
    assert prompts[9] == {"prompt": "Type a few words:"}
    assert prompts == vs_trl.make_prompts(256)


def test_workdir_model_tokenizer_prompts_reward(tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    wl = vs_trl.Workload()
    files = vs_trl.build_workdir(tmp_path, wl)
    n_params = files.num_params
    assert 3_000_000 < n_params < 3_200_000
    model = AutoModelForCausalLM.from_pretrained(files.model_dir)
    assert (model.config.hidden_size, model.config.num_hidden_layers, model.config.vocab_size) == (256, 4, 259)
    assert sum(p.numel() for p in model.parameters()) == n_params
    tok = AutoTokenizer.from_pretrained(files.model_dir)
    # transformers reloads it as Qwen2Tokenizer (from config.json's model_type), which appends an unk
    # token at id 259, outside the model's 259 rows; the ids both trainers use are the byte ones.
    assert (tok.pad_token_id, tok.bos_token_id, tok.eos_token_id) == (256, 257, 258) == (
        model.config.pad_token_id, model.config.bos_token_id, model.config.eos_token_id)
    assert tok("Say ten verbs:")["input_ids"] == list(b"Say ten verbs:")
    assert tok.decode(list(b"Say ten verbs:")) == "Say ten verbs:"
    lines = Path(files.prompts_file).read_text().splitlines()
    assert len(lines) == 256 and json.loads(lines[0]) == {"prompt": "Write some words:"}
    assert Path(files.reward_file).read_text() == (BENCH / "vs_trl_reward.py").read_text()


def _flag(args: list[str], name: str) -> str:
    return args[args.index(name) + 1]


@pytest.mark.parametrize("system", [s for s in vs_trl.SYSTEMS if s.kind == "rlrun"], ids=lambda s: s.slug)
def test_rlrun_and_trl_get_the_same_job(tmp_path, system):
    wl = vs_trl.Workload()
    files = vs_trl.WorkFiles("M", "P", "R", 3_086_080)
    args = vs_trl.rlrun_args(wl, files, system, 12, tmp_path)
    nproc = system.data_parallel
    trl = vs_trl.trl_config(wl, 12, tmp_path)
    # 8 prompts x 4 samples = 32 completions, one optimizer step over all 32, in both
    assert int(_flag(args, "--rollout_batch_size")) * int(_flag(args, "--n_samples_per_prompt")) == 32
    assert _flag(args, "--train_batch_size") == "32" and _flag(args, "--max_epochs") == "1"
    assert _flag(args, "--micro_train_batch_size") == str(32 // nproc)
    assert trl["per_device_train_batch_size"] * trl["gradient_accumulation_steps"] == 32
    assert trl["num_generations"] == 4 and trl["num_iterations"] == 1
    # KL: k3 as a loss term with coefficient 0.04; group-normalised advantages
    assert "--use_kl_loss" in args and _flag(args, "--kl_estimator") == "k3"
    assert float(_flag(args, "--init_kl_coef")) == trl["beta"] == 0.04
    assert _flag(args, "--advantage_estimator") == "group_norm" and trl["scale_rewards"] == "group"
    # sampling, length, optimisation
    assert int(_flag(args, "--generate_max_len")) == trl["max_completion_length"] == 64
    assert float(_flag(args, "--temperature")) == trl["temperature"] == 1.0
    assert float(_flag(args, "--actor_learning_rate")) == trl["learning_rate"]
    assert float(_flag(args, "--eps_clip")) == trl["epsilon"]
    assert args[args.index("--adam_betas") + 1: args.index("--adam_betas") + 3] == ["0.9", "0.95"]
    assert (trl["adam_beta1"], trl["adam_beta2"]) == (0.9, 0.95)
    assert trl["bf16"] is False and trl["gradient_checkpointing"] is False and trl["use_cpu"] is True
    assert _flag(args, "--max_steps") == "12" and trl["max_steps"] == 12


def test_rlrun_args_parse_with_rlrun_cli(tmp_path):
    from rlrun.cli.parser import parse_args

    files = vs_trl.WorkFiles("M", "P", "R", 3_086_080)
    two_ranks = next(s for s in vs_trl.SYSTEMS if s.slug == "rlrun_2_ranks")
    parsed = parse_args(vs_trl.rlrun_args(vs_trl.Workload(), files, two_ranks, 12, tmp_path))
    assert parsed.ignored == ()  # every flag the benchmark passes acts
    cfg = parsed.config
    assert cfg.train.rollout_batch_size == 8 and cfg.train.micro_train_batch_size == 16
    assert cfg.algo.use_kl_loss and cfg.algo.kl_estimator == "k3" and cfg.algo.init_kl_coef == 0.04
    assert cfg.train.adam_betas == (0.9, 0.95) and cfg.train.lr_warmup_ratio == 0.0


def test_async_system_is_the_disaggregated_off_policy_layout(tmp_path):
    """The async row: one actor rank training the whole batch, one engine rank generating a step ahead."""
    from rlrun.cli.parser import parse_args

    system = next(s for s in vs_trl.SYSTEMS if s.slug == "rlrun_2_ranks_async")
    parsed = parse_args(vs_trl.rlrun_args(vs_trl.Workload(), vs_trl.WorkFiles("M", "P", "R", 1), system, 12, tmp_path))
    assert parsed.ignored == ()
    cfg = parsed.config
    assert cfg.train.async_train and cfg.resources.vllm_num_engines == 1 and cfg.resources.actor_num_gpus_per_node == 1
    assert cfg.train.micro_train_batch_size == 32  # the one actor rank trains on all 32 rollouts


def _write_jsonl(path: Path, rows: list[dict]) -> None:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def test_rlrun_metrics_medians_skip_warmup(tmp_path):
    rows = [{"step": s, "time/step": t, "time/generate": g, "time/score": 0.1, "time/train": t - g - 0.1,
             "time/sync": 0.0, "response_length": 64.0, "reward": 0.1, "actor/loss": 0.0}
            for s, t, g in [(1, 9.0, 5.0), (2, 4.0, 2.0), (3, 1.0, 0.5), (4, 3.0, 1.5), (5, 2.0, 1.0)]]
    _write_jsonl(tmp_path / "metrics.jsonl", rows)
    steps = vs_trl.rlrun_steps(tmp_path / "metrics.jsonl")
    assert [s["step"] for s in steps] == [1.0, 2.0, 3.0, 4.0, 5.0] and "actor/loss" not in steps[0]
    summary = vs_trl.summarize(steps)
    assert summary["steps_used"] == 3  # steps 3, 4, 5
    assert summary["time/step"] == 2.0  # median of 1, 3, 2
    assert summary["time/generate"] == 1.0  # median of 0.5, 1.5, 1.0
    assert summary["time/train"] == pytest.approx(0.9)  # median of 0.4, 1.4, 0.9
    assert summary["response_length"] == 64.0


def test_summarize_uses_all_steps_when_only_warmup_ran():
    steps = [{"step": 1.0, "time/step": 5.0}, {"step": 2.0, "time/step": 3.0}]
    summary = vs_trl.summarize(steps)
    assert summary["steps_used"] == 2 and summary["time/step"] == 4.0 and summary["time/score"] is None


def test_trl_steps_merge_logs(tmp_path):
    _write_jsonl(tmp_path / "steps.jsonl", [
        {"kind": "info", "optimizer": "AdamW"},
        {"kind": "step", "step": 1, "time/step": 2.0, "time/generate": 1.2, "time/score": 0.3, "time/train": 0.5,
         "time/sync": 0.0},
        {"kind": "log", "step": 1, "completions/mean_length": 55.5, "reward": 0.12, "loss": 0.0},
        {"kind": "step", "step": 2, "time/step": 1.0, "time/generate": 0.6, "time/score": 0.1, "time/train": 0.3,
         "time/sync": 0.0},
        {"kind": "log", "step": 2, "completions/mean_length": 64.0, "reward": 0.2},
        {"kind": "log", "step": 2, "train_runtime": 3.0},  # TRL's end-of-training record, same step
    ])
    steps = vs_trl.trl_steps(tmp_path / "steps.jsonl")
    assert len(steps) == 2
    assert steps[0] == {"step": 1.0, "time/step": 2.0, "time/generate": 1.2, "time/score": 0.3, "time/train": 0.5,
                        "time/sync": 0.0, "response_length": 55.5, "reward": 0.12}
    assert steps[1]["response_length"] == 64.0 and steps[1]["reward"] == 0.2


def test_aggregate_ratio_and_table():
    def run(system: str, per_step: float, rss: float) -> dict:
        return {"system": system, "peak_rss_tree_mib": rss, "peak_rss_proc_mib": rss / 2,
                "summary": {"time/step": per_step, "time/generate": per_step / 2, "time/score": 0.1,
                            "time/train": per_step / 2 - 0.1, "time/sync": 0.0, "response_length": 60.0}}

    runs = [run("TRL", 3.0, 800), run("rlrun 1 rank", 2.0, 700), run("TRL", 5.0, 900), run("rlrun 1 rank", 2.5, 650)]
    summary = vs_trl.aggregate(runs)
    assert summary["TRL"]["per_round_s_per_step"] == [3.0, 5.0]
    assert summary["TRL"]["median_s_per_step"] == 4.0 and summary["TRL"]["peak_rss_tree_mib"] == 900
    assert summary["rlrun 1 rank"]["median_s_per_step"] == 2.25
    assert summary["rlrun 1 rank"]["trl_over_this"] == pytest.approx(4.0 / 2.25)
    assert summary["TRL"]["phases_s"]["generate"] == 2.0  # median of 1.5 and 2.5
    table = vs_trl.format_table(summary)
    assert "rlrun 1 rank" in table and "1.78" in table and "rlrun 2 ranks" not in table


def test_skip_install_fails_fast_without_trl(tmp_path):
    with pytest.raises(SystemExit, match="--skip-install"):
        vs_trl.ensure_trl_venv(tmp_path / "no-venv", skip_install=True)


def test_run_measured_peak_rss_and_exit_code(tmp_path):
    code = "import time; block = bytearray(200 * 2**20); block[::4096] = b'x' * len(block[::4096]); time.sleep(0.8)"
    measured = vs_trl.run_measured([sys.executable, "-c", code], vs_trl.child_env({}), tmp_path / "log.txt", 60)
    assert measured.returncode == 0
    assert measured.peak_rss_proc_mib >= 200  # wait4's ru_maxrss of the child
    assert measured.peak_rss_tree_mib >= 200  # sampled while it slept


def test_run_measured_kills_after_timeout(tmp_path):
    measured = vs_trl.run_measured([sys.executable, "-c", "import time; time.sleep(60)"], vs_trl.child_env({}),
                                   tmp_path / "log.txt", 1.0)
    assert measured.returncode == -9 and measured.wall_s < 30
