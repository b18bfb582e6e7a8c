"""Roles pinned to node labels (--X_node_label): pure placement, errors, the table, and the label exchange."""

from __future__ import annotations

import pytest

from rlrun.launch.env import read_node_label
from rlrun.launch.transfer import decode_label, encode_label, labels_per_node
from rlrun.launch.layout import GroupSpec, LayoutRequest, Role, RoleRequest
from rlrun.plan.placement import plan_layout
from rlrun.launch.layout import format_layout_table
from rlrun.runtime.errors import LayoutError

A, C, RF, RW, E = Role.ACTOR, Role.CRITIC, Role.REF, Role.REWARD, Role.ENGINE


def rr(gpus: int | None = None, label: str | None = None) -> RoleRequest:
    return RoleRequest(gpus_per_node=gpus, node_label=label)


def test_no_label_asked_places_as_before() -> None:
    request = LayoutRequest(actor=rr(2), ref=rr(1), need_critic=False, need_reward=False, vllm_num_engines=1)
    without = plan_layout(request, 4, 2)
    with_labels = plan_layout(request, 4, 2, ("a", "b"))
    assert dict(with_labels.roles) == dict(without.roles) == {A: (0, 1), RF: (2,), E: (3,)}
    assert with_labels.groups == without.groups
    assert with_labels.node_labels == ("a", "b") and without.node_labels is None


def test_ref_pinned_to_the_second_node() -> None:
    # Blocks actor 2, ref 1, engine 1 on 2 nodes x 2 ranks; the ref wants node 1 ('b'): it takes rank 2, the
    # unlabelled blocks then take the lowest ranks left: actor 0-1, engine 3.
    request = LayoutRequest(actor=rr(2), ref=rr(1, "b"), need_critic=False, need_reward=False, vllm_num_engines=1)
    layout = plan_layout(request, 4, 2, ("a", "b"))
    assert dict(layout.roles) == {A: (0, 1), RF: (2,), E: (3,)}
    assert layout.groups == (GroupSpec("world", (0, 1, 2, 3)), GroupSpec("actor", (0, 1)), GroupSpec("ref", (2,)),
                             GroupSpec("engine", (3,)), GroupSpec("engine.0", (3,)), GroupSpec("sync", (0, 3)))


def test_ref_pinned_to_the_first_node_moves_the_actor() -> None:
    request = LayoutRequest(actor=rr(2), ref=rr(2, "a"), need_critic=False, need_reward=False)
    assert dict(plan_layout(request, 4, 2).roles) == {A: (0, 1), RF: (2, 3), E: (0, 1)}
    layout = plan_layout(request, 4, 2, ("a", "b"))
    assert dict(layout.roles) == {A: (2, 3), RF: (0, 1), E: (2, 3)}
    assert layout.engines == ((2,), (3,))


def test_engine_with_tensor_parallel_pinned_to_gpu_node() -> None:
    request = LayoutRequest(actor=rr(2), need_critic=False, need_ref=False, need_reward=False, vllm_num_engines=1,
                            vllm_tensor_parallel_size=2, engine_node_label="gpu")
    layout = plan_layout(request, 4, 2, ("gpu", "cpu"))
    assert dict(layout.roles) == {A: (2, 3), E: (0, 1)}
    assert layout.engines == ((0, 1),)
    assert layout.groups[-1] == GroupSpec("sync", (2, 0, 1))  # actor rank 0 first, then the engine ranks


def test_two_blocks_share_one_label_in_block_order() -> None:
    # Blocks: actor 2 (unsized: the rest), ref 2, critic 2 on 3 nodes x 2. Ref and critic both want 'g' (nodes 0, 2):
    # ref first takes node 0, critic node 2, the actor the ranks left (node 1).
    request = LayoutRequest(ref=rr(2, "g"), critic=rr(2, "g"), need_reward=False)
    layout = plan_layout(request, 6, 2, ("g", "c", "g"))
    assert dict(layout.roles) == {A: (2, 3), C: (4, 5), RF: (0, 1), E: (2, 3)}


def test_colocated_roles_share_a_label() -> None:
    request = LayoutRequest(actor=rr(2, "a"), ref=rr(2), colocate_actor_ref=True, need_critic=False, need_reward=False,
                            vllm_num_engines=2)
    layout = plan_layout(request, 4, 2, ("e", "a"))
    assert dict(layout.roles) == {A: (2, 3), RF: (2, 3), E: (0, 1)}


def test_colocated_roles_asking_different_labels_fail_even_before_labels_are_known() -> None:
    request = LayoutRequest(actor=rr(2, "a"), ref=rr(2, "b"), colocate_actor_ref=True, need_critic=False,
                            need_reward=False)
    with pytest.raises(LayoutError) as err:
        plan_layout(request, 2, 2)
    text = str(err.value)
    assert "actor/ref/engine share the same ranks" in text
    assert "--actor_node_label 'a'" in text and "--ref_node_label 'b'" in text


def test_missing_label_error_message() -> None:
    # ref 3 ranks on 'b', but only node 2 (2 ranks) carries 'b'.
    request = LayoutRequest(actor=rr(1), ref=RoleRequest(num_nodes=3, gpus_per_node=1, node_label="b"), critic=rr(2),
                            need_reward=False)
    with pytest.raises(LayoutError) as err:
        plan_layout(request, 6, 2, ("a", "a", "b"))
    text = str(err.value)
    assert text.startswith("the ref block of 3 ranks asks for nodes labelled 'b', but 1 node(s) carry that label "
                           "(2 ranks, 2 of them left after the other labelled blocks); node labels: nodes 0-1 'a', "
                           "node 2 'b';")
    assert "ref_node_label 'b'" in text and "world size 6, 2 ranks per node" in text


def test_auto_mode_block_is_the_whole_world() -> None:
    with pytest.raises(LayoutError, match=r"block of 4 ranks asks for nodes labelled 'a', but 1 node\(s\)"):
        plan_layout(LayoutRequest(actor=rr(None, "a")), 4, 2, ("a", "b"))
    # Every node labelled 'a': fine, and the same placement as without labels.
    layout = plan_layout(LayoutRequest(actor=rr(None, "a")), 4, 2, ("a", "a"))
    assert layout.ranks_of(A) == (0, 1, 2, 3)


def test_unknown_labels_place_consecutively() -> None:
    request = LayoutRequest(actor=rr(2), ref=rr(2, "a"), need_critic=False, need_reward=False)
    layout = plan_layout(request, 4, 2)
    assert dict(layout.roles) == {A: (0, 1), RF: (2, 3), E: (0, 1)}
    assert layout.node_labels is None


def test_label_count_must_match_nodes() -> None:
    with pytest.raises(LayoutError, match=r"3 node labels for 2 nodes \(world size 4, 2 ranks per node\)"):
        plan_layout(LayoutRequest(), 4, 2, ("a", "b", "c"))


def test_label_of_unneeded_role_is_a_warning() -> None:
    layout = plan_layout(LayoutRequest(critic=rr(None, "x"), need_critic=False), 2, 2, ("a",))
    assert any(w.startswith("critic: node label 'x' requested but the critic is not needed") for w in layout.warnings)


def test_table_has_a_label_column_when_labels_are_known() -> None:
    request = LayoutRequest(actor=rr(2), ref=rr(1, "b"), need_critic=False, need_reward=False, vllm_num_engines=1)
    lines = format_layout_table(plan_layout(request, 4, 2, ("a", "b"))).splitlines()
    assert [c.strip() for c in lines[0].split("|")] == ["rank", "node", "label", "local", "roles", "groups"]
    assert [[c.strip() for c in line.split("|")][:5] for line in lines[2:6]] == [
        ["0", "0", "a", "0", "actor"], ["1", "0", "a", "1", "actor"], ["2", "1", "b", "0", "ref"],
        ["3", "1", "b", "1", "engine"]]
    plain = format_layout_table(plan_layout(request, 4, 2)).splitlines()
    assert [c.strip() for c in plain[0].split("|")] == ["rank", "node", "local", "roles", "groups"]


def test_labels_per_node() -> None:
    assert labels_per_node(["a", "a", "b", "b"], 2) == ("a", "b")
    with pytest.raises(LayoutError, match=r"node 1 \(ranks 2-3\) report different node labels \['b', 'c'\]"):
        labels_per_node(["a", "a", "b", "c"], 2)


@pytest.mark.parametrize("label", ["", "gpu-h100", "nœud-ü", "x" * 255])
def test_label_encoding_round_trip(label: str) -> None:
    row = encode_label(label)
    assert row.shape == (256,) and int(row[0]) == len(label.encode())
    assert decode_label(row) == label


def test_label_too_long() -> None:
    with pytest.raises(LayoutError, match="longer than 255 bytes"):
        encode_label("y" * 256)


def test_read_node_label_env_then_hostname() -> None:
    import socket

    assert read_node_label({"RLRUN_NODE_LABEL": "gpu"}) == "gpu"
    assert read_node_label({}) == socket.gethostname()
    assert read_node_label({"RLRUN_NODE_LABEL": ""}) == socket.gethostname()


def test_consecutive_placement_kept_when_it_already_fits() -> None:
    # Every node carries 'box': the ref asks for it and is already there, so nothing moves (actor keeps rank 0).
    request = LayoutRequest(actor=rr(1), ref=rr(1, "box"), need_critic=False, need_reward=False, vllm_num_engines=1)
    assert dict(plan_layout(request, 3, 3, ("box",)).roles) == {A: (0,), RF: (1,), E: (2,)}
