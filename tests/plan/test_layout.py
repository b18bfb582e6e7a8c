"""Tests for rlrun.launch.layout and layout_plan: exact rank placement, groups, warnings and every error."""

from __future__ import annotations

import dataclasses
import re

import pytest

from rlrun.launch.layout import GroupSpec, Layout, LayoutRequest, Role, RoleRequest
from rlrun.plan.placement import plan_layout
from rlrun.launch.layout import format_layout_table
from rlrun.runtime.errors import LayoutError

A, C, RF, RW, E = Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD, Role.ENGINE


def rr(gpus: int, nodes: int | None = None) -> RoleRequest:
    return RoleRequest(num_nodes=nodes, gpus_per_node=gpus)


def span(start: int, stop: int) -> tuple[int, ...]:
    return tuple(range(start, stop))


def check_invariants(layout: Layout) -> None:
    """Properties every valid layout has, whatever the request."""
    world = span(0, layout.world_size)
    assert layout.groups[0] == GroupSpec("world", world)
    names = [g.name for g in layout.groups]
    assert len(names) == len(set(names))
    assert {r for ranks in layout.roles.values() for r in ranks} == set(world)
    for ranks in layout.roles.values():
        assert ranks == tuple(sorted(ranks)) and ranks
    assert tuple(r for e in layout.engines for r in e) == layout.ranks_of(E)
    assert len({len(e) for e in layout.engines}) == 1
    actor, engine = set(layout.ranks_of(A)), set(layout.ranks_of(E))
    assert engine == actor or not engine & actor
    assert ("sync" in names) == (not layout.engine_colocated_with_actor)
    for rank in world:
        assert layout.roles_of(rank)
        assert layout.group_names_of(rank)[0] == "world"


# (request, world_size, ranks_per_node, expected roles, expected engines)
CASES = {
    "world1-auto": (LayoutRequest(), 1, 1, {A: (0,), C: (0,), RF: (0,), RW: (0,), E: (0,)}, ((0,),)),
    "world2-auto-2nodes": (LayoutRequest(need_teacher=True), 2, 1, {r: (0, 1) for r in Role}, ((0,), (1,))),
    "world3-auto-grpo": (
        LayoutRequest(need_critic=False, need_reward=False), 3, 3,
        {A: (0, 1, 2), RF: (0, 1, 2), E: (0, 1, 2)}, ((0,), (1,), (2,)),
    ),
    "world4-auto-tp2": (LayoutRequest(vllm_tensor_parallel_size=2, need_teacher=True), 4, 2, {r: span(0, 4) for r in Role}, ((0, 1), (2, 3))),
    "world8-auto-tp4-noref": (
        LayoutRequest(need_ref=False, need_reward=False, vllm_tensor_parallel_size=4), 8, 8,
        {A: span(0, 8), C: span(0, 8), E: span(0, 8)}, (span(0, 4), span(4, 8)),
    ),
    "world16-auto-actor-only": (
        LayoutRequest(need_critic=False, need_ref=False, need_reward=False, vllm_tensor_parallel_size=8), 16, 8,
        {A: span(0, 16), E: span(0, 16)}, (span(0, 8), span(8, 16)),
    ),
    "world4-actor2-ref1-engine1": (
        LayoutRequest(actor=rr(2), ref=rr(1), vllm_num_engines=1, need_critic=False, need_reward=False), 4, 4,
        {A: (0, 1), RF: (2,), E: (3,)}, ((3,),),
    ),
    "world8-openrlhf-split": (
        LayoutRequest(actor=rr(2), critic=rr(2), ref=rr(2), reward=rr(1), vllm_num_engines=1), 8, 8,
        {A: (0, 1), RF: (2, 3), C: (4, 5), RW: (6,), E: (7,)}, ((7,),),
    ),
    "world8-colocate-pairs-tp2": (
        LayoutRequest(actor=rr(4), ref=rr(4), critic=rr(2), reward=rr(2), vllm_num_engines=1,
                      vllm_tensor_parallel_size=2, colocate_actor_ref=True, colocate_critic_reward=True), 8, 4,
        {A: span(0, 4), RF: span(0, 4), C: (4, 5), RW: (4, 5), E: (6, 7)}, ((6, 7),),
    ),
    "world8-colocate-actor-ref-sized-by-ref-engine-on-actor": (
        LayoutRequest(ref=rr(4), critic=rr(4), need_reward=False, vllm_tensor_parallel_size=2,
                      colocate_actor_ref=True), 8, 4,
        {A: span(0, 4), RF: span(0, 4), C: span(4, 8), E: span(0, 4)}, ((0, 1), (2, 3)),
    ),
    "world8-colocate-critic-reward-sized-by-reward": (
        LayoutRequest(actor=rr(4), reward=rr(2), vllm_num_engines=2, colocate_critic_reward=True), 8, 8,
        {A: span(0, 4), RF: span(0, 4), C: (4, 5), RW: (4, 5), E: (6, 7)}, ((6,), (7,)),
    ),
    "world8-colocate-critic-reward-unsized-share-actor": (
        LayoutRequest(actor=rr(6), vllm_num_engines=1, vllm_tensor_parallel_size=2,
                      colocate_critic_reward=True), 8, 8,
        {A: span(0, 6), C: span(0, 6), RF: span(0, 6), RW: span(0, 6), E: (6, 7)}, ((6, 7),),
    ),
    "world8-colocate-all-tp2": (
        LayoutRequest(vllm_tensor_parallel_size=2, colocate_all_models=True, actor=rr(8), need_teacher=True), 8, 8,
        {r: span(0, 8) for r in Role}, ((0, 1), (2, 3), (4, 5), (6, 7)),
    ),
    "world8-colocate-all-engines-given-tp2": (
        LayoutRequest(vllm_num_engines=4, vllm_tensor_parallel_size=2, colocate_all_models=True,
                      critic=rr(4, nodes=2), need_reward=False), 8, 4,
        {A: span(0, 8), C: span(0, 8), RF: span(0, 8), E: span(0, 8)}, ((0, 1), (2, 3), (4, 5), (6, 7)),
    ),
    "world4-unsized-roles-share-actor": (
        LayoutRequest(actor=rr(2), vllm_num_engines=2), 4, 2,
        {A: (0, 1), C: (0, 1), RF: (0, 1), RW: (0, 1), E: (2, 3)}, ((2,), (3,)),
    ),
    "world4-engines-only-actor-takes-rest": (
        LayoutRequest(vllm_num_engines=1, need_critic=False), 4, 4,
        {A: (0, 1, 2), RF: (0, 1, 2), RW: (0, 1, 2), E: (3,)}, ((3,),),
    ),
    "world16-actor-takes-remainder": (
        LayoutRequest(critic=rr(4), ref=rr(2), reward=rr(2), vllm_num_engines=2, vllm_tensor_parallel_size=2), 16, 8,
        {A: span(0, 4), RF: (4, 5), C: span(6, 10), RW: (10, 11), E: span(12, 16)}, ((12, 13), (14, 15)),
    ),
    "world16-multinode-actor": (
        LayoutRequest(actor=rr(8, nodes=2), need_critic=False, need_ref=False, need_reward=False,
                      vllm_tensor_parallel_size=4), 16, 8,
        {A: span(0, 16), E: span(0, 16)}, (span(0, 4), span(4, 8), span(8, 12), span(12, 16)),
    ),
    "world2-engine-on-actor-explicit": (
        LayoutRequest(actor=rr(1), critic=rr(1), need_ref=False, need_reward=False), 2, 1,
        {A: (0,), C: (1,), E: (0,)}, ((0,),),
    ),
    # the distillation teacher: after the reference, on its own ranks, or the actor's (colocated or unsized)
    "world8-teacher-own-block": (
        LayoutRequest(actor=rr(2), ref=rr(2), teacher=rr(2), need_critic=False, need_reward=False, need_teacher=True,
                      vllm_num_engines=2), 8, 8,
        {A: (0, 1), RF: (2, 3), Role.TEACHER: (4, 5), E: (6, 7)}, ((6,), (7,)),
    ),
    "world4-teacher-colocated": (
        LayoutRequest(actor=rr(2), need_critic=False, need_ref=False, need_reward=False, need_teacher=True,
                      colocate_actor_teacher=True, vllm_num_engines=2), 4, 4,
        {A: (0, 1), Role.TEACHER: (0, 1), E: (2, 3)}, ((2,), (3,)),
    ),
    "world2-teacher-auto": (
        LayoutRequest(need_critic=False, need_ref=False, need_reward=False, need_teacher=True), 2, 2,
        {A: (0, 1), Role.TEACHER: (0, 1), E: (0, 1)}, ((0,), (1,)),
    ),
}


def test_sync_reaches_only_each_engines_first_rank_when_asked() -> None:
    """A vLLM child's tensor-parallel workers read the weights its first rank writes: "sync" is the actor's first rank
    and each engine's first rank (the 70B job's two TP-4 engines on ranks 32-39); without the ask, every engine rank."""
    request = LayoutRequest(actor=rr(8), ref=rr(8), critic=rr(8), reward=rr(8), vllm_num_engines=2,
                            vllm_tensor_parallel_size=4)
    groups = {g.name: g.ranks for g in plan_layout(request, 40, 8).groups}
    assert groups["sync"] == (0, *span(32, 40))
    leaders = plan_layout(dataclasses.replace(request, sync_engine_leaders=True), 40, 8)
    check_invariants(leaders)
    assert {g.name: g.ranks for g in leaders.groups}["sync"] == (0, 32, 36)
    assert "sync" not in leaders.group_names_of(33) and "engine.0" in leaders.group_names_of(33)


@pytest.mark.parametrize("case", CASES.values(), ids=list(CASES))
def test_placement(case: tuple[LayoutRequest, int, int, dict[Role, tuple[int, ...]], tuple[tuple[int, ...], ...]]) -> None:
    request, world, rpn, roles, engines = case
    layout = plan_layout(request, world, rpn)
    assert dict(layout.roles) == roles
    assert list(layout.roles) == [r for r in Role if r in roles]
    assert layout.engines == engines
    assert layout.warnings == ()
    check_invariants(layout)
    assert plan_layout(request, world, rpn) == layout  # pure: every rank computes the same layout


@pytest.mark.parametrize(("world", "tp"), [(w, t) for w in (1, 2, 3, 4, 8, 16) for t in (1, 2, 4) if w % t == 0])
def test_auto_puts_everything_everywhere(world: int, tp: int) -> None:
    rpn = world if world < 8 else 8
    layout = plan_layout(LayoutRequest(vllm_tensor_parallel_size=tp, need_teacher=True), world, rpn)
    assert all(layout.ranks_of(r) == span(0, world) for r in Role)
    assert layout.engines == tuple(span(i, i + tp) for i in range(0, world, tp))
    assert layout.engine_colocated_with_actor
    check_invariants(layout)


def test_world1_auto_groups() -> None:
    layout = plan_layout(LayoutRequest(), 1, 1)
    assert layout.groups == tuple(GroupSpec(n, (0,)) for n in ("world", "actor", "critic", "ref", "reward", "engine", "engine.0"))
    assert layout.roles_of(0) == (A, C, RF, RW, E)
    assert layout.engine_index_of(0) == 0


def test_world4_split_groups_and_queries() -> None:
    request = LayoutRequest(actor=rr(2), ref=rr(1), vllm_num_engines=1, need_critic=False, need_reward=False)
    layout = plan_layout(request, 4, 2)
    assert layout.groups == (
        GroupSpec("world", (0, 1, 2, 3)), GroupSpec("actor", (0, 1)), GroupSpec("ref", (2,)),
        GroupSpec("engine", (3,)), GroupSpec("engine.0", (3,)), GroupSpec("sync", (0, 3)),
    )
    assert not layout.has(C) and layout.ranks_of(C) == () and layout.has(RF)
    assert not layout.engine_colocated_with_actor
    assert layout.roles_of(2) == (RF,)
    assert layout.group_names_of(0) == ("world", "actor", "sync")
    assert layout.group_names_of(1) == ("world", "actor")
    assert layout.group_names_of(3) == ("world", "engine", "engine.0", "sync")
    assert [layout.engine_index_of(r) for r in range(4)] == [None, None, None, 0]
    with pytest.raises(TypeError):
        layout.roles[C] = (0,)  # type: ignore[index]


def test_colocate_all_groups_have_no_sync() -> None:
    layout = plan_layout(LayoutRequest(colocate_all_models=True, vllm_tensor_parallel_size=2), 4, 4)
    assert [g.name for g in layout.groups] == ["world", "actor", "critic", "ref", "reward", "engine", "engine.0", "engine.1"]
    assert layout.engine_index_of(3) == 1


@pytest.mark.parametrize(
    ("request_", "role", "size"),
    [
        (LayoutRequest(need_critic=False, critic=rr(2)), "critic", "2 ranks"),
        (LayoutRequest(need_ref=False, ref=rr(2, nodes=2)), "ref", "4 ranks"),
        (LayoutRequest(need_reward=False, reward=rr(1)), "reward", "1 rank"),
    ],
)
def test_not_needed_role_size_is_ignored_with_warning(request_: LayoutRequest, role: str, size: str) -> None:
    layout = plan_layout(request_, 4, 4)
    assert not layout.has(Role(role))
    assert all(layout.ranks_of(r) == span(0, 4) for r in layout.roles)  # still auto mode
    assert len(layout.warnings) == 1
    assert layout.warnings[0].startswith(f"{role}: {size} requested but the {role} is not needed (")
    assert layout.warnings[0].endswith("); ignored")


def test_num_nodes_without_gpus_per_node_warns() -> None:
    layout = plan_layout(LayoutRequest(actor=RoleRequest(num_nodes=2)), 2, 1)
    assert layout.warnings == ("actor: num_nodes 2 without gpus_per_node; ignored",)


@pytest.mark.parametrize(
    ("request_", "world", "rpn", "needle"),
    [
        # 8 ranks asked as 2 nodes x 4 land on one 8-rank node.
        (LayoutRequest(actor=rr(4, nodes=2), need_critic=False, vllm_num_engines=1, vllm_tensor_parallel_size=8), 16, 8,
         "actor: asked for 2 nodes x 4 ranks, but its ranks 0-7 start at local rank 0 and span 1 node(s)"),
        # The critic starts mid-node and so spans 3 nodes.
        (LayoutRequest(actor=rr(4), critic=rr(8, nodes=2), vllm_num_engines=1, vllm_tensor_parallel_size=4), 24, 8,
         "critic: asked for 2 nodes x 8 ranks, but its ranks 4-19 start at local rank 4 and span 3 node(s)"),
    ],
)
def test_misaligned_multinode_block_warns(request_: LayoutRequest, world: int, rpn: int, needle: str) -> None:
    layout = plan_layout(request_, world, rpn)
    check_invariants(layout)
    assert len(layout.warnings) == 1 and layout.warnings[0].startswith(needle)


def test_format_layout_table() -> None:
    request = LayoutRequest(actor=rr(2), critic=rr(2), ref=rr(2), reward=rr(1), vllm_num_engines=1)
    layout = plan_layout(request, 8, 4)
    table = format_layout_table(layout)
    lines = table.splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["rank", "node", "local", "roles", "groups"]
    assert set(lines[1]) <= {"-", "+"}
    assert len(lines) == 2 + 8
    for rank in range(8):
        cells = [c.strip() for c in lines[2 + rank].split("|")]
        assert cells[:3] == [str(rank), str(rank // 4), str(rank % 4)]
        assert cells[3] == ",".join(r.value for r in layout.roles_of(rank))
        assert cells[4] == ",".join(layout.group_names_of(rank))
    assert lines[2].split("|")[4].strip() == "world,actor,sync"
    assert lines[9].split("|")[3].strip() == "engine"

    warned = plan_layout(LayoutRequest(need_critic=False, critic=rr(2)), 2, 2)
    table = format_layout_table(warned)
    assert table.splitlines()[-1] == f"warning: {warned.warnings[0]}"
    assert re.search(r"^1 +\| 0 +\| 1 +\| actor,ref,reward,engine \| world,actor,ref,reward,engine,engine.1$", table, re.M)


# ---- errors: one test per error path; each message names every number involved ----


def _ctx_size(req: RoleRequest) -> str:
    return "unsized" if req.size is None else str(req.size)


def raises(request: LayoutRequest, world: int, rpn: int, *needles: str) -> str:
    with pytest.raises(LayoutError) as info:
        plan_layout(request, world, rpn)
    message = str(info.value)
    # Every message ends with the whole request, so each role's size is always named.
    roles = [f"{role} {_ctx_size(getattr(request, role))}" for role in ("actor", "critic", "ref", "reward")]
    for needle in (*needles, *roles, f"world size {world}", f"{rpn} ranks per node"):
        assert needle in message, f"{needle!r} not in {message!r}"
    return message


def test_error_world_size_below_one() -> None:
    raises(LayoutRequest(), 0, 1, "world size 0 must be >= 1")


def test_error_ranks_per_node_below_one() -> None:
    raises(LayoutRequest(), 4, 0, "0 ranks per node must be >= 1")


def test_error_world_not_multiple_of_ranks_per_node() -> None:
    raises(LayoutRequest(), 6, 4, "world size 6 is not a multiple of 4 ranks per node", "same number of ranks on every node")


@pytest.mark.parametrize("field_", ["num_nodes", "gpus_per_node"])
def test_error_role_size_below_one(field_: str) -> None:
    bad = RoleRequest(**{"num_nodes": 1, "gpus_per_node": 1, field_: 0})
    raises(LayoutRequest(critic=bad), 4, 4, f"critic: {field_} 0 must be >= 1")


def test_error_tensor_parallel_below_one() -> None:
    raises(LayoutRequest(vllm_tensor_parallel_size=0), 4, 4, "vllm_tensor_parallel_size 0 must be >= 1")


def test_error_num_engines_below_one() -> None:
    raises(LayoutRequest(vllm_num_engines=0), 4, 4, "vllm_num_engines 0 must be >= 1", "engines 0 x tensor parallel 1")


def test_error_gpus_per_node_above_ranks_per_node() -> None:
    raises(LayoutRequest(actor=rr(8), vllm_num_engines=8), 16, 4,
           "actor: gpus_per_node 8 is more than the 4 ranks per node", "raise num_nodes", "engines 8 x tensor parallel 1")


def test_error_auto_world_not_multiple_of_tp() -> None:
    raises(LayoutRequest(vllm_tensor_parallel_size=2), 3, 3,
           "block of 3 ranks", "a multiple of vllm_tensor_parallel_size 2")


def test_error_colocate_all_role_size_mismatch() -> None:
    raises(LayoutRequest(actor=rr(8), critic=rr(4), colocate_all_models=True), 8, 8,
           "actor's block of 8 ranks", "critic asks for 4", "actor 8", "critic 4", "colocate_all_models")


def test_error_colocate_all_block_smaller_than_world() -> None:
    raises(LayoutRequest(actor=rr(4), colocate_all_models=True), 8, 8,
           "one block of 4 ranks", "leaves 4 of world size 8 idle", "actor 4")


def test_error_colocate_all_engines_do_not_fill_block() -> None:
    raises(LayoutRequest(vllm_num_engines=2, vllm_tensor_parallel_size=2, colocate_all_models=True), 8, 8,
           "block of 8 ranks", "vllm_num_engines 2 x vllm_tensor_parallel_size 2 = 4")


def test_error_colocate_all_block_not_multiple_of_tp() -> None:
    raises(LayoutRequest(actor=rr(6), colocate_all_models=True, vllm_tensor_parallel_size=4), 6, 6,
           "block of 6 ranks", "a multiple of vllm_tensor_parallel_size 4", "actor 6")


def test_error_actor_block_not_multiple_of_tp() -> None:
    raises(LayoutRequest(actor=rr(3), critic=rr(1), vllm_tensor_parallel_size=2), 4, 4,
           "actor/ref/reward/engine block of 3 ranks", "a multiple of vllm_tensor_parallel_size 2", "critic 1")


def test_error_actor_remainder_below_one() -> None:
    raises(LayoutRequest(critic=rr(2), ref=rr(1), reward=rr(1), vllm_num_engines=1), 4, 4,
           "ref 1 + critic 2 + reward 1 + engine 1 = 5 ranks leave -1 of world size 4", "actor unsized")


def test_error_blocks_do_not_fill_world() -> None:
    raises(LayoutRequest(actor=rr(2), critic=rr(2), ref=rr(2), reward=rr(1), vllm_num_engines=1), 16, 8,
           "actor 2 + ref 2 + critic 2 + reward 1 + engine 1 = 8 ranks", "make them add up to 16")


def test_error_blocks_exceed_world() -> None:
    raises(LayoutRequest(actor=rr(4), critic=rr(4), vllm_num_engines=2, vllm_tensor_parallel_size=2), 8, 8,
           "actor/ref/reward 4 + critic 4 + engine 4 = 12 ranks", "engines 2 x tensor parallel 2")


def test_error_colocate_actor_ref_size_mismatch() -> None:
    raises(LayoutRequest(actor=rr(4), ref=rr(2), vllm_num_engines=2, colocate_actor_ref=True), 8, 8,
           "colocate_actor_ref puts actor and ref on the same ranks", "actor asks for 4", "ref for 2")


def test_error_colocate_critic_reward_size_mismatch() -> None:
    raises(LayoutRequest(actor=rr(4), critic=rr(2), reward=rr(1), colocate_critic_reward=True), 8, 8,
           "colocate_critic_reward puts critic and reward on the same ranks", "critic asks for 2", "reward for 1",
           "actor 4")


@pytest.mark.parametrize(
    ("request_", "world", "rpn", "needles"),
    [
        (LayoutRequest(vllm_tensor_parallel_size=4), 4, 2,
         ("engine 0 (vllm_tensor_parallel_size 4) would use ranks 0-3, crossing from node 0 to node 1",)),
        (LayoutRequest(actor=rr(2), vllm_num_engines=2, vllm_tensor_parallel_size=2), 6, 3,
         ("engine 0 (vllm_tensor_parallel_size 2) would use ranks 2-3, crossing from node 0 to node 1",
          "actor 2", "engines 2 x tensor parallel 2")),
    ],
)
def test_error_engine_tp_group_crosses_node(request_: LayoutRequest, world: int, rpn: int, needles: tuple[str, ...]) -> None:
    raises(request_, world, rpn, *needles)


def test_error_engine_partly_overlaps_actor() -> None:
    with pytest.raises(LayoutError, match=r"engine ranks \[1, 2\] partly overlap actor ranks \[0, 1\].*world size 3"):
        Layout(3, 3, {A: (0, 1), E: (1, 2)}, ((1, 2),), ())


def test_error_rank_out_of_range() -> None:
    layout = plan_layout(LayoutRequest(), 2, 2)
    for query in (layout.roles_of, layout.group_names_of, layout.engine_index_of):
        with pytest.raises(LayoutError, match=r"rank 2 is outside world size 2; valid ranks are 0..1"):
            query(2)


def test_a_teacher_block_that_does_not_add_up_names_its_size() -> None:
    request = LayoutRequest(actor=rr(2), teacher=rr(3), need_critic=False, need_ref=False, need_reward=False,
                            need_teacher=True, vllm_num_engines=1)
    with pytest.raises(LayoutError, match=r"teacher 3.*world size 4"):
        plan_layout(request, 4, 4)
    unneeded = plan_layout(dataclasses.replace(request, need_teacher=False, teacher=rr(1)), 3, 3)
    assert any("teacher: 1 rank requested but the teacher is not needed (no --teacher_pretrain" in w
               for w in unneeded.warnings)


def test_sequence_parallel_groups_split_each_role_into_consecutive_blocks() -> None:
    """Colocated roles of one size share their blocks (one group each); the critic's own size makes its own; the
    data-parallel coordinates count blocks, and the first rank of each block reports its rows."""
    request = LayoutRequest(actor=rr(4), critic=rr(4), colocate_actor_ref=True, need_reward=False,
                            sequence_parallel=((A, 2), (RF, 2), (C, 4)))
    layout = plan_layout(request, 8, 8)
    sp_groups = [g for g in layout.groups if g.name.startswith("sp.")]
    assert sp_groups == [GroupSpec("sp.0-1", (0, 1)), GroupSpec("sp.2-3", (2, 3)), GroupSpec("sp.4-7", (4, 5, 6, 7))]
    assert layout.sp_group_name(A, 3) == layout.sp_group_name(RF, 3) == "sp.2-3"
    assert layout.sp_group_name(C, 5) == "sp.4-7"
    assert [layout.data_parallel(A, r) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    assert layout.data_parallel(C, 6) == (0, 1)
    assert layout.reporting_ranks(A) == (0, 2) and layout.reporting_ranks(C) == (4,)
    assert "sp.0-1" in layout.group_names_of(1) and "sp.4-7" not in layout.group_names_of(1)
    assert layout.sp_group_name(RW, 0) is None  # a role without SP, or not placed
    assert plan_layout(request, 8, 8) == layout  # pure: every rank computes the same groups


def test_sequence_parallel_sizes_must_divide_the_role_and_a_block_across_nodes_warns() -> None:
    with pytest.raises(LayoutError, match=r"critic: its 4 ranks do not split into sequence-parallel groups of 3; "
                                          r"give the role a multiple of 3 ranks"):
        plan_layout(LayoutRequest(actor=rr(4), critic=rr(4), need_reward=False,
                                  sequence_parallel=((A, 2), (C, 3))), 8, 8)
    request = LayoutRequest(colocate_all_models=True, sequence_parallel=((A, 4),))
    across = plan_layout(request, 8, 2)
    assert any("crosses a node boundary (2 ranks per node)" in w for w in across.warnings), across.warnings
