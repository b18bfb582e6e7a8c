"""rlrun.tinker's command line into its plan, on every rank before anything starts (light imports: no SDK, no
model code): every section's own rules, what v1 runs, the served model resolved, and the sampling backend."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Sequence
from dataclasses import dataclass, replace

from rlrun.cli.parser import CliSpec, parse_args
from rlrun.config.tinker import TinkerConfig
from rlrun.engines.build import native_blocker, resolve_backend
from rlrun.launch.dist import uses_cuda
from rlrun.launch.env import DistEnv
from rlrun.models.adapter_pretrain import resolve_adapter_pretrain
from rlrun.models.hub import resolve_models
from rlrun.models.loading import load_model_config
from rlrun.plan.plan import Planned
from rlrun.runtime.errors import ConfigError

API_KEY_ENV = "RLRUN_TINKER_API_KEY"


@dataclass(frozen=True)
class TinkerPlan(Planned[TinkerConfig]):
    """The config with the engine backend resolved (`backend`, and why), and the key clients must send (None: any)."""

    backend: str = "native"
    backend_why: str = ""
    arch: str = ""  # the model's config class (get_info's arch), read once here
    api_key: str | None = None


def plan_tinker(argv: Sequence[str] | None, env: DistEnv, cli: CliSpec) -> TinkerPlan:
    parsed = parse_args(argv, cli)
    cfg: TinkerConfig = parsed.config
    for section in dataclasses.fields(cfg):
        getattr(cfg, section.name).check()
    t, rt = cfg.train, cfg.runtime
    if t.strategy != "fsdp":
        raise ConfigError(
            "rlrun.tinker runs --strategy fsdp (v1: DeepSpeed's engine owns gradient accumulation, which Tinker's "
            "forward_backward / optim_step split across requests); drop --strategy deepspeed"
        )
    if t.sequence_parallel_size != 1:
        raise ConfigError("rlrun.tinker does not run sequence parallelism (v1); drop --sequence_parallel_size")
    if cfg.serve.tinker_keepalive >= rt.dist_timeout:
        raise ConfigError(
            f"--tinker_keepalive {cfg.serve.tinker_keepalive:g} must be under --dist_timeout {rt.dist_timeout:g} "
            "(the idle ranks wait that long for the next request or keepalive)"
        )
    if importlib.util.find_spec("tinker") is None:
        raise ConfigError("rlrun.tinker needs the tinker SDK's types: pip install 'rlrun[tinker]' (tinker 0.38)")
    download = not rt.dry_run
    model = resolve_adapter_pretrain(resolve_models(cfg.model, download=download), download=download)
    cfg = replace(cfg, model=model)
    cuda = uses_cuda(rt.device)
    config = load_model_config(model)
    backend, why = resolve_backend(cfg.sampler.generation_backend, cuda, native_blocker(config, t.max_len))
    name = cfg.serve.tinker_model_name or parsed.config.model.pretrain or f"rlrun-preset-{model.model_preset}"
    cfg = replace(cfg, serve=replace(cfg.serve, tinker_model_name=name))
    share = (
        f"{cli.prog}: {env.world_size} ranks (launcher {env.launcher}); every rank holds an FSDP shard of {name} "
        f"and a {backend} engine ({why}); forward_backward data and sample rows are dealt over the ranks"
    )
    key = cfg.serve.tinker_api_key or os.environ.get(API_KEY_ENV) or None
    return TinkerPlan(
        cfg,
        warnings=tuple(parsed.ignored),
        notes=(share,),
        roles="tinker",
        backend=backend,
        backend_why=why,
        arch=type(config).__name__,
        api_key=key,
    )
