"""Two tinker-cookbook loops, run unmodified against the rlrun.tinker server at TINKER_BASE_URL (the cookbook's process:
tests/tinker/test_tinker_cookbook.py starts it with the cookbook on its path).

    python cookbook_loops.py MODEL_NAME CONVERSATIONS.jsonl LOG_DIR

- supervised: `tinker_cookbook.supervised.train.main` over CONVERSATIONS (the cookbook's FromConversationFileBuilder,
  the model's recommended renderer), one batch per epoch for 4 epochs, so every step sees the same data;
- RL: `tinker_cookbook.recipes.multiplayer_rl.guess_number.train.build_config` (its CLI's defaults but the sizes:
  batch 1, group 2, max_tokens 8, 2 steps, no evaluation) through `tinker_cookbook.rl.train.main` (sync,
  importance_sampling: the recipe's).

Offline, one stand-in: the cookbook's pricing lookup (a file it fetches from the internet) answers None, as it does
when that fetch fails. The tokenizer comes from the hub cache the test lays out (HF_HUB_OFFLINE=1)."""

from __future__ import annotations

import asyncio
import sys
from pathlib import Path

import tinker_cookbook.utils.cost_estimation as cost_estimation
from tinker_cookbook import model_info
from tinker_cookbook.recipes.multiplayer_rl.guess_number import train as guess_number
from tinker_cookbook.renderers import TrainOnWhat
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import FromConversationFileBuilder
from tinker_cookbook.supervised.types import ChatDatasetBuilderCommonConfig

cost_estimation.load_model_pricing = lambda *args, **kwargs: None  # no internet here


def supervised(model: str, conversations: Path, log: Path) -> None:
    renderer = model_info.get_recommended_renderer_name(model)
    common = ChatDatasetBuilderCommonConfig(
        model_name_for_tokenizer=model,
        renderer_name=renderer,
        max_length=512,
        batch_size=4,
        train_on_what=TrainOnWhat.ALL_ASSISTANT_MESSAGES,
    )
    config = sl_train.Config(
        log_path=str(log),
        model_name=model,
        recipe_name="sl_basic",
        renderer_name=renderer,
        dataset_builder=FromConversationFileBuilder(common_config=common, file_path=str(conversations)),
        learning_rate=1e-3,
        lr_schedule="constant",
        num_epochs=4,
    )
    asyncio.run(sl_train.main(config))


def reinforcement(model: str, log: Path) -> None:
    cli = guess_number.CLIConfig(
        model_name=model,
        renderer_name=None,  # the model's recommended one
        group_size=2,
        batch_size=1,
        max_tokens=8,
        eval_every=0,
        log_path=str(log),
        max_steps=2,
    )
    asyncio.run(rl_train.main(guess_number.build_config(cli)))


if __name__ == "__main__":
    name, conversations, logs = sys.argv[1], Path(sys.argv[2]), Path(sys.argv[3])
    supervised(name, conversations, logs / "supervised")
    reinforcement(name, logs / "guess_number")
    print("cookbook loops done", flush=True)
