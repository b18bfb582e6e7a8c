"""When each role's model sleeps and wakes (--sleep): the schedule of one rank.

The run's phase tracker announces each phase as it begins (`SleepSchedule.enter` is its hook, rlrun.runtime.phases).
On entering a phase in which this rank works, every part (parameters; optimizer states) a role needs in that phase
wakes and every other part sleeps, so a part sleeps exactly when its next use is in a later phase. A phase in which
the rank does nothing moves nothing: there is nothing to make room for. Sleeping happens before waking, so the two
never overlap in memory.

What each role needs (the trainer's phases, rlrun.rl.trainer):
    generate      the engine samples (also evaluation); no model role
    score         actor (old log-probs, unless the training forward stands in), reference, critic, reward:
                  parameters only
    train         actor: parameters and optimizer states
    train_critic  critic: parameters and optimizer states
    sync          actor: parameters (they are sent to the engines); the engine takes them
Models are built awake and left awake when training ends (the final export). Checkpoints wake what they read
for their duration (the strategies do that). Nothing here is collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from rlrun.launch.layout import Layout, Role
from rlrun.runtime.log import get_logger
from rlrun.runtime.phases import Phase
from rlrun.strategies.base import ALL_UNITS, SleepUnit, Strategy

MODEL_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)
NONE: frozenset[SleepUnit] = frozenset()
PARAMS: frozenset[SleepUnit] = frozenset({SleepUnit.PARAMS})


# The phases of a step in which models move (each of the others moves nothing; evaluation is generation's).
LOOP_PHASES = (Phase.GENERATE, Phase.SCORE, Phase.TRAIN, Phase.TRAIN_CRITIC, Phase.SYNC)
ENGINE_PHASES = frozenset({Phase.GENERATE, Phase.SYNC})
Awake = dict[Role, frozenset[SleepUnit]]  # model role -> the parts awake during a phase


def needs(actor_scores: bool) -> dict[Role, dict[Phase, frozenset[SleepUnit]]]:
    """The parts each model role uses in each phase (absent: none). `actor_scores`: the actor computes the old
    log-probs in score (False when the training forward stands in, rlrun.rl.assembly.skips_old_log_probs)."""
    actor = {Phase.TRAIN: ALL_UNITS, Phase.SYNC: PARAMS}
    if actor_scores:
        actor[Phase.SCORE] = PARAMS
    return {
        Role.ACTOR: actor,
        Role.CRITIC: {Phase.SCORE: PARAMS, Phase.TRAIN_CRITIC: ALL_UNITS},
        Role.REF: {Phase.SCORE: PARAMS},
        Role.TEACHER: {Phase.SCORE: PARAMS},
        Role.REWARD: {Phase.SCORE: PARAMS},
    }


def awake_by_phase(held: frozenset[Role], actor_scores: bool) -> dict[Phase, Awake | None]:
    """For each phase, the parts of each model role in `held` that are awake during it; None where a rank holding
    `held` works nothing in that phase (its models stay as they are)."""
    table = needs(actor_scores)
    models = [r for r in MODEL_ROLES if r in held]
    plan: dict[Phase, Awake | None] = {}
    for phase in LOOP_PHASES:
        works = (Role.ENGINE in held and phase in ENGINE_PHASES) or any(phase in table[r] for r in models)
        plan[phase] = {r: table[r].get(phase, NONE) for r in models} if works else None
    return plan


@dataclass(frozen=True)
class Sleeper:
    """One model this rank holds, with what sleeps it."""

    role: Role
    strategy: Strategy
    model: nn.Module
    optimizer: torch.optim.Optimizer | None  # None: a frozen model

    @property
    def parts(self) -> frozenset[SleepUnit]:
        return ALL_UNITS if self.optimizer is not None else PARAMS  # a frozen model has no gradients or optimizer


class SleepSchedule:
    """Moves this rank's models between awake and asleep at phase boundaries. Without sleepers (sleep off, or a
    rank with no model) `enter` does nothing."""

    def __init__(self, sleepers: list[Sleeper], plan: dict[Phase, Awake | None], rank: int) -> None:
        self.sleepers, self.plan = sleepers, plan
        self.log = get_logger(rank)
        self._told: set[tuple[Role, frozenset[SleepUnit], Phase]] = (
            set()
        )  # each kind of move is logged once, with its size

    @classmethod
    def of(
        cls, sleepers: list[Sleeper], layout: Layout, rank: int, *, actor_scores: bool, device: torch.device
    ) -> SleepSchedule:
        """The schedule of this rank's `sleepers` (the models it holds), said once for the whole layout."""
        log = get_logger(rank)
        log.info_once(describe(layout, actor_scores))
        if device.type == "cpu":
            log.info_once(
                "--sleep on CPU: the compute device is the CPU, so sleeping copies each "
                "model's tensors into host buffers and frees the originals; it saves no memory overall"
            )
        return cls(sleepers, awake_by_phase(frozenset(layout.roles_of(rank)), actor_scores), rank)

    def enter(self, phase: Phase) -> None:
        """The phase hook of the run's PhaseTracker: called as each phase begins."""
        awake = self.plan.get(Phase.GENERATE if phase is Phase.EVAL else phase)
        if awake is None:
            return
        for s in self.sleepers:  # sleep first, so that what wakes can reuse the memory
            going = s.parts - awake[s.role] - s.strategy.asleep(s.model)
            if going:
                moved = s.strategy.sleep(s.model, s.optimizer, going)
                if (s.role, going, phase) in self._told:
                    continue
                self._told.add((s.role, going, phase))
                self.log.info_once(
                    f"sleep: {s.role.value} {' and '.join(sorted(p.value for p in going))} "
                    f"({_gib(moved)} moved off the device) at {_named(phase)}"
                )
        for s in self.sleepers:
            coming = awake[s.role] & s.strategy.asleep(s.model)
            if coming:
                s.strategy.wake(s.model, s.optimizer, coming)

    def wake_all(self) -> None:
        for s in self.sleepers:
            s.strategy.wake(s.model, s.optimizer, s.strategy.asleep(s.model))


def _named(phase: Phase) -> str:
    """A phase as the schedule's lines name it: the actor's update is train_actor beside the critic's train_critic."""
    return "train_actor" if phase is Phase.TRAIN else phase.value


def _gib(nbytes: int) -> str:
    return f"{nbytes / 2**30:.3f} GiB" if nbytes >= 2**24 else f"{nbytes / 2**20:.2f} MiB"


def describe(layout: Layout, actor_scores: bool) -> str:
    """One line per distinct set of roles on a rank: when each of its models' parts is awake."""
    by_roles: dict[tuple[Role, ...], list[int]] = {}
    for rank in range(layout.world_size):
        by_roles.setdefault(tuple(layout.roles_of(rank)), []).append(rank)
    lines = [
        "--sleep: each model's parts are awake only in these phases and asleep (off the "
        "device) otherwise; ranks move nothing in a phase in which they do no work"
    ]
    for held, ranks in by_roles.items():
        plan = awake_by_phase(frozenset(held), actor_scores)
        models = [r for r in MODEL_ROLES if r in held]
        if not models:
            continue
        parts = []
        for role in models:
            for part in SleepUnit:
                phases = [_named(p) for p, awake in plan.items() if awake is not None and part in awake[role]]
                if part is SleepUnit.STATES and role in (Role.REF, Role.TEACHER, Role.REWARD):
                    continue  # frozen: parameters only
                parts.append(f"{role.value} {part.value}: {', '.join(phases) or 'never'}")
        lines.append(f"  ranks {','.join(map(str, ranks))} ({', '.join(r.value for r in held)}): " + "; ".join(parts))
    return "\n".join(lines)
