"""Planning a layout: which ranks play which RLHF role, and which process groups to create.

Every rank of the one SPMD program calls the pure :func:`plan_layout` with the same arguments, so all ranks agree
on their roles and create the process groups in the same order without exchanging a message (and no torch is
needed to test or print it).

Semantics of ``plan_layout(request, world_size, ranks_per_node)``:

* Inputs are checked first: ``world_size >= 1``, ``ranks_per_node >= 1``, ``world_size % ranks_per_node == 0``;
  every given ``num_nodes``, ``gpus_per_node``, ``vllm_num_engines`` and ``vllm_tensor_parallel_size`` (T) is
  >= 1. A role's size is ``(num_nodes or 1) * gpus_per_node`` ("gpus" are ranks); without ``gpus_per_node`` the
  role is unsized.
* Needed roles: actor and engine always; critic, ref, reward and teacher when ``need_critic`` / ``need_ref`` /
  ``need_reward`` / ``need_teacher``. A size given for a role that is not needed is ignored and reported in
  ``Layout.warnings``.
* Auto mode (no needed role sized, ``vllm_num_engines`` unset): every needed role on all ranks ("hybrid
  engine"), and ``world_size / T`` engines of T consecutive ranks. World size 1 puts everything on rank 0.
* ``colocate_all_models``: all needed roles share one block of the actor's size (default: the world), which
  must fill the world; other given sizes must equal it. The engines fill the block: ``vllm_num_engines * T``
  must equal it (unset: block / T engines).
* Otherwise blocks are laid out consecutively from rank 0 in this order: actor (+ ref with
  ``colocate_actor_ref``, + teacher with ``colocate_actor_teacher``, + engine when ``vllm_num_engines`` is unset),
  ref, teacher, critic (+ reward with
  ``colocate_critic_reward``), reward, engine (``vllm_num_engines * T`` ranks). Unsized roles share the actor's
  ranks. An unsized actor takes the ranks the other blocks leave. Colocated roles with both sizes given must
  agree. The blocks must add up exactly to the world size.
* A role's ``gpus_per_node`` may not exceed ``ranks_per_node``, and an engine's tensor-parallel group may not
  cross a node boundary (errors). A role with ``num_nodes > 1`` whose ranks do not start on a node boundary or
  do not span exactly ``num_nodes`` nodes gets a warning: it works, only slower.
* Node labels: see :mod:`rlrun.plan.placement` (``RoleRequest.node_label``, ``engine_node_label``).
* The engine's ranks are either exactly the actor's ranks (weights are synced in place) or disjoint from them
  (weights are broadcast over ``sync``).
* Groups, in this fixed order, skipping roles without ranks: ``world``; ``actor``, ``critic``, ``ref``,
  ``teacher``, ``reward``, ``engine``; ``engine.0``, ``engine.1``, ... (each engine's TP ranks); ``sync`` = actor
  rank 0 + all engine ranks, only when the engine is disjoint from the actor.

Every error is a :class:`~rlrun.runtime.errors.LayoutError` whose message names all the sizes involved, the world size
and the ranks per node, and says how to fix it.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from rlrun.launch.layout import GroupSpec, Layout, LayoutRequest, Role, RoleRequest, describe_nodes, sp_group_name
from rlrun.runtime.errors import LayoutError

# ---- node-label placement ----------------------------------------------------------------------------------------
# Node-label placement: which ranks each block of colocated roles gets when roles ask for node labels.
#
# Node labels (``RoleRequest.node_label``, ``engine_node_label``; ``node_labels`` = one label per node): a block whose
# roles ask for a label goes on ranks of nodes carrying it: labelled blocks first (block order), each on the lowest free
# ranks of its nodes, then the other blocks on the lowest ranks left. Colocated roles asking different labels, or a
# label whose nodes lack the ranks, are errors naming every node's label. When the consecutive placement already honours
# the labels (or none is asked, or ``node_labels=None`` before start-up) it is kept.
#
# Pure functions called by :func:`rlrun.plan.placement.plan_layout`, which builds the blocks; a block is
# ``(roles sharing the same consecutive ranks, how many ranks)``.

_Block = tuple[tuple[Role, ...], int]


def block_labels(blocks: Sequence[_Block], asked: Mapping[Role, str], ctx: str) -> list[str | None]:
    """The one node label each block asks for (None: any node); colocated roles must agree.
    ``asked``: every role that asks for a node label, with its label."""
    out: list[str | None] = []
    for roles, _ in blocks:
        wants = {role: asked[role] for role in roles if role in asked}
        if len(set(wants.values())) > 1:
            wanted = ", ".join(f"--{role.value}_node_label {label!r}" for role, label in wants.items())
            raise LayoutError(
                f"{'/'.join(role.value for role in roles)} share the same ranks, but ask for different node labels "
                f"({wanted}); give them the same label or label only one{ctx}"
            )
        out.append(next(iter(wants.values()), None))
    return out


def place_blocks(
    blocks: Sequence[_Block],
    labels: Sequence[str | None],
    world_size: int,
    rpn: int,
    node_labels: Sequence[str] | None,
    ctx: str,
) -> dict[Role, tuple[int, ...]]:
    """Ranks for each block: consecutive from rank 0 in block order when that already honours every asked label
    (or none is asked, or the labels are unknown). Otherwise the labelled blocks first, each on the lowest free
    ranks of nodes carrying its label, then the others on the lowest free ranks left."""
    placed: dict[Role, tuple[int, ...]] = {}
    start = 0
    for (block_roles, size), label in zip(blocks, labels):
        ranks = tuple(range(start, start + size))
        if node_labels is not None and label is not None and any(node_labels[r // rpn] != label for r in ranks):
            break
        placed.update((role, ranks) for role in block_roles)
        start += size
    else:
        return placed
    placed = {}
    free = list(range(world_size))
    order = [i for i, label in enumerate(labels) if label is not None] + [
        i for i, label in enumerate(labels) if label is None
    ]
    for i in order:
        (block_roles, size), label = blocks[i], labels[i]
        pool = [rank for rank in free if label is None or node_labels[rank // rpn] == label]
        if len(pool) < size:
            names = "/".join(role.value for role in block_roles)
            carrying = sum(1 for node_label in node_labels if node_label == label)
            have = (
                (
                    f"{carrying} node(s) carry that label ({carrying * rpn} ranks, {len(pool)} of them left after "
                    "the other labelled blocks)"
                )
                if carrying
                else "no node carries that label"
            )
            raise LayoutError(
                f"the {names} block of {size} rank{'s' if size != 1 else ''} asks for nodes labelled {label!r}, but "
                f"{have}; node labels: {describe_nodes(node_labels)}; label more nodes {label!r} "
                f"(RLRUN_NODE_LABEL, default the host name) or shrink the blocks that ask for it{ctx}"
            )
        take = pool[:size]
        placed.update((role, tuple(take)) for role in block_roles)
        taken = set(take)
        free = [rank for rank in free if rank not in taken]
    return placed


# Roles that hold a trained or frozen model and are sized by a RoleRequest; the engine is sized by vllm_*.
_MODEL_ROLES = (Role.ACTOR, Role.CRITIC, Role.REF, Role.TEACHER, Role.REWARD)
_WHY_NOT_NEEDED = {
    Role.CRITIC: "the advantage estimator needs no critic",
    Role.REF: "no KL penalty or KL loss is used",
    Role.REWARD: "rewards come from a function or URL",
    Role.TEACHER: "no --teacher_pretrain is set",
}


def _why_not_needed(request: LayoutRequest, role: Role) -> str:
    if role is Role.REF and request.ref_is_actor_base:
        return "with --lora_rank the actor scores the reference log-probs itself, with its adapters disabled"
    return _WHY_NOT_NEEDED[role]


def _req(request: LayoutRequest, role: Role) -> RoleRequest:
    req: RoleRequest = getattr(request, role.value)
    return req


def _needs(request: LayoutRequest, role: Role) -> bool:
    flags = {
        Role.CRITIC: request.need_critic,
        Role.REF: request.need_ref,
        Role.REWARD: request.need_reward,
        Role.TEACHER: request.need_teacher,
    }
    return flags.get(role, True)


def _terms(blocks: Sequence[_Block]) -> str:
    return " + ".join(f"{'/'.join(role.value for role in roles)} {size}" for roles, size in blocks)


def _context(request: LayoutRequest, world_size: int, ranks_per_node: int) -> str:
    """Every number of the request, appended to each error so the user sees the whole picture at once."""
    parts = []
    for role in _MODEL_ROLES:
        req = _req(request, role)
        text = f"{role.value} {'unsized' if req.size is None else req.size}"
        if req.gpus_per_node is not None and req.num_nodes is not None:
            text += f" ({req.num_nodes} nodes x {req.gpus_per_node})"
        parts.append(text if _needs(request, role) else f"{text} (not needed)")
    engines = "auto" if request.vllm_num_engines is None else request.vllm_num_engines
    parts.append(f"engines {engines} x tensor parallel {request.vllm_tensor_parallel_size}")
    colocations = ("colocate_actor_ref", "colocate_actor_teacher", "colocate_critic_reward", "colocate_all_models")
    parts += [f for f in colocations if getattr(request, f)]
    parts += [f"{role.value}_node_label {label!r}" for role, label in _asked_labels(request).items()]
    return f" [request: {', '.join(parts)}; world size {world_size}, {ranks_per_node} ranks per node]"


def _validate(request: LayoutRequest, world_size: int, ranks_per_node: int, ctx: str) -> None:
    if world_size < 1:
        raise LayoutError(f"world size {world_size} must be >= 1; launch at least one rank{ctx}")
    if ranks_per_node < 1:
        raise LayoutError(f"{ranks_per_node} ranks per node must be >= 1; check nproc_per_node{ctx}")
    if world_size % ranks_per_node:
        raise LayoutError(
            f"world size {world_size} is not a multiple of {ranks_per_node} ranks per node; "
            f"launch the same number of ranks on every node{ctx}"
        )
    for role in _MODEL_ROLES:
        req = _req(request, role)
        for name, value in (("num_nodes", req.num_nodes), ("gpus_per_node", req.gpus_per_node)):
            if value is not None and value < 1:
                raise LayoutError(f"{role.value}: {name} {value} must be >= 1, or unset{ctx}")
        gpn = req.gpus_per_node
        if _needs(request, role) and gpn is not None and gpn > ranks_per_node:
            raise LayoutError(
                f"{role.value}: gpus_per_node {gpn} is more than the {ranks_per_node} ranks per node; "
                f"use gpus_per_node <= {ranks_per_node} and raise num_nodes instead{ctx}"
            )
    if request.vllm_tensor_parallel_size < 1:
        raise LayoutError(f"vllm_tensor_parallel_size {request.vllm_tensor_parallel_size} must be >= 1{ctx}")
    if request.vllm_num_engines is not None and request.vllm_num_engines < 1:
        raise LayoutError(
            f"vllm_num_engines {request.vllm_num_engines} must be >= 1, or unset to put the engines on the "
            f"actor's ranks{ctx}"
        )


def _pair_size(sizes: Mapping[Role, int | None], a: Role, b: Role, flag: str, ctx: str) -> int | None:
    size_a, size_b = sizes[a], sizes[b]
    if size_a is not None and size_b is not None and size_a != size_b:
        raise LayoutError(
            f"{flag} puts {a.value} and {b.value} on the same ranks, but {a.value} asks for {size_a} ranks and "
            f"{b.value} for {size_b}; give both the same size or size only one{ctx}"
        )
    return size_a if size_a is not None else size_b


def _colocate_all_block(needed: Sequence[Role], sizes: Mapping[Role, int | None], world_size: int, ctx: str) -> _Block:
    block = sizes[Role.ACTOR] or world_size
    for role in needed:
        size = sizes[role]
        if size is not None and size != block:
            raise LayoutError(
                f"colocate_all_models puts every role on the actor's block of {block} ranks, but {role.value} "
                f"asks for {size}; drop the {role.value}'s size or make it {block}{ctx}"
            )
    if block != world_size:
        # The ranks outside the block would have no role at all.
        raise LayoutError(
            f"colocate_all_models puts every role on one block of {block} ranks (the actor's size), which leaves "
            f"{world_size - block} of world size {world_size} idle; size the actor {world_size} or leave it unset{ctx}"
        )
    return (*needed, Role.ENGINE), block


def _explicit_blocks(
    request: LayoutRequest, needed: Sequence[Role], sizes: Mapping[Role, int | None], world_size: int, ctx: str
) -> list[_Block]:
    actor_roles, actor_size = [Role.ACTOR], sizes[Role.ACTOR]
    others: list[_Block] = []

    def place(roles: tuple[Role, ...], size: int | None) -> None:
        # Unsized roles share the actor's ranks: no extra ranks, and the same choice auto mode makes.
        if size is None:
            actor_roles.extend(roles)
        else:
            others.append((roles, size))

    # the frozen policy-shaped models: on the actor's ranks when colocated, else a block of their own
    for role, flag in ((Role.REF, "colocate_actor_ref"), (Role.TEACHER, "colocate_actor_teacher")):
        if role not in needed:
            continue
        if getattr(request, flag):
            actor_size = _pair_size({**sizes, Role.ACTOR: actor_size}, Role.ACTOR, role, flag, ctx)
            actor_roles.append(role)
        else:
            place((role,), sizes[role])
    if request.colocate_critic_reward and Role.CRITIC in needed and Role.REWARD in needed:
        place((Role.CRITIC, Role.REWARD), _pair_size(sizes, Role.CRITIC, Role.REWARD, "colocate_critic_reward", ctx))
    else:
        for role in (Role.CRITIC, Role.REWARD):
            if role in needed:
                place((role,), sizes[role])
    if request.vllm_num_engines is None:
        actor_roles.append(Role.ENGINE)
    else:
        others.append(((Role.ENGINE,), request.vllm_num_engines * request.vllm_tensor_parallel_size))

    taken = sum(size for _, size in others)
    if actor_size is None:
        actor_size = world_size - taken
        if actor_size < 1:
            raise LayoutError(
                f"the actor is unsized, so it takes the ranks the other blocks leave, but {_terms(others)} = "
                f"{taken} ranks leave {actor_size} of world size {world_size}; shrink those blocks or launch more "
                f"ranks{ctx}"
            )
    blocks: list[_Block] = [(tuple(actor_roles), actor_size), *others]
    if actor_size + taken != world_size:
        raise LayoutError(
            f"the role blocks {_terms(blocks)} = {actor_size + taken} ranks, but world size {world_size} must be "
            f"filled exactly; make them add up to {world_size}, or leave the actor unsized so it takes the "
            f"remaining ranks{ctx}"
        )
    return blocks


def _split_engines(
    request: LayoutRequest, blocks: Sequence[_Block], engine_ranks: tuple[int, ...], rpn: int, ctx: str
) -> tuple[tuple[int, ...], ...]:
    tp, count = request.vllm_tensor_parallel_size, request.vllm_num_engines
    # Only engines sharing a block can misfit; a block of their own is sized count * tp.
    if len(engine_ranks) % tp or (count is not None and len(engine_ranks) != count * tp):
        shared = "/".join(role.value for role in next(roles for roles, _ in blocks if Role.ENGINE in roles))
        need = f"a multiple of vllm_tensor_parallel_size {tp}"
        if count is not None:
            need = f"vllm_num_engines {count} x vllm_tensor_parallel_size {tp} = {count * tp}"
        raise LayoutError(
            f"the engines share the {shared} block of {len(engine_ranks)} ranks, which must be {need}; change "
            f"the tensor parallel size, the engine count or the block size{ctx}"
        )
    engines = tuple(engine_ranks[i : i + tp] for i in range(0, len(engine_ranks), tp))
    for index, ranks in enumerate(engines):
        # Tensor parallelism all-reduces in every layer; across the inter-node network generation would crawl.
        first, last = ranks[0] // rpn, ranks[-1] // rpn
        if first != last:
            raise LayoutError(
                f"engine {index} (vllm_tensor_parallel_size {tp}) would use ranks {ranks[0]}-{ranks[-1]}, crossing "
                f"from node {first} to node {last} with {rpn} ranks per node; use a tensor parallel size that "
                f"divides {rpn} and size the blocks before the engine so it starts on a node boundary{ctx}"
            )
    return engines


def _node_warnings(request: LayoutRequest, roles: Mapping[Role, tuple[int, ...]], rpn: int) -> list[str]:
    warnings = []
    for role in _MODEL_ROLES:
        req, ranks = _req(request, role), roles.get(role, ())
        if not ranks or req.size is None or (req.num_nodes or 1) <= 1:
            continue
        offset, spanned = ranks[0] % rpn, ranks[-1] // rpn - ranks[0] // rpn + 1
        if offset or spanned != req.num_nodes:
            warnings.append(
                f"{role.value}: asked for {req.num_nodes} nodes x {req.gpus_per_node} ranks, but its ranks "
                f"{ranks[0]}-{ranks[-1]} start at local rank {offset} and span {spanned} node(s) with {rpn} ranks "
                "per node; it works, but reorder or resize the roles to align it"
            )
    return warnings


def _role_label(request: LayoutRequest, role: Role) -> str | None:
    return request.engine_node_label if role is Role.ENGINE else _req(request, role).node_label


def _asked_labels(request: LayoutRequest) -> dict[Role, str]:
    """Every role that asks for a node label, needed or not."""
    return {role: label for role in Role if (label := _role_label(request, role)) is not None}


def plan_layout(
    request: LayoutRequest, world_size: int, ranks_per_node: int, node_labels: Sequence[str] | None = None
) -> Layout:
    """Place every role on ranks; the rules are in the module docstring. ``node_labels``: one label per node
    (node n = ranks n*ranks_per_node ...), needed to honour ``--X_node_label``; None places as if none were
    asked (the check before start-up, when other nodes' labels are unknown)."""
    ctx = _context(request, world_size, ranks_per_node)
    _validate(request, world_size, ranks_per_node, ctx)
    if node_labels is not None and len(node_labels) != world_size // ranks_per_node:
        raise LayoutError(
            f"{len(node_labels)} node labels for {world_size // ranks_per_node} nodes (world size {world_size}, "
            f"{ranks_per_node} ranks per node); every node reports exactly one label{ctx}"
        )
    needed = [role for role in _MODEL_ROLES if _needs(request, role)]
    sizes = {role: _req(request, role).size for role in needed}
    warnings: list[str] = []
    for role in _MODEL_ROLES:
        req = _req(request, role)
        if role not in needed and req.size is not None:
            warnings.append(
                f"{role.value}: {req.size} rank{'s' if req.size != 1 else ''} requested but the {role.value} is "
                f"not needed ({_why_not_needed(request, role)}); ignored"
            )
        if req.gpus_per_node is None and (req.num_nodes or 1) > 1:
            warnings.append(f"{role.value}: num_nodes {req.num_nodes} without gpus_per_node; ignored")
        if role not in needed and req.node_label is not None:
            warnings.append(
                f"{role.value}: node label {req.node_label!r} requested but the {role.value} is not needed "
                f"({_why_not_needed(request, role)}); ignored"
            )

    if all(size is None for size in sizes.values()) and request.vllm_num_engines is None:
        blocks: list[_Block] = [((*needed, Role.ENGINE), world_size)]
    elif request.colocate_all_models:
        blocks = [_colocate_all_block(needed, sizes, world_size, ctx)]
    else:
        blocks = _explicit_blocks(request, needed, sizes, world_size, ctx)
    placed = place_blocks(
        blocks, block_labels(blocks, _asked_labels(request), ctx), world_size, ranks_per_node, node_labels, ctx
    )
    roles = {role: placed[role] for role in Role if role in placed}
    engines = _split_engines(request, blocks, roles[Role.ENGINE], ranks_per_node, ctx)
    warnings += _node_warnings(request, roles, ranks_per_node)

    groups = [GroupSpec("world", tuple(range(world_size)))]
    groups += [GroupSpec(role.value, ranks) for role, ranks in roles.items()]
    groups += [GroupSpec(f"engine.{i}", ranks) for i, ranks in enumerate(engines)]
    if not set(roles[Role.ENGINE]) & set(roles[Role.ACTOR]):
        # Disjoint engines receive new weights by broadcast from actor rank 0, which gathers them first.
        receivers = tuple(e[0] for e in engines) if request.sync_engine_leaders else roles[Role.ENGINE]
        groups.append(GroupSpec("sync", (roles[Role.ACTOR][0], *receivers)))
        if request.many_senders:
            groups.append(GroupSpec("sync.senders", (*roles[Role.ACTOR], *receivers)))
    if request.async_train:
        shared = sorted(
            role.value
            for role, ranks in roles.items()
            if role is not Role.ENGINE and set(roles[Role.ENGINE]) & set(ranks)
        )
        if shared:
            warnings.append(
                f"--async_train ignored, this run is synchronous: the engines share ranks with the "
                f"{', '.join(shared)}, so they cannot generate while those train; give them ranks of their "
                "own with --vllm_num_engines N (and no --colocate_all_models)"
            )
        else:
            # Scoring and training collectives of every rank but the engines', so those run while the engines generate.
            groups.append(GroupSpec("learners", tuple(r for r in range(world_size) if r not in roles[Role.ENGINE])))
            if request.partial_rollout:
                # The actor's first rank tells the engines it has trained (ReadyFlag): --partial_rollout's engines
                # generate ahead until then. gloo, a few bytes: no NCCL communicator for it.
                groups.append(GroupSpec("ready", (roles[Role.ACTOR][0], *roles[Role.ENGINE])))
    sequence_parallel = _sequence_parallel(request, roles, ranks_per_node, ctx, warnings)
    groups += _sp_groups(roles, sequence_parallel)
    labels = tuple(node_labels) if node_labels is not None else None
    return Layout(world_size, ranks_per_node, roles, engines, tuple(groups), tuple(warnings), labels, sequence_parallel)


def _sequence_parallel(
    request: LayoutRequest, roles: Mapping[Role, tuple[int, ...]], rpn: int, ctx: str, warnings: list[str]
) -> dict[Role, int]:
    """Each placed model role's sequence-parallel size (> 1 only): its ranks must divide by it; a group crossing a
    node boundary is a warning (four all-to-alls per layer over the network)."""
    out = {}
    for role, sp in request.sequence_parallel:
        ranks = roles.get(role, ())
        if sp < 1:
            raise LayoutError(f"{role.value}: sequence-parallel size {sp} must be >= 1{ctx}")
        if sp == 1 or not ranks:
            continue
        if len(ranks) % sp:
            raise LayoutError(
                f"{role.value}: its {len(ranks)} rank{'s' if len(ranks) > 1 else ''} do not split into "
                f"sequence-parallel groups of {sp}; give the role a multiple of {sp} ranks or a sequence-parallel "
                f"size that divides {len(ranks)}{ctx}"
            )
        if any(ranks[i] // rpn != ranks[i + sp - 1] // rpn for i in range(0, len(ranks), sp)):
            warnings.append(
                f"{role.value}: a sequence-parallel group of {sp} ranks crosses a node boundary ({rpn} ranks per "
                "node); it works, but its all-to-alls go over the network"
            )
        out[role] = sp
    return out


def _sp_groups(roles: Mapping[Role, tuple[int, ...]], sequence_parallel: Mapping[Role, int]) -> list[GroupSpec]:
    """One group per run of sp consecutive ranks of each role (colocated roles of one size share them), in role
    order."""
    specs: dict[str, GroupSpec] = {}
    for role, sp in sequence_parallel.items():
        ranks = roles[role]
        for start in range(0, len(ranks), sp):
            chunk = ranks[start : start + sp]
            specs.setdefault(sp_group_name(chunk), GroupSpec(sp_group_name(chunk), chunk))
    return list(specs.values())
