"""Runs TRL's GRPOTrainer for bench/vs_trl.py, inside the TRL venv (it never imports rlrun).

    bench/.venv-trl/bin/python bench/vs_trl_runner.py SPEC.json

SPEC.json (written by vs_trl.py): model_dir, prompts_file, reward_file, steps_file, threads and
grpo_config (GRPOConfig keyword arguments). Per optimizer step it appends one JSON line to
steps_file: {"kind": "step", "step", "time/step", "time/generate", "time/score", "time/train",
"time/sync"}; each of TRL's log records is appended as {"kind": "log", ...}.

Phases, timed by wrapping three GRPOTrainer methods on the instance (same split as rlrun's metrics):
  generate  _generate (tokenize, model.generate, decode) + _calculate_rewards (rlrun also runs a
            reward function inside its generate phase)
  score     the rest of _generate_and_score_completions (reference log-probs, advantages)
  train     the rest of the step: loss forward/backward, gradient clipping, optimizer step
  sync      0 (no vLLM: the policy generates in place)
A step is on_step_begin -> on_step_end, which, like rlrun's time/step, leaves out logging.
"""

from __future__ import annotations

import importlib.util
import json
import sys
import time
from pathlib import Path
from typing import Any, Callable


def load_reward(path: str) -> Callable[..., list[float]]:
    spec = importlib.util.spec_from_file_location("vs_trl_reward", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.trl_reward


class PhaseClock:
    """Seconds spent inside wrapped methods since the last reset."""

    def __init__(self) -> None:
        self.totals: dict[str, float] = {}

    def wrap(self, owner: Any, method: str, key: str) -> None:
        original = getattr(owner, method)

        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return original(*args, **kwargs)
            finally:
                self.totals[key] = self.totals.get(key, 0.0) + time.perf_counter() - start

        setattr(owner, method, timed)

    def take(self) -> dict[str, float]:
        totals, self.totals = self.totals, {}
        return totals


def main(spec_path: str) -> None:
    spec = json.loads(Path(spec_path).read_text())
    import torch

    torch.set_num_threads(int(spec["threads"]))
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    records = [json.loads(line) for line in Path(spec["prompts_file"]).read_text().splitlines() if line.strip()]
    dataset = Dataset.from_list([{"prompt": r["prompt"]} for r in records])
    tokenizer = AutoTokenizer.from_pretrained(spec["model_dir"])
    tokenizer.padding_side = "left"
    steps_file = Path(spec["steps_file"])
    steps_file.write_text("")
    clock = PhaseClock()

    def append(record: dict[str, Any]) -> None:
        with steps_file.open("a") as f:
            f.write(json.dumps(record) + "\n")

    class StepTimes(TrainerCallback):
        def __init__(self) -> None:
            self.start = 0.0

        def on_train_begin(self, args, state, control, optimizer=None, **kwargs):  # noqa: ANN001 - transformers' signature
            inner = getattr(optimizer, "optimizer", optimizer)  # accelerate wraps it
            defaults = getattr(inner, "defaults", {})
            append({"kind": "info", "optimizer": type(inner).__name__, "torch_threads": torch.get_num_threads(),
                    "optimizer_defaults": {k: v for k, v in defaults.items()
                                           if v is None or isinstance(v, (int, float, bool, str))}})

        def on_step_begin(self, args, state, control, **kwargs):  # noqa: ANN001
            clock.take()
            self.start = time.perf_counter()

        def on_step_end(self, args, state, control, **kwargs):  # noqa: ANN001
            total = time.perf_counter() - self.start
            t = clock.take()
            generate = t.get("generate", 0.0) + t.get("reward", 0.0)
            rollout = t.get("rollout", 0.0)
            append({"kind": "step", "step": state.global_step, "time/step": total, "time/generate": generate,
                    "time/score": max(rollout - generate, 0.0), "time/train": max(total - rollout, 0.0),
                    "time/sync": 0.0})

        def on_log(self, args, state, control, logs=None, **kwargs):  # noqa: ANN001
            append({"kind": "log", "step": state.global_step, **{k: v for k, v in (logs or {}).items()
                                                                 if isinstance(v, (int, float))}})

    trainer = GRPOTrainer(
        model=spec["model_dir"],
        reward_funcs=load_reward(spec["reward_file"]),
        args=GRPOConfig(**spec["grpo_config"]),
        train_dataset=dataset,
        processing_class=tokenizer,
        callbacks=[StepTimes()],
    )
    clock.wrap(trainer, "_generate", "generate")
    clock.wrap(trainer, "_calculate_rewards", "reward")
    clock.wrap(trainer, "_generate_and_score_completions", "rollout")
    trainer.train()


if __name__ == "__main__":
    main(sys.argv[1])
