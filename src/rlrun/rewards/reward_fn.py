"""Rollout rewards from a Python file or an HTTP endpoint (OpenRLHF's --remote_rm_url), verl's compute_score
(rlrun.rewards.compute_score), or the demo rule.

Every source's output goes through one validator, so a broken reward script or server fails
with the same clear RewardError (source, what is wrong, how to fix) instead of a shape error
deep inside the loss.
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Callable
from dataclasses import dataclass
from numbers import Real
from typing import TYPE_CHECKING, Any, cast

import torch

from rlrun.data.prompts import PromptMeta
from rlrun.runtime.errors import RewardError
from rlrun.runtime.phases import deadline
from rlrun.runtime.pyfile import import_file, one_line
from rlrun.runtime.secrets import redact_url
from rlrun.serving.http_service import RequestRejected, RetriesExhausted, post_once, with_retries

if TYPE_CHECKING:
    from transformers import PreTrainedTokenizerBase

TOKEN_ENV = "RLRUN_REWARD_TOKEN"
BUILTIN_SOURCE = "builtin demo rule"
DEMO = "demo"  # --remote_rm_url demo: the demo's rule, named (implied only for the built-in demo data and model)

RawRewardFn = Callable[[list[str], list[str], list[Any]], object]  # OpenRLHF's reward_func(queries, prompts, labels)


@dataclass(frozen=True)
class RewardBatch:
    """One batch as every kind of reward source reads it; index i is sample i."""

    queries: list[str]  # prompt text + response (OpenRLHF's query)
    prompts: list[str]
    labels: list[Any]  # as the dataset holds them (None without --label_key)
    responses: list[str]  # the response alone, decoded without special tokens (verl's solution_str)
    data_sources: list[str | None]
    extra_infos: list[dict[str, Any] | None]


BatchFn = Callable[[RewardBatch], object]


def openrlhf_style(fn: RawRewardFn) -> BatchFn:
    return lambda batch: fn(batch.queries, batch.prompts, batch.labels)


@dataclass(frozen=True)
class RewardResult:
    rewards: torch.Tensor  # [b] float32, used for training
    scores: torch.Tensor  # [b] float32, logged (defaults to rewards)
    extra_logs: dict[str, float]  # means of any extra per-sample values, for metrics


def _to_float_tensor(value: object, what: str, source: str, batch: int | None) -> torch.Tensor:
    if isinstance(value, torch.Tensor):
        if value.is_complex():
            raise RewardError(
                f"reward source {source}: {what} is a tensor of dtype {value.dtype}, "
                "which is not a real number type; return float values."
            )
        # Extras are only averaged, so any shape will do; [b, 1] is a common reward-model shape.
        if batch is None or (value.dim() == 2 and value.shape[1] == 1):
            value = value.reshape(-1)
        if value.dim() != 1:
            raise RewardError(
                f"reward source {source}: {what} has shape {tuple(value.shape)}, expected "
                f"[{batch if batch is not None else 'b'}]; return one number per query."
            )
        tensor = value.detach().to(device="cpu", dtype=torch.float32)
    else:
        if not isinstance(value, (list, tuple)) and callable(getattr(value, "tolist", None)):
            value = value.tolist()  # type: ignore[attr-defined]  # numpy arrays and the like, without importing numpy
        if not isinstance(value, (list, tuple)):
            raise RewardError(
                f"reward source {source}: {what} is a {type(value).__name__}, expected a tensor or list of numbers."
            )
        bad = [i for i, v in enumerate(value) if not isinstance(v, Real)]
        if bad:
            shown = ", ".join(f"[{i}]={value[i]!r}" for i in bad[:5])
            raise RewardError(
                f"reward source {source}: {what} has {len(bad)} non-numeric value(s): {shown}; return plain numbers."
            )
        tensor = torch.tensor([float(v) for v in value], dtype=torch.float32)
    if batch is not None and tensor.numel() != batch:
        raise RewardError(
            f"reward source {source}: {what} has {tensor.numel()} values for {batch} queries; "
            "return exactly one value per query, in query order."
        )
    return tensor


def _check_finite(tensor: torch.Tensor, what: str, source: str) -> None:
    bad = (~torch.isfinite(tensor)).nonzero().flatten().tolist()
    if bad:
        shown = ", ".join(f"[{i}]={tensor[i].item()}" for i in bad[:5]) + (", ..." if len(bad) > 5 else "")
        raise RewardError(
            f"reward source {source}: {what} has {len(bad)} NaN/inf value(s) at {shown}; "
            "make the reward function return finite numbers (e.g. clamp or default to 0)."
        )


def _validate(raw: object, source: str, batch: int) -> RewardResult:
    extra_raw: object = {}
    if isinstance(raw, dict):
        if "rewards" not in raw:
            raise RewardError(
                f"reward source {source}: returned a dict with keys {sorted(map(str, raw))} "
                "but no 'rewards'; return {'rewards': [...], 'scores': ..., 'extra_logs': ...}."
            )
        rewards_raw, scores_raw, extra_raw = raw["rewards"], raw.get("scores"), raw.get("extra_logs") or {}
    elif isinstance(raw, (torch.Tensor, list, tuple)) or callable(getattr(raw, "tolist", None)):
        rewards_raw, scores_raw = raw, None
    else:
        raise RewardError(
            f"reward source {source}: returned a {type(raw).__name__}; expected a tensor or "
            "list of rewards, or a dict with key 'rewards'."
        )
    rewards = _to_float_tensor(rewards_raw, "rewards", source, batch)
    _check_finite(rewards, "rewards", source)
    if scores_raw is None:
        scores = rewards
    else:
        scores = _to_float_tensor(scores_raw, "scores", source, batch)
        _check_finite(scores, "scores", source)
    if not isinstance(extra_raw, dict):
        raise RewardError(
            f"reward source {source}: extra_logs is a {type(extra_raw).__name__}, expected a "
            "dict of name -> tensor/list/number."
        )
    extra_logs: dict[str, float] = {}
    for name, value in extra_raw.items():
        what = f"extra_logs[{name!r}]"
        values = _to_float_tensor([value] if isinstance(value, Real) else value, what, source, None)
        if values.numel():  # an empty list has no mean worth logging
            extra_logs[str(name)] = float(values.mean().item())
    return RewardResult(rewards=rewards, scores=scores, extra_logs=extra_logs)


class RewardFunction:
    """A validated reward source: call it with one rollout batch, get float32 CPU tensors back."""

    def __init__(self, source: str, fn: BatchFn, *, wrap_errors: bool = True, timeout_s: float | None = None) -> None:
        self.source = source
        self._fn = fn
        # User code's exceptions get wrapped with the source; the HTTP client already raises
        # complete RewardErrors that wrapping would only make longer.
        self._wrap_errors = wrap_errors
        self.timeout_s = timeout_s  # one call on one batch; past it the run fails (rlrun.runtime.phases)

    def __repr__(self) -> str:
        return f"RewardFunction(source={self.source!r})"

    def __call__(
        self,
        queries: list[str],
        prompts: list[str],
        labels: list[Any],
        *,
        responses: list[str] | None = None,
        data_sources: list[str | None] | None = None,
        extra_infos: list[dict[str, Any] | None] | None = None,
    ) -> RewardResult:
        """Score one batch. `responses` default to each query after its prompt; `data_sources` and `extra_infos`
        (verl's) to None."""
        if not len(queries) == len(prompts) == len(labels):
            raise RewardError(
                f"reward source {self.source}: got {len(queries)} queries, {len(prompts)} prompts "
                f"and {len(labels)} labels; pass one prompt and one label (or None) per query."
            )
        if not queries:
            empty = torch.zeros(0, dtype=torch.float32)
            return RewardResult(rewards=empty, scores=empty, extra_logs={})
        n = len(queries)
        batch = RewardBatch(
            list(queries),
            list(prompts),
            list(labels),
            responses
            if responses is not None
            else [q[len(p) :] if q.startswith(p) else q for q, p in zip(queries, prompts)],
            data_sources if data_sources is not None else [None] * n,
            extra_infos if extra_infos is not None else [None] * n,
        )
        try:
            with deadline(self.timeout_s, lambda: self._timed_out(queries)):
                raw = self._fn(batch)
        except Exception as exc:
            if isinstance(exc, RewardError) and not self._wrap_errors:
                raise
            raise self._wrapped(exc, len(queries)) from exc
        return _validate(raw, self.source, len(queries))

    def _timed_out(self, queries: list[str]) -> RewardError:
        first = " ".join(queries[0].split())[-120:]
        return RewardError(
            f"reward function {self.source} did not return within --reward_timeout {self.timeout_s:g} s "
            f"on a batch of {len(queries)} queries (the first ends {first!r}); make it faster (or "
            "bound its own waits), or raise --reward_timeout below --dist_timeout"
        )

    def _wrapped(self, exc: Exception, batch: int) -> RewardError:
        return RewardError(
            f"reward function {self.source} raised {one_line(exc)} on a batch of {batch} "
            "queries; fix the reward function (run it on a few samples by hand to reproduce)."
        )


def reward_responses(
    reward_fn: RewardFunction,
    prompt_texts: list[str],
    meta: PromptMeta,
    responses: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
) -> RewardResult:
    """Reward sampled responses: queries[i] is prompt_texts[i] followed by response i decoded without special
    tokens (what every reward source receives, OpenRLHF's convention); verl's scorers get the response alone."""
    # one text per row of ids (transformers types decode for a batch too)
    decoded = cast("list[str]", [tokenizer.decode(ids, skip_special_tokens=True) for ids in responses])
    return reward_fn(
        [text + r for text, r in zip(prompt_texts, decoded)],
        prompt_texts,
        meta.labels,
        responses=decoded,
        data_sources=meta.data_sources,
        extra_infos=meta.extra_infos,
    )


def _load_builtin() -> RewardFunction:
    # Imported lazily so that a user-supplied source never depends on the demo module.
    from rlrun.rewards.demo import reward_func  # noqa: PLC0415 - see above

    return RewardFunction(BUILTIN_SOURCE, openrlhf_style(reward_func))


NO_REWARD_SOURCE = "no reward (on-policy distillation alone)"


def no_reward() -> RewardFunction:
    """Every sample scores 0: a run that learns from its distillation teacher alone (--distill_task_reward false)
    with no reward source (slime's and prime-rl's pure on-policy distillation)."""
    return RewardFunction(NO_REWARD_SOURCE, openrlhf_style(lambda queries, prompts, labels: [0.0] * len(queries)))


def _load_file(path_text: str, timeout_s: float | None) -> RewardFunction:
    module = import_file(path_text, "reward file", RewardError, "reward_func(queries, prompts, labels)")
    fn = getattr(module, "reward_func", None)
    if not callable(fn):
        sys.modules.pop(module.__name__, None)
        found = "is not callable" if hasattr(module, "reward_func") else "is missing"
        raise RewardError(
            f"reward file {path_text}: reward_func {found}; define "
            "def reward_func(queries, prompts, labels) returning rewards (tensor/list or dict)."
        )
    return RewardFunction(path_text, openrlhf_style(fn), timeout_s=timeout_s)


class _HttpRewardFn:
    """POSTs a batch to an OpenRLHF-style reward server, retrying only failures that can heal."""

    def __init__(self, url: str, source: str, timeout_s: float, retries: int, backoff_s: float) -> None:
        self.url, self.source = url, source
        self.timeout_s, self.retries, self.backoff_s = timeout_s, retries, backoff_s

    def _scrub(self, text: str, token: str | None) -> str:
        return text.replace(token, "<token>") if token else text

    def __call__(self, queries: list[str], prompts: list[str], labels: list[Any]) -> object:
        token = os.environ.get(TOKEN_ENV) or None  # read per call so a rotated token is picked up
        try:
            body = json.dumps({"query": queries, "prompts": prompts, "labels": labels}).encode("utf-8")
        except (TypeError, ValueError) as exc:
            raise RewardError(
                f"reward server {self.source}: batch is not JSON-serializable ({one_line(exc)}); "
                "queries, prompts and labels must be strings (labels may be None)."
            ) from exc
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if token:
            headers["Authorization"] = f"Bearer {token}"

        def scrub(text: str) -> str:
            return self._scrub(text, token)

        try:
            status, payload = with_retries(
                lambda: post_once(self.url, body, headers, self.timeout_s, scrub),
                retries=self.retries,
                backoff_s=self.backoff_s,
            )
        except RequestRejected as exc:
            raise RewardError(
                f"reward server {self.source} rejected the request: {exc}; "
                f"check the URL, the request format and {TOKEN_ENV}."
            ) from None
        except RetriesExhausted as exc:
            raise RewardError(
                f"reward server {self.source} failed after {self.retries} attempts: {exc.last_error}; "
                "check that it is up and reachable from this node, or raise --remote_rm_timeout / "
                "--remote_rm_retries."
            ) from None
        try:
            return json.loads(payload.decode("utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError):
            snippet = scrub(" ".join(payload[:200].decode("utf-8", "replace").split()))
            raise RewardError(
                f"reward server {self.source} returned a non-JSON response (HTTP {status}, "
                f"starts with {snippet!r}); it must return JSON like "
                '{"rewards": [...]} or a list of numbers.'
            ) from None


def load_reward_function(
    remote_rm_url: str | None,
    *,
    timeout_s: float = 30.0,
    retries: int = 3,
    backoff_s: float = 1.0,
    call_timeout_s: float | None = None,
) -> RewardFunction:
    """Resolve `remote_rm_url` (None or "demo", a .py path, or an http(s) URL) to a validated RewardFunction.
    `timeout_s` bounds each HTTP request; `call_timeout_s` one call of a reward file's function (None: unbounded)."""
    if remote_rm_url is None or remote_rm_url.strip() == DEMO:
        return _load_builtin()
    text = remote_rm_url.strip()
    if text.lower().startswith(("http://", "https://")):
        source = redact_url(text)
        if not timeout_s > 0 or retries < 1 or backoff_s < 0:
            raise RewardError(
                f"reward server {source}: need timeout_s > 0, retries >= 1 and backoff_s >= 0, "
                f"got timeout_s={timeout_s}, retries={retries}, backoff_s={backoff_s}."
            )
        return RewardFunction(
            source, openrlhf_style(_HttpRewardFn(text, source, timeout_s, retries, backoff_s)), wrap_errors=False
        )
    if text.endswith(".py"):
        return _load_file(text, call_timeout_s)
    raise RewardError(
        f"remote_rm_url {text!r} is neither a .py file nor an http(s):// URL; pass a Python file "
        "defining reward_func, a reward server URL, or nothing for the builtin demo rule."
    )
