"""One run of any trainer on this rank, start to teardown: what rlrun.ppo, rlrun.sft, rlrun.rm and rlrun.dpo share.

An entry module (rlrun.ppo, rlrun.sft, rlrun.rm, rlrun.dpo) declares an `Entry`: its command line, its plan, and its
`Trainer` (rlrun.rl.assembly.PPOTrainer, rlrun.supervised.assembly.Supervised), imported once the plan holds, which
supplies what differs: what it reads before the first collective, what it builds, what it exports. `run_trainer`
does the rest, in this order:

1. the launcher's environment; the command line parsed, resolved and planned on every rank, so that a bad flag,
   value or layout is one `error:` line and exit status 2 before anything starts (and before the trainer is
   imported); `--dry_run` stops after its report (the plan, the memory plan per rank, the preflight);
2. device and collective backend; the files the run reads, on every rank before the first collective (a bad path
   fails every rank alike), under --data_timeout; rank 0 checks its output folders and says where everything goes;
3. the default group; the trainer's groups, models and loop; a resume from the newest checkpoint;
4. the steps, written out below: each step, its evaluation when due, its metrics (rank 0), a checkpoint every
   --save_steps; a preemption notice (SIGTERM, SIGUSR1: rlrun.run.preemption) heard by any rank stops the run at
   the step boundary with a checkpoint, and a requeued Slurm job resumes from it by itself;
5. the export, rank 0's summary, teardown.

Failure policy: a rank that fails prints ONE line (rank, roles, phase, step, error) and leaves at once with os._exit:
it must not wait in a collective or in process-group teardown for peers that may be gone. Peers then fail fast in
their next collective (connection closed) or at the collective timeout, print a one-line note, and leave the same
way; torchrun or srun stops the rest.
"""

from __future__ import annotations

import os
import tempfile
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Generic, Protocol, TypeVar, runtime_checkable

import torch
from torch import nn

from rlrun.checkpoint.checkpointer import Checkpointer, Contents, Identity, Part
from rlrun.checkpoint.resume import (
    can_create,
    check_ownership,
    holds_checkpoint,
    is_restart,
    preemption_dir,
    run_identity,
)
from rlrun.cli.parser import CliSpec
from rlrun.cli.run_config import write_run_config
from rlrun.config.fields import redacted
from rlrun.config.training import TrainConfig
from rlrun.config.tree import RootConfig
from rlrun.launch.dist import (
    collective_device,
    init_distributed,
    resolve_device_and_precision,
    resolve_dist_backend,
    restart_safety_warning,
    teardown,
)
from rlrun.launch.env import DistEnv
from rlrun.launch.failures import RankFailure, checked_on_every_rank, launch_environment
from rlrun.launch.transfer import all_gather_vectors, max_over
from rlrun.plan.plan import Planned
from rlrun.reporting.live import LiveReport
from rlrun.reporting.metrics import MetricsSink
from rlrun.reporting.run_report import announce
from rlrun.run.preemption import PREEMPTED_EXIT, PreemptionNotice, mark_preempted, requeued
from rlrun.runtime.errors import ConfigError
from rlrun.runtime.log import RankLogger, get_logger, quiet_third_party
from rlrun.runtime.memory import rss_bytes
from rlrun.runtime.phases import Phase, PhaseTracker, run_phases, set_reporter

P = TypeVar("P", bound=Planned[Any])  # a trainer's plan
PC = TypeVar("PC", bound=Planned[Any], contravariant=True)  # the same, where only taken
I = TypeVar("I")  # noqa: E741 - what a trainer reads before the first collective


@dataclass
class Started:
    """The process as the skeleton set it up, handed to the trainer's `read` and `build`."""

    env: DistEnv
    device: torch.device
    backend: str  # the default group's
    phase: PhaseTracker
    failure: RankFailure  # its `roles` and `local_only` are the trainer's to update (PPO's label placement)
    run_id: str
    log: RankLogger

    @property
    def comm_device(self) -> torch.device:
        """Where tensors for the default group's collectives live."""
        return collective_device(self.backend, self.device)


class Job(Protocol):
    """A trainer's loop on this rank, driven step by step by `run_trainer`; a torch Stateful the checkpointer saves
    (as trainer_state.json, rank 0)."""

    step: int  # steps done (restored with the state)
    total_steps: int

    def begin(self) -> None:
        """After the resume, before the first step."""
        ...

    def train_step(self, step: int) -> dict[str, float]:
        """Step `step` (0-based); its metrics, which rank 0 logs."""
        ...

    def evaluate(self, steps_done: int) -> dict[str, float] | None:
        """The evaluation due after `steps_done` steps (0: before training), None when none is. Collective."""
        ...

    def finish(self) -> None:
        """After the last step, before the export."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


J = TypeVar("J", bound=Job)


@runtime_checkable
class Serves(Protocol):
    """A job driven by requests instead of steps (rlrun.tinker): `serve` runs until `stopping()` (a preemption notice
    heard) says to stop, then the run ends as after its last step (finish, export, teardown)."""

    def serve(self, stopping: Callable[[], bool]) -> None: ...

    def last_words(self) -> None:
        """torchrun is stopping this process because another rank ended: what the job's clients must still be told
        before it goes (bounded, inside run.preemption.LAST_WORDS_S)."""
        ...


@dataclass
class Built(Generic[J]):
    """What a trainer built on this rank: its loop, and what its checkpoints hold."""

    job: J
    identity: Identity
    parts: list[Part]  # this rank's pieces of a checkpoint, besides the job's own state
    group: torch.distributed.ProcessGroup  # every rank: the checkpoint's collectives
    trained: list[nn.Module] = field(default_factory=list)  # this rank's trained models (a checkpoint's bulk)


class Entry(Protocol[P, I, J]):
    """What an entry module (rlrun.ppo, sft, rm, dpo) declares: its command line, its plan, and how to import its
    trainer. The plan runs first, on every rank, with little imported (torch, rlrun's config and plan), so that a
    bad flag, value or layout fails in about a second; the trainer's modules (transformers' models, DeepSpeed, the
    roles: seconds) are imported after it holds."""

    @property
    def cli(self) -> CliSpec: ...

    @property
    def name(self) -> str:
        """ "ppo" | "sft" | "rm" | "dpo": its checkpoints', trackers' and failure lines' name."""
        ...

    def plan(self, argv: Sequence[str] | None, env: DistEnv) -> P:
        """Parse, resolve (hub ids, presets, adapters) and check everything that needs no file read beyond the
        models' config.json; raise the run's RlrunError on what would fail. Every rank, before anything starts."""
        ...

    def trainer(self) -> Trainer[P, I, J]:
        """The trainer (imports it)."""
        ...


class Trainer(Protocol[PC, I, J]):
    """What a trainer supplies to the skeleton once its plan holds."""

    def memory(self, planned: PC, env: DistEnv) -> tuple[list[str], list[str]]:
        """--dry_run's memory plan: (its lines, its problems); rank 0 writes --plan_json."""
        ...

    def preflight(self, planned: PC) -> list[str]:
        """--dry_run: what the job reads first (data, chat template, reward file), read now; one line per thing."""
        ...

    def read(self, planned: PC, started: Started) -> I:
        """The files the run reads (tokenizer, data), before the first collective (the skeleton bounds it by
        --data_timeout)."""
        ...

    def announce(self, planned: PC, inputs: I, env: DistEnv) -> list[str]:
        """Rank 0's start-up lines before the ones saying where everything goes."""
        ...

    def build(self, planned: PC, inputs: I, started: Started) -> Built[J]:
        """The trainer's groups, models and loop, once the default group exists."""
        ...

    def export(self, planned: PC, inputs: I, built: Built[J]) -> dict[str, str]:
        """Save the trained model(s) (collective); what was saved where, for the summary."""
        ...


def run_trainer(entry: Entry[P, I, J], argv: Sequence[str] | None = None) -> int:
    """Run `entry`'s trainer with the command line `argv` on this rank; the process's exit status."""
    env = launch_environment()
    if env is None:
        return 2
    log = get_logger(env.rank)
    quiet_third_party(env.rank)  # before the hub downloads of plan()
    planned = checked_on_every_rank(env, lambda: entry.plan(argv, env))
    if planned is None:
        return 2
    trainer = checked_on_every_rank(env, entry.trainer)
    if trainer is None:
        return 2
    if planned.config.runtime.dry_run:
        return dry_run(trainer, planned, env, log)
    for line in planned.warnings:
        log.warning_once(line)
    cfg = planned.config
    started_s = time.monotonic()
    phase = run_phases(env.rank, cfg.runtime.dist_timeout)
    failure = RankFailure(log, env.rank, planned.roles, phase, cfg.runtime.dist_timeout)
    set_reporter(failure.exit)  # a bound that passes (a hung reward function, a dataset that never loads) ends so
    notice = PreemptionNotice(env.rank)
    notice.install()  # from now on: a notice during start-up stops the run after its first step
    sink = None
    live: LiveReport | None = None  # rank 0: health lines and the --metrics_port endpoint
    preempted: Preempted | None = None  # when a notice stopped the run
    try:
        device = resolve_device_and_precision(cfg.runtime.device, env.local_rank, cfg.runtime.tf32)
        backend = resolve_dist_backend(cfg.runtime.dist_backend, device, cpu_collectives=cfg.train.reduces_on_cpu)
        started = Started(env, device, backend, phase, failure, run_identity(), log)
        inputs = trainer.read(planned, started)
        if env.rank == 0:  # the writer: a bad output path must fail now, not at the end of training
            check_outputs(cfg, started.run_id, log)
            launched = f"world size {env.world_size}, launcher {env.launcher}"
            config, count = write_run_config(
                cfg, entry.cli.defaults, cfg.checkpoint.save_path, entry.cli.prog, launched
            )
            for line in (
                *trainer.announce(planned, inputs, env),
                *announce(cfg.model, cfg.checkpoint, cfg.logging, entry.cli.prog, config, count),
            ):
                log.info_once(line)
            live = LiveReport(cfg.logging, entry.name, staleness_bound(cfg))  # a taken port fails here, early
            if live.endpoint is not None:
                host, port = cfg.logging.metrics_host, live.endpoint.port
                log.info_once(f"metrics: Prometheus text on http://{host}:{port}/metrics while the run runs")
        failure.local_only = False  # from the first collective on, a failure may be this rank's alone
        if (warning := restart_safety_warning(env)) is not None:
            log.warning_once(warning)
        init_distributed(env, backend, cfg.runtime.dist_timeout, os.path.join(cfg.checkpoint.save_path, "nccl_trace"))
        phase.set(Phase.BUILD)
        built = trainer.build(planned, inputs, started)
        job = built.job
        c = cfg.checkpoint
        # A run that saves no checkpoints (--save_steps -1, OpenRLHF's default) still saves one when a preemption
        # notice stops it, in a directory of its own under --ckpt_path: the requeued job resumes from it, and
        # nothing there is another run's
        own = (
            c
            if c.save_steps > 0 or c.load_checkpoint
            else replace(c, ckpt_path=preemption_dir(c.ckpt_path, started.run_id))
        )
        checkpointer = Checkpointer(
            own,
            Contents(built.identity, job, built.parts, built.trained),
            config=redacted(cfg),
            run_id=started.run_id,
            world_size=env.world_size,
            group=built.group,
            device=started.comm_device,
            timeout_s=cfg.runtime.dist_timeout,
        )
        # A requeued job resumes by itself from what it saved (with --save_steps -1: only what a preemption saved)
        restarts = requeued()
        resumes = c.load_checkpoint or restarts > 0
        if restarts and not c.load_checkpoint and env.rank == 0:
            log.info_once(
                f"Slurm requeued this job ({restarts} time(s)): "
                + (
                    f"resuming from {checkpointer.root}"
                    if checkpointer.saves or holds_checkpoint(checkpointer.root)
                    else "--save_steps -1, and no preemption saved a checkpoint of this job: starting over"
                )
            )
        if resumes:
            with phase(Phase.LOAD, -1):
                checkpointer.restore()
        job.begin()
        sink = (
            MetricsSink(
                cfg.logging, cfg.checkpoint, job.total_steps, job.step, trainer=entry.name, config=redacted(cfg)
            )
            if env.rank == 0
            else None
        )
        failure.sink = sink
        # The steps. A checkpoint's steps come with their evaluations (evaluated before it is saved).
        evals = job.evaluate(0) if job.step == 0 else None
        if sink is not None and evals is not None:
            sink.log_eval(0, evals)
        if isinstance(job, Serves):  # the request-driven loop instead of the steps
            notice.last_words = job.last_words
            job.serve(lambda: notice.heard)
        for step in range(job.step, job.total_steps):
            metrics = job.train_step(step)
            watched = memory_per_rank(built.group, started.comm_device) if cfg.logging.metrics_port is not None else []
            if live is not None:
                for line in live.step(metrics, watched):
                    log.warning_once(line)
            evals = job.evaluate(step + 1)
            if sink is not None and (step + 1) % cfg.logging.logging_steps == 0:
                sink.log(metrics, evals)
            elif sink is not None and evals is not None:
                sink.log_eval(step + 1, evals)
            saving = checkpointer.should_save(step + 1, job.total_steps)
            if saving:
                with phase(Phase.SAVE, step):
                    checkpointer.save(step + 1)
            # One small all-reduce a step (after the save, which a notice may come during): the ranks hear a notice
            # at different moments, and all must stop together
            stop = step + 1 < job.total_steps and max_over(int(notice.heard), built.group, device) > 0
            if stop and not saving and (checkpointer.saves or notice_savable(checkpointer.root, built.group, device)):
                with phase(Phase.SAVE, step):
                    checkpointer.save(step + 1)
                saving = True
            if stop:
                resume = (
                    "--load_checkpoint"
                    if checkpointer.root == c.ckpt_path
                    else f"--load_checkpoint --ckpt_path {checkpointer.root}"
                )
                preempted = Preempted(step + 1, checkpointer.step_dir(step + 1) if saving else None, resume)
                break
        if preempted is None:
            job.finish()
            with phase(Phase.SAVE, job.step):
                saved = trainer.export(planned, inputs, built)
        else:
            stop_preempted(notice, preempted, sink, log, time.monotonic() - started_s)
            # No rank leaves before rank 0's report and marker exist: a launcher (srun --kill-on-bad-exit) may end
            # the whole job when the first process exits.
            max_over(0, built.group, device)
    except BaseException as exc:  # noqa: BLE001 - every failure ends in the same one-line report
        failure.exit(exc)
    if live is not None:
        live.close()
    if preempted is not None:
        teardown()
        # torchrun restarts workers that exit with a status other than 0 (unless it is stopping itself)
        return 0 if "TORCHELASTIC_RESTART_COUNT" in os.environ else PREEMPTED_EXIT
    if sink is not None:  # rank 0's summary reads the metrics it logged
        sink.finish(log, saved, time.monotonic() - started_s)
    teardown()
    return 0


@dataclass(frozen=True)
class Preempted:
    """How a notice stopped the run: after `steps` steps, with the checkpoint saved then (None: none could be), which
    the same command with `resume` continues."""

    steps: int
    checkpoint: str | None
    resume: str


def notice_savable(root: str, group: torch.distributed.ProcessGroup, device: torch.device) -> bool:
    """Whether every rank can create a run's preemption checkpoint under `root` (--save_steps -1 runs, which did not
    check --ckpt_path at start-up: a notice then stops the run without one rather than failing it)."""
    return max_over(int(not can_create(root)), group, device) == 0


def stop_preempted(
    notice: PreemptionNotice,
    preempted: Preempted,
    sink: MetricsSink | None,
    log: RankLogger,
    wall_s: float,
) -> None:
    """After a preemption notice stopped the run at a step boundary, rank 0 (the one with the metrics `sink`) says
    so and how it resumes, and writes the summary and the marker file the Slurm script requeues on."""
    steps, checkpoint = preempted.steps, preempted.checkpoint
    if sink is not None:
        heard = notice.signal or "a notice on another rank"
        if checkpoint is not None:
            resume = f"checkpoint {checkpoint}; the same command with {preempted.resume} resumes it"
        else:
            resume = "no checkpoint (--ckpt_path is not writable on every rank): a restart begins again"
        log.warning_once(
            f"preempted ({heard}) after step {steps}: {resume} (a requeued Slurm job resumes by itself); "
            f"exit status {PREEMPTED_EXIT} (0 under torchrun, which would restart workers that exit otherwise)"
        )
        mark_preempted(steps, checkpoint)
        sink.finish(log, {"checkpoint": checkpoint} if checkpoint else {}, wall_s, outcome="preempted")


def dry_run(trainer: Trainer[P, I, J], planned: P, env: DistEnv, log: RankLogger) -> int:
    """--dry_run: the plan (the role layout), the memory plan per rank, the warnings, the preflight; no process group,
    no weights. The exit status: 0, or 2 once a check's error is printed."""
    for line in planned.notes:
        log.info_once(line)
    memory = checked_on_every_rank(env, lambda: trainer.memory(planned, env))
    if memory is None:
        return 2
    lines, problems = memory
    for line in lines:
        log.info_once(line)
    for line in (*problems, *planned.warnings):
        log.warning_once(line)
    checked = checked_on_every_rank(env, lambda: trainer.preflight(planned))
    for line in checked or ():
        log.info_once(line)
    return 0 if checked is not None else 2


def staleness_bound(cfg: RootConfig) -> int | None:
    """--max_staleness where samples outlive a weight sync (rlrun.ppo --partial_rollout), for the health lines."""
    train = cfg.train
    return train.max_staleness if isinstance(train, TrainConfig) and train.continues_rollouts else None


def memory_per_rank(group: torch.distributed.ProcessGroup, device: torch.device) -> list[tuple[float, float]]:
    """Each rank's (resident set, CUDA allocator's allocated) bytes, on every rank: one small all-gather a step,
    only with --metrics_port."""
    gpu = torch.cuda.memory_allocated() if torch.cuda.is_available() and torch.cuda.is_initialized() else 0
    local = torch.tensor([float(rss_bytes() or 0), float(gpu)], dtype=torch.float64, device=device)
    return [(float(rss), float(alloc)) for rss, alloc in all_gather_vectors(local, group).cpu().tolist()]


def check_outputs(cfg: RootConfig, run_id: str, log: RankLogger) -> None:
    """Rank 0 (the writer), before anything expensive: the output paths are writable, and checkpoints will not
    be written over another run's (rlrun.checkpoint.resume)."""
    saving = cfg.checkpoint
    check_writable(saving.save_path, "--save_path")
    if saving.save_steps > 0:
        check_writable(saving.ckpt_path, "--ckpt_path")
        replacing = check_ownership(
            saving.ckpt_path,
            run_id,
            loads=saving.load_checkpoint or requeued() > 0,
            overwrites=saving.overwrite_checkpoints,
            restarted=is_restart(),
        )
        if replacing:
            log.warning_once(replacing)


def check_writable(path: str, flag: str) -> None:
    try:
        os.makedirs(path, exist_ok=True)
        with tempfile.TemporaryFile(dir=path, prefix=".rlrun_write_test_"):
            pass
    except OSError as exc:
        raise ConfigError(
            f"{flag} {path} is not a writable directory ({exc.strerror or exc}); "
            "choose a directory this user can create and write"
        ) from None
