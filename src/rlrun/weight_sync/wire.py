"""What both sides of a weight sync agree on: the wire format, the gather scratch, and the check that what arrived
is what was sent (verl's issue 7495, a LoRA sync that silently sent nothing, is why there is one)."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

import torch

from rlrun.runtime.errors import RlrunError
from rlrun.strategies.blocks import GatherScratch


@dataclass(frozen=True)
class WireFormat:
    """How a sync goes on the wire: buckets of at most `bucket_bytes` in `dtype` (the engines'), broadcast in chunks
    of about `chunk_bytes`; `together`: from the parameter names, the groups the engine runs as one tensor
    (rlrun.engines.native.decoder's fused_groups), kept back to back in the buckets so that its receive buffers hold
    them that way."""

    bucket_bytes: int
    dtype: torch.dtype
    chunk_bytes: int = 16 * 2**20
    together: Callable[[list[str]], Sequence[Sequence[str]]] | None = None
    delta: bool = False  # --weight_sync_delta: after the first sync, each part's changed elements (many senders)


@dataclass
class Traffic:
    """Bytes this rank put on the wire and took off it in its last sync."""

    sent: int = 0
    received: int = 0


def scratch_for(device: torch.device) -> GatherScratch | None:
    """The gather scratch a sync keeps for its lifetime: on CPU one (a fresh buffer per sync costs page faults); on
    an accelerator none (the caching allocator reuses the memory, and holding a unit's gather buffer through
    training would cost memory there), so each sync makes its own."""
    return GatherScratch() if device.type == "cpu" else None


def checksum(t: torch.Tensor) -> float:
    return float(t.detach().double().sum())


def verify(sent: Mapping[str, float], got: Mapping[str, float]) -> None:
    """The engine's copies of the checked parameters sum as the actor's sent tensors did."""
    for name, expected in sent.items():
        got_sum = got[name]
        if not math.isclose(got_sum, expected, rel_tol=1e-6, abs_tol=1e-6):
            raise RlrunError(
                f"weight sync: after the sync the engine's {name} sums to {got_sum:.6g} but the actor "
                f"sent {expected:.6g}: the engine did not receive the actor's weights"
            )
