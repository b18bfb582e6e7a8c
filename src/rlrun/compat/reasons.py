"""Why a peer flag is accepted but has no effect (one wording per reason, shared by every flag table)."""

from __future__ import annotations

RAY_ONLY = "Ray-only: rlrun runs without Ray (torchrun/srun start the processes)"
NOT_YET = "not implemented in rlrun yet; it has no effect"
LAUNCHER = "set by the launcher: torchrun/srun give every process its rank"
