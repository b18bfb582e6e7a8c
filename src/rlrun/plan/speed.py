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

from rlrun.config.schema import Config


def resolve_speed(cfg: Config, cuda: bool, explicit: frozenset[str] = frozenset()) -> Config:
    """`cfg` with --dynamic_batch and --native_cuda_graph set where they were left unset (None), and
    --packing_samples where it is not in `explicit` (the fields the command line or YAML set): `cuda`'s default.

    A default-on token budget is the memory plan's micro-batch: --micro_train_batch_size (scoring:
    --micro_rollout_batch_size) rows of the longest row (--prompt_max_len + --generate_max_len), which is what the
    plan counts activations for (rlrun.plan.memory), so a micro-batch by tokens never holds more than the plan
    fits. Rows shorter than the longest then share a micro-batch instead of padding it. A budget the user set is
    kept and checked as given."""
    t, g = cfg.train, cfg.generation
    if cuda and "packing_samples" not in explicit:
        t = replace(t, packing_samples=True)
    if t.dynamic_batch is None:
        t = replace(t, dynamic_batch=cuda)
        if cuda:
            longest = g.prompt_max_len + g.generate_max_len
            train = t.train_max_tokens_per_gpu
            scoring = t.rollout_max_tokens_per_gpu
            t = replace(
                t,
                train_max_tokens_per_gpu=(
                    train if "train_max_tokens_per_gpu" in explicit else t.micro_train_batch_size * longest
                ),
                rollout_max_tokens_per_gpu=(
                    scoring if "rollout_max_tokens_per_gpu" in explicit else t.micro_rollout_batch_size * longest
                ),
            )
    if g.native_cuda_graph is None:
        g = replace(g, native_cuda_graph=cuda)
    return replace(cfg, train=t, generation=g)


def speed_line(requested: Config, cfg: Config, cuda: bool, explicit: frozenset[str] = frozenset()) -> str:
    """One start-up line: the resolved speed settings of `cfg`, each with why it has its value (`requested`: the
    config before resolve_speed, `explicit` the fields set) and the flag that changes it."""
    device = "GPU" if cuda else "CPU"
    t, g = cfg.train, cfg.generation

    def why(value: bool | None) -> str:
        return f"{device} default" if value is None else "as set"

    if t.dynamic_batch:
        scoring = t.rollout_max_tokens_per_gpu or t.train_max_tokens_per_gpu
        batches = (
            f"token-budget micro-batches ({why(requested.train.dynamic_batch)}; <= {t.train_max_tokens_per_gpu:,} "
            f"tokens to train, {scoring:,} to score per rank: --train_max_tokens_per_gpu, "
            "--rollout_max_tokens_per_gpu; off: --dynamic_batch false)"
        )
        if requested.train.dynamic_batch is None:  # the budget is the plan's micro-batch: say where it comes from
            longest = g.prompt_max_len + g.generate_max_len
            batches = batches.replace(
                " per rank:",
                f" per rank, the memory plan's {t.micro_train_batch_size} and {t.micro_rollout_batch_size} rows of "
                f"{longest:,} tokens:",
            )
    else:
        batches = (
            f"fixed micro-batches of {t.micro_train_batch_size} rows to train, {t.micro_rollout_batch_size} to score "
            f"({why(requested.train.dynamic_batch)}; by tokens: --dynamic_batch)"
        )
    packing_why = "as set" if "packing_samples" in explicit or requested.train.packing_samples else f"{device} default"
    rows = (
        f"packed rows, each sequence attending by itself ({packing_why}; off: --packing_samples false)"
        if t.packing_samples
        else f"padded rows, each micro-batch cut to its longest ({packing_why}; packed: --packing_samples)"
    )
    vocab = (
        f"log-probs over the vocabulary {t.logits_chunk_size:,} positions at a time (--logits_chunk_size)"
        if t.logits_chunk_size > 0
        else "log-probs over the whole vocabulary at once (--logits_chunk_size 0)"
    )
    parts = [batches, rows, vocab]
    if g.generation_backend == "native":
        parts.append(
            f"native decode steps captured as CUDA graphs ({why(requested.generation.native_cuda_graph)}; "
            "off: --native_cuda_graph false)"
            if g.native_cuda_graph and cuda
            else f"native decode steps run eagerly ({why(requested.generation.native_cuda_graph)}"
            + ("; captured: --native_cuda_graph)" if cuda else ")")
        )
    return "speed settings: " + "; ".join(parts)
