"""Hugging Face Hub names (`Qwen/Qwen2.5-7B`, `OpenRLHF/prompt-collection-v0.1`) resolved to local folders through the
hub cache: the one adapter over huggingface_hub.

A name that is not a local path and has the shape of a repo id is looked up in the cache (`HF_HUB_CACHE`, else
`HF_HOME/hub`) and, unless `HF_HUB_OFFLINE=1`, downloaded into it. Every rank resolves the same names; the hub client's
per-file locks make one process download each file while the others on that machine wait for it, so a node fetches a
model once. Weights in formats rlrun never loads (GGUF, ONNX, TF/Flax, consolidated `original/` checkpoints) are not
downloaded.
"""

from __future__ import annotations

import dataclasses
import os
import re
from functools import cache
from typing import Any, Literal

from rlrun.models.gguf import gguf_folder, is_gguf
from rlrun.runtime.errors import ConfigError

RepoType = Literal["model", "dataset"]
# owner/name (or a bare name), optionally @revision; hub ids never start with '.', '/' or '~'.
_REPO_ID = re.compile(r"^(?P<repo>[A-Za-z0-9][\w.-]*(?:/[\w.-]+)?)(?:@(?P<revision>[\w./-]+))?$")
_NOT_LOADED = [
    "*.gguf",
    "*.onnx",
    "*.onnx_data",
    "*.msgpack",
    "*.h5",
    "*.tflite",
    "*.ot",
    "original/*",
    "onnx/*",
    "coreml/*",
    "openvino/*",
]


def offline() -> bool:
    return os.environ.get("HF_HUB_OFFLINE", "").strip().lower() in ("1", "true", "yes", "on")


def cache_dir() -> str:
    """The hub cache as huggingface_hub finds it, read now (not at its import): HF_HUB_CACHE, else HF_HOME/hub."""
    from huggingface_hub import constants  # noqa: PLC0415 - it reads HF_HUB_* at its import: now, not at ours

    if home := os.environ.get("HF_HOME"):
        default = os.path.join(os.path.expanduser(home), "hub")
    else:
        default = constants.HF_HUB_CACHE
    return os.environ.get("HF_HUB_CACHE") or os.environ.get("HUGGINGFACE_HUB_CACHE") or default


def parse_repo_id(name: str) -> tuple[str, str | None] | None:
    """(repo id, revision or None) when `name` has a hub id's shape and is not a local path, else None."""
    if os.path.exists(name) or name.endswith((".jsonl", ".json", ".parquet", ".csv", ".py")):
        return None
    match = _REPO_ID.match(name)
    return (match["repo"], match["revision"]) if match else None


def cached(name: str, repo_type: RepoType) -> str | None:
    """The snapshot folder of hub id `name` (`owner/name[@revision]`) in this machine's hub cache, else None; reads
    the cache alone (refs/REVISION -> snapshots/COMMIT, as huggingface_hub lays it out), never the network."""
    parsed = parse_repo_id(name)
    if parsed is None:
        return None
    from huggingface_hub import snapshot_download  # noqa: PLC0415 - reads HF_HUB_* at its import
    from huggingface_hub.errors import LocalEntryNotFoundError  # noqa: PLC0415

    try:
        return snapshot_download(
            parsed[0], repo_type=repo_type, revision=parsed[1], cache_dir=cache_dir(), local_files_only=True
        )
    except (LocalEntryNotFoundError, ValueError):  # not cached; or a name the hub client rejects (HFValidationError)
        return None


def missing_note(flag: str, name: str, repo_type: RepoType) -> str | None:
    """A dry run's line for a value this machine cannot read: None for a path here or a hub id in its cache. A name
    of a hub id's shape (`out/sft`) may equally be a relative path an earlier stage writes: both are said."""
    if os.path.exists(name) or cached(name, repo_type) is not None:
        return None
    if parse_repo_id(name) is None:
        return f"--{flag} {name}: not found on this machine (another host's path?)"
    kind = "dataset " if repo_type == "dataset" else ""
    return (
        f"--{flag} {name}: not on this machine: a path not written yet (an earlier stage's output?), or a Hugging "
        f"Face Hub {kind}id not in this machine's cache, downloaded at start-up (HF_HUB_OFFLINE=1 there: download "
        "it first)"
    )


@cache
def resolve(name: str, repo_type: RepoType, flag: str, *, download: bool = True) -> str:
    """The local folder of `name`: itself when it is a local path, else the hub snapshot (downloaded when allowed).

    download=False (a dry run): the cached snapshot, else `name` itself (downloaded at start-up, or a path an earlier
    stage writes: missing_note says so), unless the hub, when it may be asked, names a repo this machine may not read
    or a revision it lacks. Raises ConfigError naming the cache and the way out."""
    if os.path.exists(name):
        return name
    parsed = parse_repo_id(name)
    if parsed is None and not download:
        return name  # a dry run on a machine without this path (a login node): planning warns about it
    if parsed is None:
        raise ConfigError(
            f"--{flag} {name}: no such file or directory, and not a Hugging Face Hub id (owner/name); check the path"
        )
    repo, revision = parsed
    from huggingface_hub import HfApi, snapshot_download  # noqa: PLC0415 - reads HF_HUB_* at its import
    from huggingface_hub.errors import (  # noqa: PLC0415
        GatedRepoError,
        HfHubHTTPError,
        LocalEntryNotFoundError,
        RepositoryNotFoundError,
        RevisionNotFoundError,
    )

    kind = "dataset " if repo_type == "dataset" else ""
    where = f"the Hugging Face cache ({cache_dir()})"
    unreadable = (RepositoryNotFoundError, GatedRepoError, RevisionNotFoundError)

    def refused(exc: Exception) -> ConfigError:
        return ConfigError(
            f"--{flag} {name}: the hub has no {kind}repo {repo}{'@' + revision if revision else ''} "
            f"that this machine may read ({type(exc).__name__}); check the name, or for a private or "
            "gated repo log in (`hf auth login` or HF_TOKEN)"
        )

    try:
        return snapshot_download(
            repo,
            repo_type=repo_type,
            revision=revision,
            cache_dir=cache_dir(),
            local_files_only=offline() or not download,
            ignore_patterns=_NOT_LOADED if repo_type == "model" else None,
        )
    except LocalEntryNotFoundError:
        if not download and offline():
            return name  # a dry run with HF_HUB_OFFLINE=1: a hub id not cached here, or a path not written yet
        if offline():
            raise ConfigError(
                f"--{flag} {name}: {kind}{repo} is not in {where} and HF_HUB_OFFLINE=1 forbids "
                f"downloading it; fetch it where there is network, with the same HF_HOME: "
                f"`hf download {'--repo-type dataset ' if kind else ''}{repo}`, or unset "
                "HF_HUB_OFFLINE"
            ) from None
        if download:
            raise ConfigError(
                f"--{flag} {name}: {kind}{repo} is not in {where} and the hub could not be reached; "
                "check the network (or HF_ENDPOINT), or download it beforehand"
            ) from None
    except unreadable as exc:
        raise refused(exc) from None
    except HfHubHTTPError as exc:
        raise ConfigError(f"--{flag} {name}: downloading {kind}{repo} failed: {str(exc).splitlines()[0]}") from None
    try:  # a dry run and not cached: say now whether start-up will find it
        HfApi().repo_info(repo, repo_type=repo_type, revision=revision)
    except (GatedRepoError, RevisionNotFoundError) as exc:  # the repo exists: this machine may not read it as named
        raise refused(exc) from None
    except RepositoryNotFoundError:
        return name  # no such repo: a relative path an earlier stage writes (`out/sft`), or a misspelt id
    except HfHubHTTPError as exc:
        raise ConfigError(
            f"--{flag} {name}: not in {where}, and the hub could not be asked about it: {str(exc).splitlines()[0]}"
        ) from None
    except Exception:  # noqa: BLE001 - no network: the transport's own error (httpx, requests), not the hub's
        return name  # as offline: planning says it is not on this machine
    return name


MODEL_FLAGS = ("pretrain", "reward_pretrain", "critic_pretrain")


def resolve_models(model: Any, *, download: bool = True) -> Any:
    """A config's model section with every hub id among MODEL_FLAGS replaced by its local snapshot folder, and every
    GGUF file by its dequantised folder (rlrun.models.gguf; converted once, a dry run included)."""
    found = {flag: getattr(model, flag) for flag in MODEL_FLAGS if getattr(model, flag, None) is not None}
    return dataclasses.replace(
        model,
        **{
            flag: gguf_folder(name, flag) if is_gguf(name) else resolve(name, "model", flag, download=download)
            for flag, name in found.items()
        },
    )


_COMMIT = re.compile(r"^[0-9a-f]{40}$")


def snapshot_repo(path: str) -> tuple[str, str] | None:
    """(repo id, commit) when `path` is a model snapshot folder of a hub cache (`<cache>/models--owner--name/snapshots/
    COMMIT`, what `resolve` turns a hub id into), else None. A saved LoRA adapter names its base by hub id: the id holds
    on other machines, the cache folder does not."""
    snapshots, commit = os.path.split(os.path.realpath(path))
    repo_folder, leaf = os.path.split(snapshots)
    name = os.path.basename(repo_folder)
    if leaf != "snapshots" or not name.startswith("models--") or not _COMMIT.match(commit):
        return None
    return name.removeprefix("models--").replace("--", "/"), commit  # the hub forbids "--" inside names
