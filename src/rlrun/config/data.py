"""The data sections: how a record's prompt becomes model input (every trainer: `TemplateConfig`) and rlrun.ppo's
prompt data (`DataConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from rlrun.config.fields import opt
from rlrun.runtime.errors import ConfigError


@dataclass
class TemplateConfig:
    """How a record's prompt text becomes model input (every trainer)."""

    input_template: str | None = opt(None, "Template with {} for the prompt.")
    apply_chat_template: bool = opt(False, "Wrap prompts with the tokenizer's chat template.")

    def check(self) -> None:
        if self.input_template is not None and "{}" not in self.input_template:
            raise ConfigError(
                f"--input_template must contain '{{}}' where the prompt goes, got {self.input_template!r}"
            )


@dataclass
class DataConfig:
    """Prompt data."""

    prompt_data: str | None = opt(
        None,
        "Prompt sources, comma-separated (OpenRLHF's blending): each a "
        ".jsonl/.json/.parquet/.csv "
        "file, a directory (save_to_disk, or data files), or a Hugging Face Hub dataset id, "
        "optionally SOURCE@DATA_DIR. Unset: built-in prompts.",
    )
    prompt_data_probs: str | None = opt(
        None,
        "Comma-separated sampling weights, one per --prompt_data source: "
        "interleave "
        "them (datasets' interleave_datasets, seeded by --seed, until every source is "
        "exhausted) instead of concatenating.",
    )
    prompt_split: str = opt(
        "train", "Split of each --prompt_data source (a DatasetDict's split, or data files named after it)."
    )
    input_key: str = opt(
        "input",
        "Field holding the prompt: a string, or a list of {role, content} chat messages "
        "(also as JSON text), which is always rendered with the tokenizer's chat template.",
    )
    label_key: str | None = opt(
        None,
        "Field holding the label passed to the reward, as the value it is (a dotted "
        "path reaches nested fields: reward_model.ground_truth).",
    )
    data_source_key: str = opt(
        "data_source",
        "Field naming each prompt's data source (verl's data.reward_fn_key): it "
        "picks the built-in rule scorer and reaches compute_score.",
    )
    apply_chat_template_kwargs: dict[str, Any] = opt(
        {},
        "Extra arguments for the tokenizer's chat template as JSON, "
        "e.g. '{\"enable_thinking\": false}' (verl's "
        "data.apply_chat_template_kwargs).",
    )

    def check(self) -> None:
        """Nothing to check alone: the records are read (and refused, naming them) at start-up."""
