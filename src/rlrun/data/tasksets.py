"""verifiers 0.4 tasksets as a prompt source (--env_id): the taskset's tasks become the run's prompt records, in the
taskset's order, on every rank alike.

verifiers is an optional extra (`pip install rlrun[verifiers]`), imported only here and in
rlrun.environments.tasksets. The environment is built as verifiers' own loader builds it (`resolve_env_config`:
a taskset id names an importable module or package whose `__all__` exports one Taskset), with a local runtime and
rlrun's harness: nothing reaches a hosted service or a cloud sandbox.
"""

from __future__ import annotations

import functools
import json
from typing import Any

from rlrun.data.prompts import PromptRecord
from rlrun.runtime.errors import ConfigError, DataError, MissingExtraError

# A taskset that never ends (verifiers' INFINITE) gives at most this many tasks unless --max_samples says fewer.
MOST_TASKS = 10_000


def verifiers_v1() -> Any:
    try:
        import verifiers.v1 as vf  # noqa: PLC0415 - an optional extra, imported where a taskset is named
    except ImportError:
        raise MissingExtraError("verifiers", "verifiers", "--env_id (a verifiers 0.4 taskset)") from None
    return vf


def env_args(text: str | None) -> dict[str, Any]:
    """--env_args: a JSON object of the taskset's config fields."""
    if not text:
        return {}
    try:
        value = json.loads(text)
    except ValueError as exc:
        example = '\'{"split": "test"}\''
        raise ConfigError(f"--env_args {text!r} is not JSON ({exc}); pass an object, e.g. {example}") from None
    if not isinstance(value, dict):
        raise ConfigError(f'--env_args {text!r} is not a JSON object; pass one, e.g. \'{{"split": "test"}}\'')
    return value


def load_environment(env_id: str, args_text: str | None, harness: str, max_turns: int | None) -> Any:
    """The verifiers environment of taskset `env_id` with `harness` in every seat of its env (`agent` for a plain
    taskset; a taskset exporting its own Env names its seats, e.g. a game's `player`, a user simulation's `assistant`
    and `user`), on a local subprocess runtime: a new one per call (an environment's locks belong to the event loop
    that first runs it)."""
    vf = verifiers_v1()
    agent: dict[str, Any] = {"harness": {"id": harness}, "runtime": {"type": "subprocess"}}
    if max_turns is not None:
        agent["max_turns"] = max_turns
    try:
        seats = env_seats(env_id)
        config = {"taskset": {"id": env_id, **env_args(args_text)}, **{seat: agent for seat in seats}}
        return vf.load_environment(vf.resolve_env_config(config))
    except (ImportError, ValueError, TypeError, KeyError) as exc:
        raise ConfigError(
            f"--env_id {env_id} (harness {harness}) does not load as a verifiers 0.4 taskset: {type(exc).__name__}: "
            f"{' '.join(str(exc).split())[:400]}. The id names an importable module or package whose __all__ "
            "exports one Taskset subclass"
        ) from None


def env_seats(env_id: str) -> list[str]:
    """The agent seats of the taskset's env (its config's AgentConfig fields, as verifiers reads them)."""
    vf = verifiers_v1()
    from verifiers.v1.utils.loaders import env_config_type  # noqa: PLC0415 - the optional extra's

    fields = env_config_type(env_id).model_fields
    return [name for name, f in fields.items() if isinstance(f.default, vf.AgentConfig)] or ["agent"]


@functools.lru_cache(maxsize=4)
def tasks_of(env_id: str, args_text: str | None, harness: str, max_turns: int | None, count: int) -> tuple:
    """The taskset's first `count` tasks (at most MOST_TASKS of an endless one), in its order (cached: the records
    and the episodes of a rank share them)."""
    env = load_environment(env_id, args_text, harness, max_turns)
    tasks = []
    for task in env.taskset:
        tasks.append(task)
        if len(tasks) >= min(count, MOST_TASKS):
            break
    if not tasks:
        raise DataError(f"--env_id {env_id}: the taskset has no tasks")
    return tuple(tasks)


def _prompt(task: Any, k: int, env_id: str) -> str | list[dict]:
    data = task.data
    prompt = data.prompt
    if isinstance(prompt, str):
        messages: list[dict] = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, list):
        messages = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in prompt]
    else:
        raise DataError(f"--env_id {env_id}: task {k} has no prompt (text or messages); rlrun samples from a prompt")
    if getattr(data, "system_prompt", None):
        messages = [{"role": "system", "content": data.system_prompt}, *messages]
    return messages


def taskset_records(
    env_id: str, args_text: str | None, harness: str, max_turns: int | None, count: int
) -> list[PromptRecord]:
    """One prompt record per task: its prompt as a chat (with its system prompt), the task's place in the taskset as
    `extra_info["task"]` (how the engine ranks find it again)."""
    tasks = tasks_of(env_id, args_text, harness, max_turns, count)
    return [
        PromptRecord(prompt=_prompt(task, k, env_id), extra_info={"task": k}, data_source=env_id)
        for k, task in enumerate(tasks)
    ]
