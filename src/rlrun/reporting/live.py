"""The run while it runs: throughput per device and MFU in every step's numbers, one health line per problem as it
appears, and a Prometheus endpoint (--metrics_port, rank 0) serving the numbers as each step is logged.

Throughput and MFU follow verl's names: perf/total_num_tokens (the step's prompt and response tokens),
perf/throughput (those tokens per second per device of the job) and perf/mfu/actor (the policy update's model
FLOPs, 6 x parameters x tokens, over the train phase's seconds x the actor's devices x one device's peak). The peak
is measured, not read off a datasheet: a bf16 matmul on the GPU at start-up (an H200 gives about 790 TFLOP/s of its
989 on paper). On CPU there is no MFU (a CPU has no comparable peak); the start-up line says so.

Health (`HealthWatch`): a phase much slower than its median so far, the engine-trainer log-prob gap above a bound,
a sample older than --max_staleness. Each is one warning line when it starts and one when it clears, never one a step.
"""

from __future__ import annotations

import re
import statistics
import time
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

import torch

from rlrun.config.tracking import TrackingConfig
from rlrun.runtime.errors import ConfigError

# ---- throughput and MFU -------------------------------------------------------------------------------------------


def device_peak_flops(device: torch.device) -> float | None:
    """FLOP/s of a bf16 8192 x 8192 matmul on this GPU, the median of 5 timed rounds of 10 (the first round, which
    pays the kernel selection, not counted): the peak MFU is taken against. None off a GPU."""
    if device.type != "cuda":
        return None
    n = 8192
    a, b = (torch.randn(n, n, dtype=torch.bfloat16, device=device) for _ in range(2))
    times = []
    for round_ in range(6):
        torch.cuda.synchronize(device)
        start = time.perf_counter()
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
        if round_:
            times.append(time.perf_counter() - start)
    del a, b
    return 10 * 2 * n**3 / statistics.median(times)


@dataclass(frozen=True)
class PerfBasis:
    """What a step's throughput and MFU are computed from."""

    params: int  # the policy's parameters (tied embeddings once)
    devices: int  # the job's ranks (one GPU each)
    actor_devices: int  # the ranks that train the policy
    peak_flops: float | None  # one device's measured FLOP/s; None on CPU (no MFU)


def perf_numbers(basis: PerfBasis, batch_tokens: float, step_s: float, train_s: float | None) -> dict[str, float]:
    """A step's perf/* numbers: its tokens (prompts and responses), tokens per second per device, and with a peak
    the actor's MFU over the train phase."""
    numbers = {"perf/total_num_tokens": batch_tokens, "perf/throughput": batch_tokens / step_s / basis.devices}
    if basis.peak_flops and train_s:
        numbers["perf/mfu/actor"] = 6 * basis.params * batch_tokens / (train_s * basis.actor_devices * basis.peak_flops)
    return numbers


def perf_line(basis: PerfBasis) -> str:
    """The start-up line saying what MFU is taken against."""
    if basis.peak_flops is None:
        return "MFU: none on CPU (no peak to take it against); perf/throughput counts tokens per second per rank"
    return (
        f"MFU (perf/mfu/actor) against {basis.peak_flops / 1e12:.0f} TFLOP/s per device, measured (a bf16 matmul), "
        f"for a {basis.params / 1e9:.2f}B-parameter policy on {basis.actor_devices} of {basis.devices} device(s)"
    )


# ---- health ---------------------------------------------------------------------------------------------------------

# A phase is compared with its median over this many earlier steps at most (a run's pace drifts), from the third on.
PHASE_HISTORY = 50
PHASE_MIN_HISTORY = 3
LOGPROB_GAP_KEY = "rollout/engine_vs_actor_logprob_diff"
STALENESS_KEY = "async/staleness_max"


@dataclass
class HealthWatch:
    """Rank 0's checks of each logged step; `check` returns the warning lines to print (a problem's start and its
    end, once each). `max_staleness`: --max_staleness where samples can outlive a sync (None: not checked)."""

    slow_factor: float
    logprob_gap: float
    max_staleness: int | None = None
    counts: dict[str, int] = field(default_factory=dict)  # warnings per check, for the endpoint
    _history: dict[str, list[float]] = field(default_factory=dict)
    _active: set[str] = field(default_factory=set)

    def check(self, metrics: Mapping[str, float]) -> list[str]:
        step = int(metrics.get("step", 0))
        lines: list[str] = []
        for key, seconds in metrics.items():
            if key.startswith("time/") and key != "time/step" and isinstance(seconds, (int, float)):
                lines += self._slow(step, key[len("time/") :], float(seconds))
        gap = metrics.get(LOGPROB_GAP_KEY)
        if isinstance(gap, (int, float)):
            lines += self._flag(
                "logprob_gap",
                gap > self.logprob_gap,
                f"health: step {step}: the engine's log-probs differ from the trainer's by {gap:.3g} on average "
                f"(bound {self.logprob_gap:g}, --health_logprob_gap): the engine does not sample the policy the "
                "trainer scores (a weight sync, dtype or kernel mismatch); see rollout_corr/* and --rollout_is",
                f"health: step {step}: the engine-trainer log-prob gap is back under {self.logprob_gap:g}",
            )
        stale = metrics.get(STALENESS_KEY)
        if self.max_staleness is not None and isinstance(stale, (int, float)):
            lines += self._flag(
                "staleness",
                stale > self.max_staleness,
                f"health: step {step}: a sample {stale:g} weight versions old was trained on, over --max_staleness "
                f"{self.max_staleness}",
                f"health: step {step}: sample staleness is back within --max_staleness {self.max_staleness}",
            )
        return lines

    def _slow(self, step: int, phase: str, seconds: float) -> list[str]:
        history = self._history.setdefault(phase, [])
        lines: list[str] = []
        if len(history) >= PHASE_MIN_HISTORY:
            median = statistics.median(history)
            lines = self._flag(
                f"slow_{phase}",
                self.slow_factor > 0 and median > 0 and seconds > self.slow_factor * median,
                f"health: step {step}: phase {phase} took {seconds:.2f} s, over {self.slow_factor:g}x its median "
                f"{median:.2f} s (--health_slow_factor)",
                f"health: step {step}: phase {phase} is back to its usual pace ({seconds:.2f} s)",
            )
        history.append(seconds)
        del history[:-PHASE_HISTORY]
        return lines

    def _flag(self, check: str, failing: bool, started: str, cleared: str) -> list[str]:
        if failing and check not in self._active:
            self._active.add(check)
            self.counts[check] = self.counts.get(check, 0) + 1
            return [started]
        if not failing and check in self._active:
            self._active.discard(check)
            return [cleared]
        return []


# ---- the Prometheus endpoint ---------------------------------------------------------------------------------------


def metric_name(key: str) -> str:
    """A metrics key as a Prometheus name: rlrun_ + the key with every other character than [a-zA-Z0-9_] as _."""
    return "rlrun_" + re.sub(r"[^a-zA-Z0-9_]", "_", key)


class MetricsEndpoint:
    """Rank 0's /metrics on --metrics_port (prometheus-client's own HTTP server, a daemon thread): every number of
    the last logged step as a gauge (rlrun_<key>, e.g. rlrun_reward, rlrun_perf_mfu_actor, rlrun_time_train),
    rlrun_step, each rank's memory (rlrun_memory_rss_bytes, rlrun_memory_gpu_allocated_bytes, labelled by rank),
    the health warnings so far (rlrun_health_warnings, labelled by check) and rlrun_run_info{trainer}. A scrape sees
    one step whole: each step replaces the snapshot the collector reads in one assignment."""

    def __init__(self, tracking: TrackingConfig, trainer: str) -> None:
        try:
            import prometheus_client as prom  # noqa: PLC0415 - optional extra (rlrun[metrics])
        except ImportError:
            raise ConfigError(
                "--metrics_port needs prometheus-client: pip install 'rlrun[metrics]' (or prometheus-client)"
            ) from None
        assert tracking.metrics_port is not None
        self.registry = prom.CollectorRegistry()
        prom.Info("rlrun_run", "The run's trainer.", registry=self.registry).info({"trainer": trainer})
        self.snapshot = _Snapshot()
        self.registry.register(self.snapshot)  # type: ignore[arg-type]
        try:
            self.server, self.thread = prom.start_http_server(
                tracking.metrics_port, addr=tracking.metrics_host, registry=self.registry
            )
        except OSError as exc:
            raise ConfigError(
                f"--metrics_port {tracking.metrics_port}: cannot serve on {tracking.metrics_host}:"
                f"{tracking.metrics_port} ({exc.strerror or exc}); choose a free port"
            ) from None

    @property
    def port(self) -> int:
        return int(self.server.server_port)

    def publish(self, metrics: Mapping[str, float], memory: list[tuple[float, float]], health: HealthWatch) -> None:
        """The step's numbers, each rank's (RSS, GPU allocated) bytes, the health counts: served from now on."""
        numbers = {metric_name(key): (key, value) for key, value in metrics.items()}  # a clash: the last key wins
        self.snapshot.latest = (numbers, list(memory), dict(health.counts))

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


class _Snapshot:
    """prometheus-client's custom-collector protocol over the last published step."""

    def __init__(self) -> None:
        self.latest: tuple[dict[str, tuple[str, float]], list[tuple[float, float]], dict[str, int]] = ({}, [], {})

    def describe(self) -> list[object]:
        return []  # names change as steps log new keys: nothing to check at registration

    def collect(self) -> Iterator[object]:
        from prometheus_client.core import GaugeMetricFamily  # noqa: PLC0415 - optional extra (rlrun[metrics])

        numbers, memory, warnings = self.latest  # one read: one step's numbers, whole
        for name, (key, value) in numbers.items():
            yield GaugeMetricFamily(name, f"The last logged step's {key}.", value=value)
        for kind, column in (("rss", 0), ("gpu_allocated", 1)):
            family = GaugeMetricFamily(
                f"rlrun_memory_{kind}_bytes", f"Each rank's {kind.replace('_', ' ')} memory.", labels=["rank"]
            )
            for rank, row in enumerate(memory):
                family.add_metric([str(rank)], row[column])
            yield family
        family = GaugeMetricFamily("rlrun_health_warnings", "Health warnings so far, by check.", labels=["check"])
        for check, count in warnings.items():
            family.add_metric([check], count)
        yield family


class LiveReport:
    """Rank 0's side of a run while it runs: the health watch over each step and, with --metrics_port, the endpoint.
    `max_staleness`: --max_staleness when samples outlive a weight sync (--partial_rollout), else None."""

    def __init__(self, tracking: TrackingConfig, trainer: str, max_staleness: int | None) -> None:
        self.health = HealthWatch(tracking.health_slow_factor, tracking.health_logprob_gap, max_staleness)
        self.endpoint = MetricsEndpoint(tracking, trainer) if tracking.metrics_port is not None else None

    def step(self, metrics: Mapping[str, object], memory: list[tuple[float, float]]) -> list[str]:
        """A step's health lines to print; the endpoint serves its numbers from now on."""
        numbers = {k: float(v) for k, v in metrics.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        lines = self.health.check(numbers)
        if self.endpoint is not None:
            self.endpoint.publish(numbers, memory, self.health)
        return lines

    def close(self) -> None:
        if self.endpoint is not None:
            self.endpoint.close()
