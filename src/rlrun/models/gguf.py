"""GGUF checkpoints (llama.cpp's single-file format) as --pretrain: dequantised once, by transformers, into an HF
folder in rlrun's cache, which every later step reads like any other model folder.

transformers reads GGUF files (`from_pretrained(folder, gguf_file=name)`, with the `gguf` package) and dequantises
the weights into a normal model (a LlamaForCausalLM for SmolLM2, a Qwen2ForCausalLM for Qwen2.5), tokenizer and chat
template included. Training needs the full-precision weights anyway, so rlrun keeps only that folder.
"""

from __future__ import annotations

import hashlib
import importlib.util
import os

from rlrun.runtime.cache import built_once, cache_root
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import get_logger

SUFFIX = ".gguf"
VERSION = 1  # bump when the conversion changes: older cache folders are then not reused


def is_gguf(path: str) -> bool:
    return path.endswith(SUFFIX) and os.path.isfile(path)


def gguf_folder(path: str, flag: str) -> str:
    """The HF folder of the GGUF file at `path` (--`flag`), converted on first use into
    RLRUN_CACHE/gguf-v1/<name>-<digest of the file's path, size and time>. Raises ConfigError when the `gguf` package
    is missing or transformers cannot read the file."""
    if importlib.util.find_spec("gguf") is None:
        raise ConfigError(
            f"--{flag} {path}: reading a GGUF file needs the `gguf` package; pip install gguf (or rlrun's `real` "
            "extra), or pass an HF model folder"
        )
    stat = os.stat(path)
    digest = hashlib.sha256(f"{os.path.abspath(path)}|{stat.st_size}|{stat.st_mtime_ns}".encode()).hexdigest()[:16]
    name = os.path.basename(path).removesuffix(SUFFIX)
    final = os.path.join(cache_root(), f"gguf-v{VERSION}", f"{name}-{digest}")
    if not os.path.isdir(final):
        rank = int(os.environ.get("RANK", "0"))  # every rank converts (built_once keeps one copy); rank 0 says so
        get_logger(rank).info_once(f"--{flag} {path}: dequantising into {final} (once; later runs reuse it)")
    return built_once(final, lambda folder: _convert(path, folder, flag))


def _convert(path: str, out: str, flag: str) -> None:
    import torch  # noqa: PLC0415 - only a conversion pays for transformers' model classes
    from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: PLC0415

    folder, file = os.path.split(os.path.abspath(path))
    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=file)
        model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=file, dtype=torch.float32)
    except (ValueError, KeyError, RuntimeError, OSError) as e:
        raise ConfigError(
            f"--{flag} {path}: transformers cannot read this GGUF file ({type(e).__name__}: {e}); its architecture or "
            "quantisation may be one transformers does not dequantise: convert it to an HF folder another way"
        ) from e
    # The weights are plain tensors now; the quantisation record would make save_pretrained refuse them.
    model.hf_quantizer = None  # type: ignore[assignment]  # nn.Module's __setattr__ types every attribute
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
