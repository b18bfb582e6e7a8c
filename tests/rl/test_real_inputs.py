"""The peers' jobs on their own data files (issue 24), with a local tiny model in place of the hub model.

- verl's GSM8K GAE/GRPO job (job 4): verl's own key=value command line on a parquet in verl's gsm8k schema; no
  reward flag, so verl's default scorer for `openai/gsm8k` scores it (the last `#### N` against
  reward_model.ground_truth). The model was taught to answer `#### d` for a random digit d; the truth is 7, so
  the reward rises from ~0.1 as it learns. A custom compute_score (verl's custom_reward_function) then receives
  verl's arguments as verl passes them.
- OpenRLHF's Slurm PPO job's data (job 2): prompt-collection rows whose `context_messages` are chat messages
  (some with a system turn), `--input_key context_messages --apply_chat_template`: the demo task learns on them,
  with the dataset and the model named by hub id and read from a hub cache offline.
Search-R1's nq_search parquet runs in tests/compat/test_verl_overrides.py (test_search_r1_grpo_command_line_runs).
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
from helpers import run_rlrun, subprocess_env, teach_tiny_model
from peer_data import lay_out_hub_cache, write_openrlhf_prompt_collection, write_parquet, write_verl_gsm8k

from rlrun.models.tiny import BUILTIN_PROMPTS, build_byte_tokenizer, build_causal_lm, tiny_model_config

QUESTIONS = [(f"Tom has {i + 7} apples and eats {i} of them. How many are left?", "7") for i in range(16)]
# lr 2e-3: at 3e-3 some sample streams collapse to 2-token answers and never recover within 16 steps.
VERL_GRPO = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=8", "data.train_batch_size=4",
             "actor_rollout_ref.actor.ppo_mini_batch_size=4", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=8",
             "data.max_prompt_length=256", "data.max_response_length=8", "actor_rollout_ref.actor.optim.lr=2e-3",
             "actor_rollout_ref.actor.use_kl_loss=false", "algorithm.use_kl_in_reward=false", "trainer.total_epochs=20",
             "trainer.logger=[console]"]


@pytest.fixture(scope="module")
def gsm8k(tmp_path_factory) -> dict[str, Path]:
    where = tmp_path_factory.mktemp("gsm8k")
    data = write_verl_gsm8k(where / "train.parquet", QUESTIONS)
    tok = build_byte_tokenizer()
    prompts = [tok.apply_chat_template([{"role": "user", "content": q + " " + 'Let\'s think step by step and output '
                                         'the final answer after "####".'}], tokenize=False, add_generation_prompt=True)
               for q, _ in QUESTIONS[:4]]
    # Ten answers for the same prompt teach a uniform digit: loss ln(10)/7 per token, no lower.
    teach_tiny_model(where / "model", [[(p, False), (f"#### {d}", True)] for p in prompts for d in range(10)],
                     steps=20, max_loss=0.4)
    return {"data": data, "model": where / "model"}


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_verl_gsm8k_job_learns_with_verls_default_scorer_and_a_custom_compute_score(gsm8k, tmp_path):
    base = [f"data.train_files={gsm8k['data']}", f"actor_rollout_ref.model.path={gsm8k['model']}", *VERL_GRPO]
    run = run_rlrun(0, base + ["trainer.total_training_steps=16"], tmp_path / "builtin")
    assert run.returncode == 0, run.output[-3000:]
    rewards = [m["reward"] for m in run.metrics]
    assert len(rewards) == 16
    first, last = sum(rewards[:2]) / 2, sum(rewards[-4:]) / 4
    assert first < 0.25 and last > first + 0.1, rewards  # #### 7 is learned (0.16 -> 0.8 when written)

    scorer = tmp_path / "my_score.py"
    scorer.write_text(textwrap.dedent('''
        import json
        seen = []
        def my_score(data_source, solution_str, ground_truth, extra_info=None):
            # verl's NaiveRewardManager passes these by keyword: the response alone, the label object, extra_info.
            assert data_source == "openai/gsm8k" and ground_truth == "7", (data_source, ground_truth)
            assert isinstance(extra_info, dict) and isinstance(extra_info["index"], int), extra_info
            assert extra_info["question"].startswith("Tom has") and not solution_str.startswith("User:")
            hit = solution_str.strip().endswith("7")
            return {"score": float(hit), "acc": float(hit), "length": float(len(solution_str))}
    '''))
    custom = run_rlrun(0, base + ["trainer.total_training_steps=2", f"custom_reward_function.path={scorer}",
                                  "custom_reward_function.name=my_score"], tmp_path / "custom")
    assert custom.returncode == 0, custom.output[-3000:]
    assert [m["step"] for m in custom.metrics] == [1, 2]
    assert {"reward/acc", "reward/length"} <= custom.metrics[0].keys()
    assert custom.metrics[0]["reward/acc"] == pytest.approx(custom.metrics[0]["reward"])


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_openrlhf_chat_message_prompts_learn_with_model_and_data_named_by_hub_id(tmp_path):
    """OpenRLHF's Slurm job names both by hub id; here they come from a hub cache laid out as `hf download` leaves
    it, with HF_HUB_OFFLINE=1. The model is the embedded demo model's exact weights (seed 42), saved."""
    cache, files, model = tmp_path / "hub", tmp_path / "files", tmp_path / "model"
    rows = write_openrlhf_prompt_collection(tmp_path / "rows.jsonl", BUILTIN_PROMPTS, system="Answer briefly.")
    (files / "data").mkdir(parents=True)
    write_parquet(files / "data" / "train-00000-of-00001.parquet", [json.loads(r) for r in rows.read_text().splitlines()])
    lay_out_hub_cache(cache, "OpenRLHF/prompt-collection-v0.1", files, repo_type="dataset")
    build_causal_lm(tiny_model_config(), seed=42).save_pretrained(model)
    build_byte_tokenizer().save_pretrained(model)
    lay_out_hub_cache(cache, "tiny-org/demo-policy", model)
    run = run_rlrun(2, ["--config", "configs/demo.yaml", "--pretrain", "tiny-org/demo-policy",
                        "--prompt_data", "OpenRLHF/prompt-collection-v0.1", "--input_key", "context_messages",
                        "--apply_chat_template", "--label_key", "label", "--remote_rm_url", "demo", "--max_steps", "16",
                        "--rollout_batch_size", "8", "--train_batch_size", "16", "--micro_rollout_batch_size", "8",
                        "--micro_train_batch_size", "8"], tmp_path / "out", env=subprocess_env(HF_HUB_CACHE=str(cache)))
    assert run.returncode == 0, run.output[-3000:]
    rewards = [m["reward"] for m in run.metrics]
    assert len(rewards) == 16 and sum(rewards[-3:]) / 3 > rewards[0] + 0.1, rewards
    assert f"{len(BUILTIN_PROMPTS)} prompts" in run.output
    assert json.loads((tmp_path / "out" / "config.json").read_text())["architectures"] == ["Qwen2ForCausalLM"]
    # The system turn (rendered by the tokenizer's template as its own line) is in every second prompt.
    assert json.loads(rows.read_text().splitlines()[0])["context_messages"][0]["role"] == "system"


@pytest.mark.timeout(600)
def test_verl_gsm8k_and_math_as_released_dry_run_and_train(real_data, qwen_vocab_model, tmp_path):
    """verl's GSM8K and MATH parquet (made from the released datasets as verl's scripts make them) in one verl
    command line, with Qwen's real tokenizer and vocabulary (a tiny random model over it): --dry_run reads and
    renders all 14,973 training prompts and cuts 1,500 of them at 128 real tokens; two packed GRPO steps then score
    both data sources' responses with the built-in rules (a random model answers nothing right: reward 0, but an
    unscorable data source would stop the run), and responses end at `<|im_end|>` long before the cap."""
    files = f"[{real_data['verl_gsm8k']}/train.parquet,{real_data['verl_math']}/train.parquet]"
    job = [f"data.train_files={files}", f"actor_rollout_ref.model.path={qwen_vocab_model}",
           "algorithm.adv_estimator=grpo", "actor_rollout_ref.rollout.n=2", "data.train_batch_size=4",
           "actor_rollout_ref.actor.ppo_mini_batch_size=4", "data.max_prompt_length=128",
           "data.max_response_length=16", "trainer.total_training_steps=2", "trainer.logger=[console]"]
    dry = run_rlrun(0, [*job, "--dry_run"], tmp_path / "dry")
    assert dry.returncode == 0, dry.output[-3000:]
    assert "14973 prompts (1500 truncated, 0 dropped at --prompt_max_len 128)" in dry.output
    assert "vocab 151936" in dry.output and "its label: '72'" in dry.output
    run = run_rlrun(0, [*job, "--packing_samples"], tmp_path / "run")
    assert run.returncode == 0, run.output[-3000:]
    assert [m["step"] for m in run.metrics] == [1, 2]
    assert all(m["reward"] == 0.0 for m in run.metrics)
    assert all(m["response_length"] < 16 for m in run.metrics)
    assert "chosen per prompt by its data source (--compute_score builtin)" in run.output
