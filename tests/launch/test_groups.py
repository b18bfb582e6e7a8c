"""Every process group is made in rlrun/launch/groups.py, by every rank, in the same order (issue 26: a group that
only some ranks make hangs a world whose groups are created eagerly, as NCCL does with a bound device). Checked on 4
real gloo ranks for layouts of every shape (colocated, disaggregated engines, every role, tensor-parallel engines,
DeepSpeed's one-rank groups, a gloo weight-sync group): each rank records its new_group calls and all four records
are identical. Run as a script (`python test_groups.py RANK WORLD PORT OUTDIR`) it is one rank."""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src" / "rlrun"

LAYOUTS = {
    "colocated": [],
    "disaggregated": ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "2"],
    "every_role": ["--advantage_estimator", "gae", "--init_kl_coef", "0.01", "--reward_pretrain", "rm",
                   "--actor_num_gpus_per_node", "1", "--critic_num_gpus_per_node", "1", "--ref_num_gpus_per_node", "1",
                   "--reward_num_gpus_per_node", "1"],
    "tensor_parallel": ["--actor_num_gpus_per_node", "2", "--vllm_num_engines", "1", "--vllm_tensor_parallel_size", "2"],
}


def _rank_main(rank: int, world: int, port: int, outdir: Path) -> None:
    import torch.distributed as dist

    from rlrun.cli.parser import parse_args
    from rlrun.launch import groups as groups_module
    from rlrun.plan.plan import lay_out

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    calls: list = []
    real = dist.new_group

    def recording(ranks=None, *args, **kwargs):
        calls.append([list(ranks) if ranks is not None else None, str(kwargs.get("backend"))])
        return real(ranks, *args, **kwargs)

    dist.new_group = recording
    out = {}
    for name, flags in LAYOUTS.items():
        reward = [] if "--reward_pretrain" in flags else ["--remote_rm_url", "demo"]
        cfg = parse_args([*reward, "--rollout_batch_size", "8", "--train_batch_size", "8",
                          "--micro_train_batch_size", "1", "--micro_rollout_batch_size", "1", *flags]).config
        layout = lay_out(cfg, world, world).layout
        calls.clear()
        groups = groups_module.build_groups(layout, 60, "gloo", solo=True)
        out[name] = {"calls": list(calls), "member": sorted(groups.member),
                     "solo": dist.get_process_group_ranks(groups.solo)}
    (outdir / f"rank{rank}.json").write_text(json.dumps(out))
    dist.barrier()
    dist.destroy_process_group()


def test_every_rank_makes_every_group_in_the_same_order(tmp_path):
    from helpers import run_file_as_ranks  # not at the top: the ranks run this file as __main__

    run_file_as_ranks(__file__, 4, tmp_path, timeout=180)
    records = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(4)]
    for name in LAYOUTS:
        sequences = [rec[name]["calls"] for rec in records]
        assert all(seq == sequences[0] for seq in sequences), name
        assert [c[0] for c in sequences[0][-4:]] == [[0], [1], [2], [3]]  # every rank's one-rank group, by all
        for r, rec in enumerate(records):
            assert rec[name]["solo"] == [r] and "world" in rec[name]["member"]
    assert records[1]["disaggregated"]["member"] != records[3]["disaggregated"]["member"]  # the layouts differ


def test_new_group_is_called_only_in_launch_groups():
    """No module but rlrun/launch/groups.py creates a process group (DeepSpeed's one-rank group included)."""
    callers = []
    for path in SRC.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call) and getattr(node.func, "attr", getattr(node.func, "id", None)) in (
                    "new_group", "new_subgroups", "new_subgroups_by_enumeration"):
                callers.append(str(path.relative_to(SRC)))
    assert callers and set(callers) == {"launch/groups.py"}, callers


if __name__ == "__main__":
    _rank_main(int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), Path(sys.argv[4]))
