"""Sleep without processes: parking storages in place (rlrun.strategies.parking) and the per-rank schedule
(rlrun.rl.sleep), against hand-written tables."""

from __future__ import annotations

import pytest
import torch

from rlrun.config.tree import Config
from rlrun.plan.checks import check_values
from rlrun.launch.layout import Role
from rlrun.rl.sleep import SleepSchedule, Sleeper, awake_by_phase
from rlrun.runtime.phases import Phase
from rlrun.runtime.errors import ConfigError, RlrunError
from rlrun.strategies.base import SleepUnit
from rlrun.strategies.parking import ParkedStorages, SleepBook, device_storages, held_bytes

CPU = torch.device("cpu")
P, S = SleepUnit.PARAMS, SleepUnit.STATES
BOTH, PARAMS, NONE = frozenset({P, S}), frozenset({P}), frozenset()


# ---- parking ------------------------------------------------------------------------------------------------


def test_parking_frees_every_storage_once_and_restores_views_and_aliases_bit_for_bit():
    flat = torch.arange(10, dtype=torch.float32)  # 40 bytes, like a DeepSpeed flat buffer ...
    a, b = flat[:6].view(2, 3), flat[6:]  # ... with parameter views into it
    tied = torch.full((4,), 7, dtype=torch.int64)  # 32 bytes, held twice (tied weights)
    empty = torch.empty(0)
    tensors = [a, b, flat, tied, tied.view(2, 2), empty]
    assert held_bytes(tensors, CPU) == 40 + 32  # shared storages count once, the empty one not at all
    parked = ParkedStorages(device_storages(tensors, CPU).values(), CPU)
    assert parked.nbytes == 72
    assert held_bytes(tensors, CPU) == 0
    assert flat.untyped_storage().nbytes() == 0 and a.untyped_storage().nbytes() == 0
    parked.restore()
    assert held_bytes(tensors, CPU) == 72
    assert a.tolist() == [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]] and b.tolist() == [6.0, 7.0, 8.0, 9.0]
    assert tied.tolist() == [7, 7, 7, 7]
    a[0, 0] = 100.0  # still a view of the same storage after the round trip
    assert flat[0] == 100.0


def test_storages_on_another_device_are_left_alone():
    on_meta = torch.empty(3, device="meta")
    assert device_storages([on_meta], CPU) == {}


def test_book_keeps_the_other_part_and_guards_the_sleeping_one():
    model = torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    weights = [p.detach().clone() for p in model.parameters()]
    momentum = [opt.state[p]["momentum_buffer"].clone() for p in model.parameters()]
    book = SleepBook(CPU)
    states = [p.grad for p in model.parameters()] + [opt.state[p]["momentum_buffer"] for p in model.parameters()]
    # A STATES list that also names a parameter (as a DeepSpeed wrapper's attributes do): the parameter stays.
    moved = book.sleep(model, S, states + [model.weight], list(model.parameters()), model, opt)
    assert moved == 2 * (16 + 8)  # grads and momentum of a 2x2 weight and a 2-bias, float32
    assert model.weight.untyped_storage().nbytes() == 16
    model(torch.ones(1, 2))  # parameters are awake: forward is fine
    with pytest.raises(RlrunError, match="optimizer step ran on a model whose optimizer state is asleep"):
        opt.step()
    assert book.sleep(model, S, states, [], model, opt) == 0  # already asleep: nothing moves
    assert book.sleep(model, P, list(model.parameters()), [], model, opt) == 16 + 8
    assert book.asleep(model) == BOTH
    with pytest.raises(RlrunError, match="forward pass ran on a model whose parameters are asleep"):
        model(torch.ones(1, 2))
    with pytest.raises(RlrunError, match="weight sync needs the model's parameters"):
        book.require_awake(model, P, "weight sync")
    assert book.wake(model, P) == 24 and book.wake(model, S) == 48 and book.wake(model, S) == 0
    assert all(torch.equal(p, w) for p, w in zip(model.parameters(), weights))
    assert all(torch.equal(opt.state[p]["momentum_buffer"], m) for p, m in zip(model.parameters(), momentum))
    model(torch.ones(1, 2)).sum().backward()  # guards are gone
    opt.step()


# ---- the schedule -------------------------------------------------------------------------------------------


def test_plan_when_every_role_shares_the_rank():
    """--colocate_all_models: peak = one role's full footprint (plus the parameters the phase reads)."""
    plan = awake_by_phase(frozenset({Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD, Role.ENGINE}), actor_scores=True)
    A, C, R, W = Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD
    assert plan == {
        Phase.GENERATE: {A: NONE, C: NONE, R: NONE, W: NONE},
        Phase.SCORE: {A: PARAMS, C: PARAMS, R: PARAMS, W: PARAMS},
        Phase.TRAIN: {A: BOTH, C: NONE, R: NONE, W: NONE},
        Phase.TRAIN_CRITIC: {A: NONE, C: BOTH, R: NONE, W: NONE},
        Phase.SYNC: {A: PARAMS, C: NONE, R: NONE, W: NONE},
    }


def test_plan_of_ranks_that_work_in_few_phases():
    # The actor alone (engines elsewhere): generate and train_critic are not its business, nothing moves then.
    actor_only = awake_by_phase(frozenset({Role.ACTOR}), actor_scores=True)
    assert actor_only == {Phase.GENERATE: None, Phase.SCORE: {Role.ACTOR: PARAMS}, Phase.TRAIN: {Role.ACTOR: BOTH},
                          Phase.TRAIN_CRITIC: None, Phase.SYNC: {Role.ACTOR: PARAMS}}
    # GRPO with the KL as a loss, one mini-batch: the training forward gives the old log-probs, no actor in score.
    grpo = awake_by_phase(frozenset({Role.ACTOR, Role.REF, Role.ENGINE}), actor_scores=False)
    assert grpo[Phase.SCORE] == {Role.ACTOR: NONE, Role.REF: PARAMS}
    assert grpo[Phase.GENERATE] == {Role.ACTOR: NONE, Role.REF: NONE}
    assert grpo[Phase.TRAIN_CRITIC] is None
    # The reward model on ranks of its own: awake in score, and it never has a reason to sleep.
    assert awake_by_phase(frozenset({Role.REWARD}), actor_scores=True) == {
        Phase.GENERATE: None, Phase.SCORE: {Role.REWARD: PARAMS}, Phase.TRAIN: None, Phase.TRAIN_CRITIC: None,
        Phase.SYNC: None}
    # An engine alone holds no model: it works in generate and sync, with nothing to move.
    assert awake_by_phase(frozenset({Role.ENGINE}), actor_scores=True) == {
        Phase.GENERATE: {}, Phase.SCORE: None, Phase.TRAIN: None, Phase.TRAIN_CRITIC: None, Phase.SYNC: {}}


class _Recorder:
    """A strategy stand-in that records sleep/wake calls."""

    def __init__(self, log: list) -> None:
        self.log, self.state = log, {}

    def asleep(self, model):
        return self.state.get(id(model), frozenset())

    def sleep(self, model, optimizer, parts):
        self.log.append(("sleep", model.name, frozenset(parts)))
        self.state[id(model)] = self.asleep(model) | parts
        return 0

    def wake(self, model, optimizer, parts):
        if parts:
            self.log.append(("wake", model.name, frozenset(parts)))
        self.state[id(model)] = self.asleep(model) - parts
        return 0


class _Model(torch.nn.Module):
    def __init__(self, name: str) -> None:
        super().__init__()
        self.name = name


def test_schedule_sleeps_before_it_wakes_and_moves_each_part_once_per_change():
    calls: list = []
    rec = _Recorder(calls)
    actor, ref = _Model("actor"), _Model("ref")
    sleepers = [Sleeper(Role.ACTOR, rec, actor, torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)),  # type: ignore[arg-type]
                Sleeper(Role.REF, rec, ref, None)]  # type: ignore[arg-type]
    schedule = SleepSchedule(sleepers, awake_by_phase(frozenset({Role.ACTOR, Role.REF, Role.ENGINE}), True), rank=1)
    for phase in (Phase.SYNC, Phase.GENERATE, Phase.SCORE, Phase.TRAIN, Phase.TRAIN_CRITIC, Phase.SYNC,
                  Phase.GENERATE):
        schedule.enter(phase)
    assert calls == [
        ("sleep", "actor", frozenset({S})), ("sleep", "ref", PARAMS),  # sync: the actor's parameters only
        ("sleep", "actor", PARAMS),  # generate: everything off
        ("wake", "actor", PARAMS), ("wake", "ref", PARAMS),  # score
        ("sleep", "ref", PARAMS), ("wake", "actor", frozenset({S})),  # train_actor: sleep first, then wake
        # train_critic: no critic on this rank, nothing moves
        ("sleep", "actor", frozenset({S})),  # sync
        ("sleep", "actor", PARAMS),  # generate
    ]
    schedule.wake_all()
    assert calls[-2:] == [("wake", "actor", BOTH), ("wake", "ref", PARAMS)]


def test_a_lora_base_reference_sleeps_as_the_actor_it_is():
    """--lora_rank with a KL term: the reference is the actor's model with its adapters off, and the rank has no
    reference strategy; the schedule holds the actor once (it used to list the reference as a model `False` and fail
    with KeyError: Role.REF under --deepspeed_enable_sleep)."""
    from types import SimpleNamespace

    from rlrun.launch.layout import LayoutRequest
    from rlrun.plan.placement import plan_layout
    from rlrun.rl.assembly import sleep_schedule
    from rlrun.rl.trainer import RankRoles

    layout = plan_layout(LayoutRequest(need_critic=False, need_ref=False, need_reward=False, ref_is_actor_base=True), 1, 1)
    model = _Model("actor")
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.ones(1))], lr=1)
    actor = SimpleNamespace(model=model, updater=SimpleNamespace(optimizer=optimizer))
    reference = SimpleNamespace(model=model, adapters_off=True)
    roles = RankRoles(actor=actor, reference=reference, strategies={Role.ACTOR: _Recorder([])})  # type: ignore[arg-type]
    schedule = sleep_schedule(layout, 0, roles, CPU, actor_scores=True)
    assert [(s.role, s.model) for s in schedule.sleepers] == [(Role.ACTOR, model)]


def test_sleep_off_means_no_schedule():
    schedule = SleepSchedule([], {}, rank=0)
    schedule.enter(Phase.GENERATE)  # no plan, no sleepers: nothing happens
    schedule.wake_all()


def test_deepspeed_zero3_sleep_is_refused_before_anything_starts():
    cfg = Config()
    cfg.train.sleep, cfg.train.strategy, cfg.train.zero_stage = True, "deepspeed", 3
    with pytest.raises(ConfigError, match=r"--sleep \(OpenRLHF's --deepspeed_enable_sleep\) with --strategy deepspeed --zero_stage 3 is not "
                                          "supported.*use --zero_stage 1 or 2, or --strategy fsdp --zero_stage 3"):
        check_values(cfg)
    cfg.train.strategy = "fsdp"  # FSDP2 ZeRO-3 sleeps
    check_values(cfg)
    cfg.train.strategy, cfg.train.zero_stage = "deepspeed", 2
    check_values(cfg)
