"""Tests for rlrun.launch.env: rank and world from torchrun, a one-task-per-GPU srun, or a plain process."""

from __future__ import annotations

import pytest

from rlrun.launch.env import DEFAULT_PORT, DistEnv, expand_nodelist, read_env
from rlrun.runtime.errors import ConfigError

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "4",
    "MASTER_ADDR": "node-a", "MASTER_PORT": "29511", "TORCHELASTIC_RESTART_COUNT": "2",
    "GROUP_RANK": "1", "ROLE_RANK": "5", "OMP_NUM_THREADS": "1",
}

# What `srun --ntasks-per-node=4 --gpus-per-task=1 python -m rlrun.ppo` sets for the 7th of 8 tasks on 2 nodes.
SRUN = {
    "SLURM_JOB_ID": "123456", "SLURM_JOB_NODELIST": "gpu[07-09],cpu1", "SLURM_NTASKS": "12",
    "SLURM_TASKS_PER_NODE": "4(x3)", "SLURM_STEP_ID": "0", "SLURM_STEP_NUM_TASKS": "8",
    "SLURM_STEP_TASKS_PER_NODE": "4(x2)", "SLURM_PROCID": "6", "SLURM_LOCALID": "2", "SLURM_NODEID": "1",
}


def test_torchrun():
    env = read_env(TORCHRUN)
    assert env == DistEnv(rank=5, local_rank=1, world_size=8, local_world_size=4, master_addr="node-a",
                          master_port=29511, launcher="torchrun", restart_count=2)
    assert env.node_rank == 1


def test_torchrun_minimal_defaults():
    env = read_env({"RANK": "0", "WORLD_SIZE": "2"})
    assert env == DistEnv(0, 0, 2, 2, "127.0.0.1", DEFAULT_PORT, "torchrun", 0)


def test_rank_without_world_size_is_not_torchrun():
    assert read_env({"RANK": "3"}).launcher == "single"


def test_srun_one_task_per_gpu():
    env = read_env(SRUN)
    assert env.launcher == "slurm"
    assert (env.rank, env.local_rank, env.world_size, env.local_world_size) == (6, 2, 8, 4)
    assert env.node_rank == 1
    assert env.master_addr == "gpu07"  # first host of the job's node list
    assert env.master_port == 20000 + 123456 % 20000
    assert env.restart_count == 0


def test_srun_port_differs_between_jobs_and_stays_in_range():
    ports = {read_env({**SRUN, "SLURM_JOB_ID": str(job)}).master_port for job in (1, 2, 39999, 40000, 10**9 + 7)}
    assert len(ports) == 5
    assert all(20000 <= port < 40000 for port in ports)


def test_srun_step_nodelist_wins_over_job_nodelist():
    # A step may run on a subset of the allocation; rank 0 lives on the step's first node.
    env = read_env({**SRUN, "SLURM_STEP_NODELIST": "gpu[08-09]"})
    assert env.master_addr == "gpu08"


def test_srun_explicit_master_addr_and_port_win():
    env = read_env({**SRUN, "MASTER_ADDR": "10.0.0.5", "MASTER_PORT": "31000", "SLURM_RESTART_COUNT": "1"})
    assert (env.master_addr, env.master_port, env.restart_count) == ("10.0.0.5", 31000, 1)


def test_srun_falls_back_to_ntasks_and_tasks_per_node():
    env = dict(SRUN)
    del env["SLURM_STEP_NUM_TASKS"], env["SLURM_STEP_TASKS_PER_NODE"]
    got = read_env(env)
    assert (got.world_size, got.local_world_size) == (12, 4)


@pytest.mark.parametrize("tasks_per_node, expected", [("4(x2)", 4), ("8", 8), ("2,1", 2), ("3(x2),1", 3)])
def test_srun_tasks_per_node_formats(tasks_per_node, expected):
    assert read_env({**SRUN, "SLURM_STEP_TASKS_PER_NODE": tasks_per_node}).local_world_size == expected


def test_srun_without_job_id_or_nodelist():
    env = {k: v for k, v in SRUN.items() if k not in ("SLURM_JOB_ID", "SLURM_JOB_NODELIST")}
    got = read_env(env)
    assert (got.master_addr, got.master_port) == ("127.0.0.1", 20000)


def test_torchrun_under_srun_rank_wins():
    # `srun torchrun ...`: SLURM_PROCID is the node's task index, RANK the real rank.
    env = read_env({**SRUN, "SLURM_PROCID": "1", **TORCHRUN})
    assert env.launcher == "torchrun"
    assert (env.rank, env.world_size, env.master_addr) == (5, 8, "node-a")


def test_sbatch_script_without_srun_is_single():
    # The batch script itself has SLURM_PROCID=0 but is not in a job step: a world of one, not a hang.
    batch = {k: v for k, v in SRUN.items() if not k.startswith("SLURM_STEP")}
    batch["SLURM_PROCID"] = "0"
    env = read_env(batch)
    assert env == DistEnv(0, 0, 1, 1, "127.0.0.1", DEFAULT_PORT, "single")


def test_plain_process_is_single():
    assert read_env({}) == DistEnv(0, 0, 1, 1, "127.0.0.1", DEFAULT_PORT, "single")
    assert read_env({"PATH": "/usr/bin", "HOME": "/root"}).launcher == "single"
    assert read_env({}).node_rank == 0


def test_reads_os_environ_by_default(monkeypatch):
    for key in ("RANK", "WORLD_SIZE", "SLURM_PROCID", "SLURM_STEP_ID"):
        monkeypatch.delenv(key, raising=False)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "3")
    env = read_env()
    assert (env.rank, env.world_size, env.launcher) == (1, 3, "torchrun")


@pytest.mark.parametrize("nodelist, hosts", [
    ("gpu07", ["gpu07"]),
    ("gpu[07-09],cpu1", ["gpu07", "gpu08", "gpu09", "cpu1"]),
    ("gpu[01-03,7],cpu5", ["gpu01", "gpu02", "gpu03", "gpu7", "cpu5"]),
    ("node[001-003]", ["node001", "node002", "node003"]),  # zero padding kept
    ("node[098-101]", ["node098", "node099", "node100", "node101"]),  # padding across a digit boundary
    ("n[8-11]", ["n8", "n9", "n10", "n11"]),  # no padding
    ("a[1-2,5-6],b[08-09]", ["a1", "a2", "a5", "a6", "b08", "b09"]),  # several ranges and bracket groups
    ("gpu[3],gpu[1]", ["gpu3", "gpu1"]),  # order kept
    ("alpha,beta,gamma", ["alpha", "beta", "gamma"]),  # plain comma list
    ("10.0.0.1,10.0.0.2", ["10.0.0.1", "10.0.0.2"]),
    ("node[1-2]-ib", ["node1-ib", "node2-ib"]),  # text after the brackets
    ("r[1-2]n[01-02]", ["r1n01", "r1n02", "r2n01", "r2n02"]),  # two brackets in one name
    ("my-cluster-[01-02]", ["my-cluster-01", "my-cluster-02"]),
])
def test_expand_nodelist(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, master", [("node[1-2]-ib,gpu1", "node1-ib"), ("gpu[010-012]", "gpu010")])
def test_master_addr_is_first_expanded_host(nodelist, master):
    assert read_env({**SRUN, "SLURM_JOB_NODELIST": nodelist}).master_addr == master


@pytest.mark.parametrize("environ, key", [
    ({**TORCHRUN, "RANK": "zero"}, "RANK"),
    ({**TORCHRUN, "WORLD_SIZE": "8.0"}, "WORLD_SIZE"),
    ({**TORCHRUN, "LOCAL_RANK": ""}, "LOCAL_RANK"),
    ({**TORCHRUN, "MASTER_PORT": "http"}, "MASTER_PORT"),
    ({**TORCHRUN, "TORCHELASTIC_RESTART_COUNT": "x"}, "TORCHELASTIC_RESTART_COUNT"),
    ({**SRUN, "SLURM_PROCID": "a"}, "SLURM_PROCID"),
    ({**SRUN, "SLURM_LOCALID": "-"}, "SLURM_LOCALID"),
    ({**SRUN, "SLURM_STEP_NUM_TASKS": "eight"}, "SLURM_STEP_NUM_TASKS"),
    ({**SRUN, "SLURM_JOB_ID": "12a"}, "SLURM_JOB_ID"),
    ({**SRUN, "SLURM_STEP_TASKS_PER_NODE": "(x2)"}, "SLURM_STEP_TASKS_PER_NODE"),
    ({**SRUN, "MASTER_PORT": "2950o"}, "MASTER_PORT"),
])
def test_non_integer_env_var_is_config_error(environ, key):
    with pytest.raises(ConfigError) as exc:
        read_env(environ)
    assert key in str(exc.value) and repr(environ[key]) in str(exc.value)


def test_bad_nodelist_range_is_config_error():
    with pytest.raises(ConfigError, match=r"gpu\[a-c\]"):
        read_env({**SRUN, "SLURM_JOB_NODELIST": "gpu[a-c]"})
