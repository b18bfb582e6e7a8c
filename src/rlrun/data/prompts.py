"""Prompt data: loading records, formatting prompts, deterministic order, tokenization."""

from __future__ import annotations

import dataclasses
import hashlib
import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from rlrun.config.data import DataConfig, TemplateConfig
from rlrun.config.evaluation import EvalConfig
from rlrun.config.generation import GenerationConfig
from rlrun.config.vision import VisionConfig
from rlrun.data import sources as records
from rlrun.data.images import images_of
from rlrun.data.sources import DataSpec, Messages, read_sources
from rlrun.data.vision_batch import PromptVision, RowVision
from rlrun.runtime.errors import DataError


@dataclass(frozen=True)
class PromptRecord:
    """One prompt as its dataset holds it: text or a chat (rendered later, with the tokenizer), and what the
    reward receives about it."""

    prompt: str | Messages
    label: Any = None  # plain Python (a str, a number, {"target": [...]}, ...); None without --label_key
    data_source: str | None = None  # verl's reward_fn_key field: picks the rule scorer
    extra_info: dict[str, Any] | None = None  # verl's extra_info column, for compute_score
    images: tuple[Any, ...] = ()  # the prompt's images in order (rlrun.data.images), loaded where it is generated
    base_dir: str | None = None  # the data file's folder: relative image paths are also looked for there
    columns: Mapping[str, Any] | None = None  # the record's columns but its images (PromptKeys.columns)


@dataclass(frozen=True)
class PromptKeys:
    """Where a record keeps what a prompt needs (OpenRLHF's --input_key/--label_key, verl's data.prompt_key,
    data.reward_fn_key); dotted paths reach nested fields."""

    input_key: str = "prompt"
    label_key: str | None = None
    data_source_key: str = "data_source"
    extra_info_key: str = "extra_info"
    image_key: str = "images"  # verl's data.image_key: images placed at the prompt's <image> placeholders
    columns: bool = False  # keep every column of the record (a TRL environment's reset(**row) reads them)


def _to_record(row: Any, index: int, path: str, keys: PromptKeys) -> PromptRecord:
    at = records.where(path, index)
    if not isinstance(row, Mapping):
        raise DataError(
            f"{at} is a {type(row).__name__} ({str(row)[:80]!r}); each record must be an object with an "
            f"{keys.input_key!r} key."
        )
    value = records.parsed_messages(records.plain(records.field(row, keys.input_key, "input_key", at)))
    if isinstance(value, list) and value and records.looks_like_messages(value):
        prompt: str | Messages = records.messages(value, keys.input_key, at, text_role=None)
    elif isinstance(value, str):
        prompt = value
    else:
        raise DataError(
            f"{at} has {keys.input_key!r} = {records.shown(value)}; a prompt must be a string or a list "
            'of {"role": ..., "content": ...} chat messages.'
        )
    column = records.lookup(row, keys.image_key)
    prompt, images = images_of(
        prompt, None if column is records.MISSING or column is None else column, at, keys.image_key
    )
    label = None if keys.label_key is None else records.plain(records.field(row, keys.label_key, "label_key", at))
    if keys.label_key is not None and label is None:  # JSON null, a parquet null: scored against None, silently
        raise DataError(
            f"{at} has label_key {keys.label_key!r} = null; every record needs its label (a reward scored against "
            "a missing label is 0 without a word): fill it in, drop the record, or leave --label_key unset if the "
            "reward reads no label."
        )
    source = records.lookup(row, keys.data_source_key)
    extra = records.plain(records.lookup(row, keys.extra_info_key))
    return PromptRecord(
        prompt,
        label,
        source if isinstance(source, str) else None,
        extra if isinstance(extra, dict) else None,
        images,
        _folder(path) if images else None,
        {k: records.plain(v) for k, v in row.items() if k != keys.image_key} if keys.columns else None,
    )


def _folder(source: str) -> str | None:
    """The folder of a single data file or directory source (relative image paths are looked for there too)."""
    if os.path.isfile(source):
        return os.path.dirname(os.path.abspath(source))
    return os.path.abspath(source) if os.path.isdir(source) else None


def load_prompt_records(
    spec: DataSpec | str | None, keys: PromptKeys = PromptKeys(), max_samples: int | None = None
) -> list[PromptRecord]:
    """Prompt records from `spec`'s sources (rlrun.data.sources: files, directories, hub ids, blended).

    spec=None gives rlrun.models.tiny.BUILTIN_PROMPTS, always read with keys "prompt" and "label".
    max_samples keeps the first N records (of each source, and of the blend, as OpenRLHF does).
    """
    if max_samples is not None and max_samples < 1:
        raise DataError(f"max_samples={max_samples} keeps no prompts; pass a positive number or None for all.")
    if isinstance(spec, str):
        spec = DataSpec(spec)
    if spec is None:
        from rlrun.models.tiny import BUILTIN_PROMPTS  # noqa: PLC0415 - tiny imports transformers; file loading never does

        source, rows = "<built-in prompts>", list(BUILTIN_PROMPTS)
        keys = PromptKeys("prompt", "label", columns=keys.columns)
    else:
        source, rows = spec.sources, read_sources(dataclasses.replace(spec, max_count=max_samples))
    if not rows:
        raise DataError(f"Prompt data {source!r} is empty; it needs at least one record with key {keys.input_key!r}.")
    rows = rows[:max_samples]
    return [_to_record(row, index, source, keys) for index, row in enumerate(rows)]


def format_prompt(
    prompt: str | Messages,
    tokenizer: Any,
    input_template: str | None,
    apply_chat_template: bool,
    template_kwargs: Mapping[str, Any] | None = None,
    where: str = "prompt",
) -> str:
    """The text the policy continues, as OpenRLHF's PromptDataset and verl's RLHFDataset build it: a chat (a message
    list, always; a string with --apply_chat_template, as one user turn) through the tokenizer's chat template
    with the generation prompt; otherwise the string through --input_template (`{}` is the prompt) or as it is."""
    if isinstance(prompt, list) or apply_chat_template:
        if not getattr(tokenizer, "chat_template", None):
            raise DataError(
                f"{where} is a chat (a message list, or --apply_chat_template) but the tokenizer has no "
                "chat_template; use a model whose tokenizer has one, or pass plain-text prompts without "
                "--apply_chat_template (--input_template formats them)"
            )
        chat = prompt if isinstance(prompt, list) else [{"role": "user", "content": prompt}]
        return records.render(tokenizer, chat, True, where, template_kwargs)
    if input_template is None:
        return prompt
    if "{}" not in input_template:
        raise DataError(
            f"input_template {input_template!r} has no '{{}}' placeholder for the prompt; add one, e.g. 'Q: {{}}\\nA:'."
        )
    try:
        return input_template.format(prompt)
    except (IndexError, KeyError, ValueError) as exc:
        raise DataError(
            f"input_template {input_template!r} cannot be formatted ({exc!r}); "
            "escape literal braces as '{{' and '}}'."
        ) from exc


class PromptSampler:
    """Deterministic prompt order: step -> record indices is a pure function, so resume needs only the step."""

    def __init__(self, num_records: int, rollout_batch_size: int, seed: int, num_episodes: int) -> None:
        if rollout_batch_size < 1 or num_episodes < 1:
            raise DataError(
                f"rollout_batch_size={rollout_batch_size} and num_episodes={num_episodes} must both be >= 1."
            )
        if num_records < rollout_batch_size:
            raise DataError(
                f"Only {num_records} prompt records for rollout_batch_size={rollout_batch_size}; "
                "add prompts or lower rollout_batch_size so one full batch fits."
            )
        self.num_records = num_records
        self.rollout_batch_size = rollout_batch_size
        self.seed = seed
        self.num_episodes = num_episodes
        # The last partial batch is dropped so every step sees rollout_batch_size prompts.
        self.steps_per_episode = num_records // rollout_batch_size
        self.total_steps = self.steps_per_episode * num_episodes
        self._cached: tuple[int, list[int]] | None = None

    def _episode_seed(self, episode: int) -> int:
        # Hashing (seed, episode) keeps nearby seeds from sharing permutations (seed+1 vs episode+1).
        digest = hashlib.sha256(f"rlrun-prompts:{self.seed}:{episode}".encode()).digest()
        return int.from_bytes(digest[:8], "little") & ((1 << 63) - 1)

    def permutation(self, episode: int) -> list[int]:
        """The record order of one episode; depends only on (seed, episode)."""
        if self._cached is None or self._cached[0] != episode:
            generator = torch.Generator().manual_seed(self._episode_seed(episode))
            self._cached = (episode, torch.randperm(self.num_records, generator=generator).tolist())
        return self._cached[1]

    def _check_step(self, step: int) -> None:
        if not 0 <= step < self.total_steps:
            raise DataError(
                f"step={step} is outside [0, {self.total_steps}) "
                f"({self.num_episodes} episodes x {self.steps_per_episode} steps); resume from a step of this run."
            )

    def episode_of(self, step: int) -> int:
        self._check_step(step)
        return step // self.steps_per_episode

    def indices(self, step: int) -> list[int]:
        """Record indices of global step `step` (0-based)."""
        episode = self.episode_of(step)
        start = (step % self.steps_per_episode) * self.rollout_batch_size
        return self.permutation(episode)[start : start + self.rollout_batch_size]


def tokenize_prompts(texts: list[str], tokenizer: Any, prompt_max_len: int) -> tuple[list[list[int]], int]:
    """Token ids without special tokens, and how many prompts were longer than prompt_max_len.

    Long prompts keep their LAST prompt_max_len tokens: the end holds the generation prompt
    (e.g. "Assistant: ") that the response must follow.
    """
    if prompt_max_len < 1:
        raise DataError(f"prompt_max_len={prompt_max_len} must be >= 1.")
    if not texts:
        return [], 0
    encoded: list[list[int]] = tokenizer(texts, add_special_tokens=False)["input_ids"]
    truncated = 0
    result: list[list[int]] = []
    for index, ids in enumerate(encoded):
        if not ids:
            raise DataError(
                f"Prompt {index} ({texts[index][:80]!r}) tokenizes to no tokens; generation needs a non-empty prompt."
            )
        if len(ids) > prompt_max_len:
            truncated += 1
            ids = ids[-prompt_max_len:]
        result.append(list(ids))
    return result, truncated


@dataclass(frozen=True)
class PromptMeta:
    """What a reward source knows of the prompts of a batch besides their text (index i is sample i)."""

    labels: list[Any]
    data_sources: list[str | None]
    extra_infos: list[dict[str, Any] | None]


class ImagePreparer(Protocol):
    """A vision-language policy's image preprocessing (rlrun.vision.inputs.ImageInputs)."""

    processor: Any

    def prepare(
        self, ids: list[int], images: tuple[Any, ...], where: str, base_dir: str | None = None
    ) -> tuple[list[int], PromptVision]: ...


@dataclass
class Prompts:
    """The prompt set after formatting and tokenising; index i is record i."""

    texts: list[str]
    ids: list[list[int]]
    records: list[PromptRecord]  # the label, data source and extra info each reward source may read
    truncated: int
    dropped: int
    images: ImagePreparer | None = None  # a vision-language policy's image preprocessing (used where it generates)

    @property
    def labels(self) -> list[Any]:
        return [r.label for r in self.records]

    @property
    def image_processor(self) -> Any:
        """A vision-language policy's image processor (saved beside its HF exports), None for a text policy."""
        return None if self.images is None else self.images.processor

    def meta(self, indices: list[int]) -> PromptMeta:
        rows = [self.records[i] for i in indices]
        return PromptMeta([r.label for r in rows], [r.data_source for r in rows], [r.extra_info for r in rows])

    def with_images(self, indices: list[int], prompt_max_len: int) -> tuple[list[list[int]], RowVision]:
        """A vision-language policy's rows of records `indices`: prompt ids with each image token expanded by the
        image processor, and the rows' images (each record's read once, however many rows it has)."""
        assert self.images is not None
        done: dict[int, tuple[list[int], PromptVision]] = {}
        for i in indices:
            if i not in done:
                record, where = self.records[i], f"prompt record {i}"
                done[i] = self.images.prepare(self.ids[i], record.images, where, record.base_dir)
                if len(done[i][0]) > prompt_max_len:
                    raise DataError(
                        f"{where} has {len(done[i][0])} tokens with its images' tokens, more than "
                        f"--prompt_max_len {prompt_max_len} (images are never cut); raise --prompt_max_len "
                        "or lower --max_pixels"
                    )
        return [done[i][0] for i in indices], RowVision.of_rows([done[i][1] for i in indices])


def prompt_spec(d: DataConfig, seed: int) -> DataSpec | None:
    """--prompt_data's sources (None: the built-in prompts)."""
    return (
        None
        if d.prompt_data is None
        else DataSpec(d.prompt_data, "prompt_data", d.prompt_split, d.prompt_data_probs, seed)
    )


def eval_spec(e: EvalConfig, seed: int) -> DataSpec | None:
    """--eval_dataset's sources (None: no evaluation)."""
    return None if e.eval_dataset is None else DataSpec(e.eval_dataset, "eval_dataset", e.eval_split, seed=seed)


def prompt_keys(d: DataConfig) -> PromptKeys:
    return PromptKeys(d.input_key, d.label_key, d.data_source_key)


def prompt_set(
    d: DataConfig,
    t: TemplateConfig,
    v: VisionConfig,
    g: GenerationConfig,
    tokenizer: Any,
    spec: DataSpec | None,
    max_samples: int,
    images: ImagePreparer | None,
    policy: str,
    records: list[PromptRecord] | None = None,
) -> Prompts:
    """`spec`'s records (None: the built-in prompts) formatted and tokenised as the policy sees them, cut or dropped at
    --prompt_max_len (--prompt_overflow). `images`: a vision-language policy's preprocessing, None for a text policy
    (`policy`: its name, for the message that refuses images it would not see). `records`: read elsewhere (a
    verifiers taskset's tasks, rlrun.data.tasksets), in place of spec's."""
    records = load_prompt_records(spec, prompt_keys(d), max_samples) if records is None else records
    source = spec.sources if spec is not None else "<built-in prompts>"
    texts = [
        format_prompt(
            r.prompt,
            tokenizer,
            t.input_template,
            t.apply_chat_template,
            d.apply_chat_template_kwargs,
            where=f"{source}: record {i}",
        )
        for i, r in enumerate(records)
    ]
    check_images(records, source, vision=images is not None, most=v.max_images_per_prompt, policy=policy)
    max_len = g.prompt_max_len
    if g.prompt_overflow == "drop":
        full, _ = tokenize_prompts(texts, tokenizer, 10**12)
        keep = [i for i, ids in enumerate(full) if len(ids) <= max_len]
        return Prompts(
            [texts[i] for i in keep],
            [full[i] for i in keep],
            [records[i] for i in keep],
            0,
            len(texts) - len(keep),
            images,
        )
    ids, truncated = tokenize_prompts(texts, tokenizer, max_len)
    return Prompts(texts, ids, records, truncated, 0, images)


def check_images(records: list[PromptRecord], source: str, *, vision: bool, most: int, policy: str) -> None:
    """A vision-language policy's prompts hold at most `most` images each (--max_images_per_prompt, 0: no limit); a
    text policy's hold none (they would be dropped without a word)."""
    if vision:
        over = next((i for i, r in enumerate(records) if most > 0 and len(r.images) > most), None)
        if over is not None:
            raise DataError(
                f"{source}: record {over} has {len(records[over].images)} images, more than "
                f"--max_images_per_prompt {most}; raise it (0: no limit) or drop the record"
            )
        return
    with_images = next((i for i, r in enumerate(records) if r.images), None)
    if with_images is not None:
        raise DataError(
            f"{source}: record {with_images} has images, but the policy {policy} is a text-only model; use "
            "a vision-language model (e.g. Qwen2.5-VL) or text-only prompts"
        )
