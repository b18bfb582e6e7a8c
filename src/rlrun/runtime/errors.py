"""Exception types. Each message names the offending value and how to fix it."""


class RlrunError(Exception):
    """Base class for errors rlrun reports as one clear message and a non-zero exit."""


class ConfigError(RlrunError, ValueError):
    """A flag, YAML key or value is invalid. Raised before anything expensive starts."""


class LayoutError(RlrunError, ValueError):
    """The requested role layout does not fit the world size / ranks per node."""


class DataError(RlrunError, ValueError):
    """The prompt dataset is missing, empty, or lacks a requested key."""


class RewardError(RlrunError):
    """A reward source failed: import error, exception, wrong length/type, NaN, HTTP failure."""


class AgentError(RlrunError):
    """A multi-turn agent failed: its file, an exception in reset()/step(), a malformed result, a timeout."""


class MissingExtraError(RlrunError, ImportError):
    """An optional dependency (vllm, deepspeed, flash-attn, wandb, ...) is not installed."""

    def __init__(self, package: str, extra: str, feature: str) -> None:
        super().__init__(
            f"{feature} needs the optional package '{package}', which is not installed. "
            f"Install it with: pip install 'rlrun[{extra}]'"
        )
        self.package = package
        self.extra = extra


class StorageError(RlrunError):
    """The disk refused a write: full, over quota, read-only, no permission. The message names the path, the
    system's reason and the space needed."""


class NonFiniteError(RlrunError):
    """A model's weights or outputs are NaN/inf: the run diverged (or loaded damaged weights)."""
