"""rlrun.tinker through the real tinker SDK vs rlrun's own paths (issue 65's targets: >= 0.8x tokens/s each).

    .venv/bin/python bench/tinker_api.py                     # 1 rank, 6 steps, 64 x 128-token samples
    .venv/bin/python bench/tinker_api.py --json bench/results/tinker_api.json

Same model (the "3m" preset Qwen2 over the byte tokenizer, saved as a Hugging Face folder), same data, same ranks:
  * training: `python -m rlrun.sft` on the samples (--train_batch_size 16, micro-batches of 8) vs a client sending
    the same 16 samples per step as forward_backward (cross_entropy on the response tokens) + optim_step to
    `python -m rlrun.tinker`; tokens/s = trained tokens / median step time (the first step left out: warm-up);
  * sampling: 64 prompts x 64 new tokens, one `engine.sample` call on a native engine in a process of its own vs 64
    concurrent SDK sample requests, awaited together as the cookbook's loops do (the server runs requests with equal
    settings as one engine call).
Reported: each side's median, and the ratios (SDK / rlrun's own).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

import torch

from rlrun.engines.native.engine import NativeEngine
from rlrun.engines.protocol import SamplingSettings
from rlrun.models.tiny import PAD_ID, build_byte_tokenizer, build_causal_lm, tiny_model_config_for_size

REPO = Path(__file__).resolve().parents[1]
ENV = {**os.environ, "OMP_NUM_THREADS": "2", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1",
       "PYTHONPATH": str(REPO / "src")}


def model_dir(root: Path) -> Path:
    path = root / "model"
    build_causal_lm(tiny_model_config_for_size("3m"), seed=0).save_pretrained(path)
    build_byte_tokenizer().save_pretrained(path)
    return path


def samples(n: int, length: int) -> list[tuple[str, str]]:
    """(prompt, response) texts of `length` bytes in all (the byte tokenizer: one token per byte)."""
    out = []
    for i in range(n):
        prompt = f"Q{i:03d}: " + "abcdefghij"[i % 10] * 10
        response = ("x" * (length - len(prompt) - 1))[: length - len(prompt) - 1]
        out.append((prompt, response))
    return out


def sft_tokens_per_s(model: Path, data: list[tuple[str, str]], steps: int, root: Path) -> float:
    path = root / "sft.jsonl"
    path.write_text("".join(json.dumps({"prompt": p, "response": r}) + "\n" for p, r in data))
    save = root / "sft_save"
    cmd = [sys.executable, "-m", "rlrun.sft", "--pretrain", str(model), "--dataset", str(path), "--input_key",
           "prompt", "--output_key", "response", "--input_template", "{}", "--train_batch_size", "16",
           "--micro_train_batch_size", "8", "--max_steps", str(steps), "--max_len", "256", "--learning_rate", "1e-4",
           "--save_path", str(save), "--lr_warmup_ratio", "0"]
    subprocess.run(cmd, check=True, env=ENV, cwd=REPO, capture_output=True)
    times = [json.loads(line)["time/step"] for line in (save / "metrics.jsonl").read_text().splitlines()][1:]
    tokens = sum(len(r) + 1 for _, r in data[:16])  # response tokens and EOS trained per step
    return tokens / statistics.median(times)


def serve(model: Path, root: Path, port: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rlrun.tinker", "--pretrain", str(model), "--tinker_port", str(port),
           "--micro_train_batch_size", "8", "--ckpt_path", str(root / "ckpt"), "--save_path", str(root / "tk_save")]
    proc = subprocess.Popen(cmd, env=ENV, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    for _ in range(600):
        try:
            urllib.request.urlopen(f"http://127.0.0.1:{port}/api/v1/healthz", timeout=1)
            return proc
        except OSError:
            time.sleep(0.2)
    raise RuntimeError("rlrun.tinker did not come up")


def sdk_runs(model: Path, data: list[tuple[str, str]], steps: int, prompts: list[list[int]], new: int, root: Path,
             rounds: int) -> tuple[float, list[float]]:
    import tinker
    from tinker import types

    tok = build_byte_tokenizer()
    port = 18700
    proc = serve(model, root, port)
    try:
        os.environ["TINKER_API_KEY"] = "tml-bench"
        service = tinker.ServiceClient(base_url=f"http://127.0.0.1:{port}")
        training = service.create_lora_training_client(base_model=str(model), rank=0).result()
        batch = []
        for p, r in data[:16]:
            ids = tok(p, add_special_tokens=False)["input_ids"]
            full = ids + tok(r, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
            weights = [0.0] * (len(ids) - 1) + [1.0] * (len(full) - len(ids))
            batch.append(types.Datum(model_input=types.ModelInput.from_ints(full[:-1]),
                                     loss_fn_inputs={"target_tokens": full[1:], "weights": weights}))
        tokens = sum(sum(d.loss_fn_inputs["weights"].tolist()) for d in batch)
        times = []
        for _ in range(steps):
            t0 = time.perf_counter()
            training.forward_backward(batch, "cross_entropy").result()
            training.optim_step(types.AdamParams(learning_rate=1e-4)).result()
            times.append(time.perf_counter() - t0)
        train_rate = tokens / statistics.median(times[1:])
        sampler = training.save_weights_and_get_sampling_client().result()
        params = types.SamplingParams(max_tokens=new, temperature=1.0, seed=1, stop=[])
        async def wave() -> int:  # as the cookbook's loops sample: one awaited request per prompt, all at once
            outs = await asyncio.gather(*[sampler.sample(types.ModelInput.from_ints(p), 1, params) for p in prompts])
            return sum(len(o.sequences[0].tokens) for o in outs)

        rates = []
        for _ in range(rounds):
            t0 = time.perf_counter()
            got = asyncio.run(wave())
            rates.append(got / (time.perf_counter() - t0))
        return train_rate, rates
    finally:
        proc.terminate()
        proc.wait(60)


def engine_rates(model: Path, prompts: list[list[int]], new: int, rounds: int) -> list[float]:
    """The engine's own tokens/s, in a process of its own started with the server's environment (OMP_NUM_THREADS
    set before torch starts, as the server has it); no stop tokens (the SDK side's stop=[]): every row its max_tokens."""
    spec = json.dumps({"model": str(model), "prompts": prompts, "new": new, "rounds": rounds})
    out = subprocess.run([sys.executable, __file__, "--engine_only", spec], check=True, env=ENV, cwd=REPO,
                         capture_output=True, text=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def engine_only(model: Path, prompts: list[list[int]], new: int, rounds: int) -> list[float]:
    from transformers import AutoModelForCausalLM

    settings = SamplingSettings(1.0, 1.0, new, PAD_ID, ())
    engine = NativeEngine(AutoModelForCausalLM.from_pretrained(model).eval(), settings, torch.device("cpu"),
                          build_byte_tokenizer())
    rates = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        out = engine.sample(prompts, 1, max_new_tokens=new, keys=list(range(len(prompts))))
        rates.append(sum(len(r) for r in out.responses) / (time.perf_counter() - t0))
    return rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--json", default=None)
    parser.add_argument("--engine_only", default=None, help=argparse.SUPPRESS)  # engine_rates' child
    args = parser.parse_args()
    if args.engine_only:
        spec = json.loads(args.engine_only)
        print(json.dumps(engine_only(Path(spec["model"]), spec["prompts"], spec["new"], spec["rounds"])))
        return
    with tempfile.TemporaryDirectory(prefix="tinker_bench") as tmp:
        root = Path(tmp)
        model = model_dir(root)
        data = samples(64, 128)
        prompts = [list(range(40 + i % 20, 56 + i % 20)) for i in range(64)]
        sft = sft_tokens_per_s(model, data, args.steps, root)
        sdk_train, sdk_sample = sdk_runs(model, data, args.steps, prompts, 64, root, args.rounds)
        own_sample = engine_rates(model, prompts, 64, args.rounds)
    result = {
        "train_tokens_per_s": {"rlrun.sft": round(sft), "sdk": round(sdk_train), "ratio": round(sdk_train / sft, 3)},
        "sample_tokens_per_s": {
            "engine": round(statistics.median(own_sample)),
            "sdk": round(statistics.median(sdk_sample)),
            "ratio": round(statistics.median(sdk_sample) / statistics.median(own_sample), 3),
        },
    }
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
