"""Which generation backend a run uses: --generation_backend resolved once, before planning, the same on every
rank (a pure function of the config, the policy's config.json and whether a GPU and vLLM are present), so that
planning, building and the rollout exchange all read one concrete backend."""

from __future__ import annotations

from dataclasses import dataclass, replace

from rlrun.config.schema import Config
from rlrun.engines.base import REPORTS_LOG_PROBS, resolve_backend
from rlrun.engines.decoder import unsupported_reason
from rlrun.models.loading import load_model_config
from rlrun.runtime.errors import ConfigError, MissingExtraError

# --dry_run --generation_backend vllm where vLLM is not installed (a login node, CI): planned all the same, since the
# plan needs only the backend's name and its memory model; the real start checks the install (one line if missing).
VLLM_ASSUMED = ("vLLM is not installed here: the plan assumes it is on the nodes that run the job (the job itself "
                "refuses to start without it)")


@dataclass(frozen=True)
class GenerationChoice:
    config: Config  # the run's config with generation_backend set to the chosen backend
    why: str
    assumed: str | None = None  # a dry run planned a backend not installed here: the line that says so

    @property
    def backend(self) -> str:
        return self.config.generation.generation_backend


def choose_generation(cfg: Config, cuda: bool) -> GenerationChoice:
    g = cfg.generation
    try:
        config = load_model_config(cfg.model)
    except ConfigError:
        if not cfg.runtime.dry_run:
            raise
        config = None  # --dry_run on a machine without the model (a login node): paths are only warnings there
    assumed = None
    blocker = None if config is None else unsupported_reason(config, g.prompt_max_len + g.generate_max_len)
    try:
        backend, why = resolve_backend(g.generation_backend, cuda, blocker)
    except MissingExtraError:
        if not (cfg.runtime.dry_run and g.generation_backend == "vllm"):
            raise
        backend, why, assumed = "vllm", "requested (not installed here)", VLLM_ASSUMED
    if cfg.algo.is_correction_level != "off" and backend not in REPORTS_LOG_PROBS:
        raise ConfigError(f"--is_correction_level {cfg.algo.is_correction_level} needs the engine's sampled-token "
                          f"log-probs, but generation resolved to {backend} ({why}); use --generation_backend vllm, "
                          "or drop the flag")
    return GenerationChoice(replace(cfg, generation=replace(g, generation_backend=backend)), why, assumed)
