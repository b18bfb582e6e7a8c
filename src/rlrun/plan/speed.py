"""The settings that decide how fast a PPO step runs, resolved once before planning and named in one start-up line.

Left unset, `--dynamic_batch`, `--packing_samples` and `--native_cuda_graph` take their device's default: on with a
CUDA device, where token-budget micro-batches of packed rows train on no padding at all (each packed sequence
attends by itself: rlrun.strategies.ulysses) and a captured decode step replaces a few hundred kernel launches per
token (the two together with a 16K-token budget, measured on one H200 with the same GRPO job: 9.1 -> 3.1 s/step
for the 0.5B preset, 7.5 -> 4.5 s for a Qwen2.5-1.5B shape); off on CPU, where runs keep the fixed micro-batches
their configs were written for (the CPU examples and tests) and no graph can be captured.
A value given by flag, YAML or a peer's key is kept as given. The line says what each setting is, why, and how to
turn it off, so that a slow or surprising step can be traced to one flag.
"""

from __future__ import annotations

from dataclasses import replace

from rlrun.config.tree import Config

# The settings that take the device's default when the command line, the YAML or a peer's key does not set them.
DEVICE_DEFAULTS = ("dynamic_batch", "packing_samples", "native_cuda_graph")


def resolve_speed(cfg: Config, cuda: bool, explicit: frozenset[str]) -> Config:
    """`cfg` with each of DEVICE_DEFAULTS not in `explicit` (the fields the command line or YAML set) on with `cuda`;
    the fields' own defaults (off) are the CPU's.

    A default-on token budget is the memory plan's micro-batch: --micro_train_batch_size (scoring:
    --micro_rollout_batch_size) rows of the longest row (--prompt_max_len + --generate_max_len), which is what the
    plan counts activations for (rlrun.plan.memory), so a micro-batch by tokens never holds more than the plan
    fits. Rows shorter than the longest then share a micro-batch instead of padding it. A budget the user set is
    kept and checked as given."""
    if not cuda:
        return cfg
    t, g = cfg.train, cfg.generation
    if "packing_samples" not in explicit:
        t = replace(t, packing_samples=True)
    if "dynamic_batch" not in explicit:
        longest = g.prompt_max_len + g.generate_max_len
        t = replace(
            t,
            dynamic_batch=True,
            train_max_tokens_per_gpu=(
                t.train_max_tokens_per_gpu
                if "train_max_tokens_per_gpu" in explicit
                else t.micro_train_batch_size * longest
            ),
            rollout_max_tokens_per_gpu=(
                t.rollout_max_tokens_per_gpu
                if "rollout_max_tokens_per_gpu" in explicit
                else t.micro_rollout_batch_size * longest
            ),
        )
    if "native_cuda_graph" not in explicit:
        g = replace(g, native_cuda_graph=True)
    return replace(cfg, train=t, generation=g)


def speed_line(cfg: Config, cuda: bool, explicit: frozenset[str]) -> str:
    """One start-up line: the speed settings of `cfg` (resolved), each with why it has its value (`explicit`: the
    fields set) and the flag that changes it."""
    t, g = cfg.train, cfg.generation
    why = {name: "as set" if name in explicit else f"{'GPU' if cuda else 'CPU'} default" for name in DEVICE_DEFAULTS}
    if t.dynamic_batch:
        scoring = t.rollout_max_tokens_per_gpu or t.train_max_tokens_per_gpu
        source = (
            ""
            if "dynamic_batch" in explicit
            else f", the memory plan's {t.micro_train_batch_size} and {t.micro_rollout_batch_size} rows of "
            f"{g.prompt_max_len + g.generate_max_len:,} tokens"
        )
        batches = (
            f"token-budget micro-batches ({why['dynamic_batch']}; <= {t.train_max_tokens_per_gpu:,} tokens to train, "
            f"{scoring:,} to score per rank{source}: --train_max_tokens_per_gpu, --rollout_max_tokens_per_gpu; off: "
            "--dynamic_batch false)"
        )
    else:
        batches = (
            f"fixed micro-batches of {t.micro_train_batch_size} rows to train, {t.micro_rollout_batch_size} to score "
            f"({why['dynamic_batch']}; by tokens: --dynamic_batch)"
        )
    rows = (
        f"packed rows, each sequence attending by itself ({why['packing_samples']}; off: --packing_samples false)"
        if t.packing_samples
        else f"padded rows, each micro-batch cut to its longest ({why['packing_samples']}; packed: --packing_samples)"
    )
    vocab = (
        f"log-probs over the vocabulary {t.logits_chunk_size:,} positions at a time (--logits_chunk_size)"
        if t.logits_chunk_size > 0
        else "log-probs over the whole vocabulary at once (--logits_chunk_size 0)"
    )
    parts = [batches, rows, vocab]
    if g.generation_backend == "native":
        graph = why["native_cuda_graph"]
        parts.append(
            f"native decode steps captured as CUDA graphs ({graph}; off: --native_cuda_graph false)"
            if g.native_cuda_graph and cuda
            else f"native decode steps run eagerly ({graph}" + ("; captured: --native_cuda_graph)" if cuda else ")")
        )
    return "speed settings: " + "; ".join(parts)
