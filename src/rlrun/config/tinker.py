"""rlrun.tinker's config tree: the sections every trainer shares (model, optimisation, saving, tracking, runtime)
plus the API server's (`ServeConfig`) and the sampler's (`SamplerConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal

from rlrun.config.checkpoint import SavingConfig
from rlrun.config.data import TemplateConfig
from rlrun.config.fields import opt, positive
from rlrun.config.model import PretrainedConfig
from rlrun.config.runtime import RuntimeConfig
from rlrun.config.tracking import TrackingConfig
from rlrun.config.training import OptimConfig
from rlrun.runtime.errors import ConfigError


@dataclass
class ServeConfig:
    """The Tinker API server (rank 0)."""

    tinker_host: str = opt("127.0.0.1", "Address the API listens on (0.0.0.0: every interface).")
    tinker_port: int = opt(8000, "Port of the API (the SDK's base_url is http://HOST:PORT).")
    tinker_api_key: str | None = opt(
        None,
        "The key clients must send (the SDK's TINKER_API_KEY, as X-API-Key); a wrong one gets 401. Unset: the "
        "environment's RLRUN_TINKER_API_KEY, else any key the SDK accepts (a single-user box).",
        secret=True,
    )
    tinker_model_name: str | None = opt(
        None,
        "The base_model name clients ask for (e.g. Qwen/Qwen3-8B); unset: --pretrain as given. create_model "
        "with another name is refused.",
    )
    tinker_keepalive: float = opt(
        20.0,
        "Seconds between the keepalive messages rank 0 sends the other ranks while no request runs (so an idle "
        "client never trips --dist_timeout); must stay under --dist_timeout.",
    )
    tinker_max_request_mb: int = opt(256, "Largest request body accepted (413 above it).")

    def check(self) -> None:
        if not 0 < self.tinker_port < 65536:
            raise ConfigError(f"--tinker_port must be in 1..65535, got {self.tinker_port}")
        positive("tinker_keepalive", self.tinker_keepalive)
        positive("tinker_max_request_mb", self.tinker_max_request_mb)


@dataclass
class SamplerConfig:
    """Sampling (the SDK's sample calls) on engines colocated with the trained model on every rank."""

    generation_backend: Literal["auto", "native", "hf"] = opt(
        "auto", "Engine: rlrun's KV-cache decoder (native) where it runs the architecture, else HF generate."
    )
    native_kv_cache_mb: int | None = opt(None, "The native engine's KV-cache budget per rank (MiB; unset: sized).")
    max_tokens_cap: int = opt(4096, "Largest max_tokens one sample request may ask for.")

    def check(self) -> None:
        positive("native_kv_cache_mb", self.native_kv_cache_mb, allow_none=True)
        positive("max_tokens_cap", self.max_tokens_cap)


@dataclass
class TinkerTrainConfig(OptimConfig):
    """The trained model's strategy and micro-batches (the learning rate and Adam's settings come with each
    optim_step)."""

    max_len: int = opt(8192, "Most tokens of one datum (longer ones are refused).")

    def check(self) -> None:
        super().check()
        positive("max_len", self.max_len)


@dataclass
class TinkerConfig:
    model: PretrainedConfig = field(default_factory=PretrainedConfig)
    template: TemplateConfig = field(default_factory=TemplateConfig)
    train: TinkerTrainConfig = field(default_factory=TinkerTrainConfig)
    serve: ServeConfig = field(default_factory=ServeConfig)
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    checkpoint: SavingConfig = field(default_factory=SavingConfig)
    logging: TrackingConfig = field(default_factory=TrackingConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
