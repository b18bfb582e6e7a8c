"""Real clusters on one machine, for the launch-script tests.

`SlurmCluster`: Debian's slurm-wlm (slurmctld + several slurmd on one host) with its own munged,
all under one temporary directory, started without systemd. `NetnsHosts`: two "hosts" made of
network namespaces joined by a veth pair, each with its own hostname and hosts file.

Everything started here is stopped by `stop()`, which is safe to call more than once and after a
partial start. Debugging by hand:  python tests/scripts/cluster_sim.py slurm-up /tmp/slurm  (then
the printed `export SLURM_CONF=...`; `python tests/scripts/cluster_sim.py slurm-down /tmp/slurm`).
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import stat
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
SBIN = ("/usr/sbin", "/sbin", "/usr/bin", "/bin")
HOSTS_FILE = Path("/etc/hosts")
HOSTS_MARK = "# rlrun-test-cluster"


class Unavailable(Exception):
    """The machine cannot host this cluster (missing tools or permissions): tests skip with this text."""


def which(tool: str) -> str | None:
    return shutil.which(tool) or shutil.which(tool, path=os.pathsep.join(SBIN))


def run(cmd: list[str], timeout: float = 30, check: bool = True, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, **kwargs)
    if check and proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} exited {proc.returncode}: {(proc.stdout + proc.stderr).strip()[-2000:]}")
    return proc


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def free_port_range(n: int, lo: int = 17000, hi: int = 29000) -> int:
    """First port p with p..p+n-1 all free on 127.0.0.1 (slurmd ports must be consecutive)."""
    for start in range(lo + os.getpid() % 997 * 7 % (hi - lo), hi, n):
        ok = True
        for port in range(start, start + n):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return start
    raise RuntimeError("no free port range for slurmd")


def ensure_cluster_deps() -> None:
    """Run scripts/ci/install_cluster_deps.sh (idempotent); raise Unavailable when it cannot help."""
    script = REPO / "scripts" / "ci" / "install_cluster_deps.sh"
    if all(which(t) for t in ("slurmctld", "slurmd", "sbatch", "munged", "ip", "nsenter", "unshare")):
        return
    try:
        proc = run(["bash", str(script)], timeout=600, check=False)
    except subprocess.TimeoutExpired:
        raise Unavailable("installing slurm/munge/iproute2 timed out (scripts/ci/install_cluster_deps.sh)") from None
    if proc.returncode != 0:
        raise Unavailable("slurm/munge/iproute2 are missing and could not be installed: "
                          + (proc.stdout + proc.stderr).strip().splitlines()[-1])


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _hosts_mark(pid: int) -> str:
    return f"{HOSTS_MARK} pid={pid}"


def _add_hosts_lines(lines: list[str]) -> None:
    text = HOSTS_FILE.read_text()
    mark = _hosts_mark(os.getpid())
    add = "".join(f"{line}  {mark}\n" for line in lines if f"{line}  {mark}" not in text)
    if add:
        HOSTS_FILE.write_text(text + ("" if text.endswith("\n") or not text else "\n") + add)


def _remove_hosts_lines(also_dead: bool = True, owner_pid: int | None = None) -> None:
    """Drop this process's marked lines (and those of test sessions that died without cleaning up);
    lines anyone else added stay."""
    me = os.getpid() if owner_pid is None else owner_pid
    try:
        text = HOSTS_FILE.read_text()
    except OSError:
        return
    kept = []
    for line in text.splitlines(keepends=True):
        if HOSTS_MARK in line:
            try:
                owner = int(line.rsplit("pid=", 1)[1].split()[0])
            except (IndexError, ValueError):
                owner = -1
            if owner == me or (also_dead and owner > 0 and not _pid_alive(owner)):
                continue
        kept.append(line)
    if len(kept) != len(text.splitlines()):
        HOSTS_FILE.write_text("".join(kept))


def _kill_pidfile(path: Path, sig: int = signal.SIGTERM) -> int | None:
    try:
        pid = int(path.read_text().strip())
    except (OSError, ValueError):
        return None
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return None
    return pid


def _wait_gone(pid: int | None, timeout: float) -> bool:
    if pid is None:
        return True
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return True
        time.sleep(0.1)
    return False


VENV_BIN = Path(sys.executable).parent


def training_env(base: dict[str, str] | None = None, **extra: str) -> dict[str, str]:
    """Environment for a training run launched by the scripts: the venv's python and torchrun,
    one thread per process, offline; launcher variables of the calling shell removed."""
    env = dict(os.environ if base is None else base)
    for key in [k for k in env if k.startswith(("RLRUN_", "SLURM_", "SBATCH_", "SRUN_")) and k != "SLURM_CONF"
                or k in ("NODE_RANK", "NNODES", "NPROC_PER_NODE", "HEAD_ADDR", "HEAD_POD_ID", "MASTER_ADDR",
                         "MASTER_PORT", "PRIMARY_ADDR", "PRIMARY_PORT", "NUM_NODES", "NUM_TRAINERS", "WANDB_API_KEY",
                         "RUNPOD_POD_ID", "NODE_ADDR", "CKPT_DIR", "GPUS_PER_NODE", "RANK", "WORLD_SIZE",
                         "LOCAL_RANK", "LOCAL_WORLD_SIZE")]:
        del env[key]
    torchrun = VENV_BIN / "torchrun"
    env.update({
        "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1", "RLRUN_NO_PROGRESS": "1", "DS_ACCELERATOR": "cpu",
        "PYTHONUNBUFFERED": "1", "RLRUN_PYTHON": sys.executable,
        "RLRUN_TORCHRUN": str(torchrun) if torchrun.exists() else f"{sys.executable} -m torch.distributed.run",
    })
    env.update(extra)
    return env


class Procs:
    """Process groups started by a test; all killed at teardown if still running."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def start(self, argv: list[str], env: dict[str, str], log: Path, cwd: Path = REPO) -> subprocess.Popen:
        with open(log, "wb") as out:
            proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True)
        self.procs.append(proc)
        return proc

    def wait_all(self, timeout: float) -> list[int]:
        deadline = time.monotonic() + timeout
        for proc in self.procs:
            try:
                proc.wait(timeout=max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                self.kill_all()
                raise TimeoutError(f"{proc.args!r} still running after {timeout:.0f} s; killed") from None
        return [proc.returncode for proc in self.procs]

    def kill_all(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                try:
                    os.killpg(proc.pid, signal.SIGTERM)
                    proc.wait(timeout=10)
                except (ProcessLookupError, subprocess.TimeoutExpired):
                    try:
                        os.killpg(proc.pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
                    proc.wait(timeout=10)


@dataclass
class SlurmCluster:
    """slurmctld + `nodes` slurmd daemons on this host, nodes named <prefix>1..N, `cpus` each."""

    root: Path
    nodes: int = 2
    cpus: int = 2
    gpus: int = 8  # count-only GPU gres (no devices): lets `--gres=gpu:N` and SLURM_GPUS_ON_NODE work
    prefix: str = field(default_factory=lambda: f"rlrun{os.getpid()}n")  # unique: sessions may overlap
    started: list[str] = field(default_factory=list)
    munge_dir: Path | None = None

    @property
    def munge_socket(self) -> Path:
        # munged wants every directory above its socket world-searchable, which pytest's 0700 temp
        # directories are not, and unix socket paths are short: a directory of its own in /tmp.
        if self.munge_dir is None:
            self.munge_dir = Path(tempfile.mkdtemp(prefix="rlrun-munge-"))
            os.chmod(self.munge_dir, 0o755)
        return self.munge_dir / "munge.socket"

    @property
    def conf(self) -> Path:
        return self.root / "etc" / "slurm.conf"

    @property
    def node_names(self) -> list[str]:
        return [f"{self.prefix}{i}" for i in range(1, self.nodes + 1)]

    def env(self, **extra: str) -> dict[str, str]:
        env = dict(os.environ)
        env["SLURM_CONF"] = str(self.conf)
        env["PATH"] = os.pathsep.join([env.get("PATH", ""), *SBIN])
        for key in [k for k in env if k.startswith(("SLURM_", "SBATCH_", "SRUN_", "SALLOC_")) and k != "SLURM_CONF"]:
            del env[key]  # a test run inside a Slurm job must not leak that job's settings into ours
        env.update(extra)
        return env

    def _write_config(self) -> None:
        for sub in ("etc", "state", "spool", "log", "run", "munge"):
            (self.root / sub).mkdir(parents=True, exist_ok=True)
        os.chmod(self.root / "munge", 0o755)
        key = self.root / "munge" / "munge.key"
        if not key.exists():
            key.write_bytes(os.urandom(128))
            os.chmod(key, 0o400)
        ctld_port = free_port()
        node_port = free_port_range(self.nodes)
        r = self.root
        names = f"{self.prefix}[1-{self.nodes}]" if self.nodes > 1 else f"{self.prefix}1"
        ports = f"[{node_port}-{node_port + self.nodes - 1}]" if self.nodes > 1 else str(node_port)
        self.conf.write_text(f"""\
# Written by tests/scripts/cluster_sim.py for one test session.
ClusterName=rlruntest
SlurmctldHost=localhost
SlurmctldPort={ctld_port}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
CredType=cred/munge
AuthInfo=socket={self.munge_socket}
MailProg=/bin/true
StateSaveLocation={r}/state
SlurmdSpoolDir={r}/spool/%n
SlurmctldPidFile={r}/run/slurmctld.pid
SlurmdPidFile={r}/run/slurmd-%n.pid
SlurmctldLogFile={r}/log/slurmctld.log
SlurmdLogFile={r}/log/slurmd-%n.log
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
MpiDefault=none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
GresTypes=gpu
ReturnToService=2
MinJobAge=4
KillWait=5
InactiveLimit=0
SlurmdTimeout=60
NodeName={names} NodeHostname=localhost NodeAddr=127.0.0.1 Port={ports} CPUs={self.cpus} Gres=gpu:{self.gpus} State=UNKNOWN
PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")
        # Slurm 22.05 drops GPUs without a device file; stand-in character devices (same numbers
        # as /dev/null) make a count-only gres that `--gres=gpu:N` and SLURM_GPUS_ON_NODE honour.
        dev = self.root / "dev"
        dev.mkdir(exist_ok=True)
        for i in range(self.gpus):
            path = dev / f"nvidia{i}"
            if not path.exists():
                os.mknod(path, 0o666 | stat.S_IFCHR, os.makedev(1, 3))
        (self.root / "etc" / "gres.conf").write_text(
            f"NodeName={names} Name=gpu File={dev}/nvidia[0-{self.gpus - 1}]\n")
        for name in self.node_names:
            (self.root / "spool" / name).mkdir(exist_ok=True)

    def start(self, timeout: float = 60) -> None:
        ensure_cluster_deps()
        self._write_config()
        env = self.env()
        r = self.root
        munge_sock = self.munge_socket
        run([which("munged") or "munged", f"--socket={munge_sock}", f"--key-file={r / 'munge' / 'munge.key'}",
             f"--pid-file={r / 'run' / 'munged.pid'}", f"--log-file={r / 'log' / 'munged.log'}",
             f"--seed-file={r / 'munge' / 'munged.seed'}"], env=env)
        self.started.append("munged")
        # Node names resolve through /etc/hosts (slurmctld and srun look them up).
        _remove_hosts_lines()  # leftovers of killed sessions
        _add_hosts_lines([f"127.0.0.1 {name}" for name in self.node_names])
        self.started.append("hosts")
        run([which("slurmctld") or "slurmctld", "-i"], env=env)  # -i: ignore state from an earlier session
        self.started.append("slurmctld")
        for name in self.node_names:
            run([which("slurmd") or "slurmd", "-N", name], env=env)
            self.started.append(f"slurmd:{name}")
        deadline = time.monotonic() + timeout
        last = ""
        while time.monotonic() < deadline:
            proc = run(["sinfo", "-h", "-N", "-o", "%N %t"], env=env, check=False)
            last = (proc.stdout + proc.stderr).strip()
            states = dict(line.split() for line in proc.stdout.splitlines() if len(line.split()) == 2)
            if proc.returncode == 0 and all(states.get(n) == "idle" for n in self.node_names):
                return
            time.sleep(0.3)
        raise RuntimeError(f"slurm nodes did not become idle in {timeout:.0f} s: {last}\n{self.logs_tail()}")

    def logs_tail(self, lines: int = 30) -> str:
        out = []
        for log in sorted((self.root / "log").glob("*.log")):
            text = log.read_text(errors="replace").splitlines()[-lines:]
            out.append(f"--- {log.name}\n" + "\n".join(text))
        return "\n".join(out)

    def stop(self) -> None:
        """Cancel jobs, shut the daemons down (escalating to SIGKILL), stop munged, restore /etc/hosts."""
        env = self.env()
        r = self.root
        try:
            if "slurmctld" in self.started:
                run(["scancel", "--full", "--user", "root"], env=env, check=False, timeout=15)
                run(["scontrol", "shutdown"], env=env, check=False, timeout=15)
        except (subprocess.TimeoutExpired, OSError):
            pass
        pids = [_kill_pidfile(r / "run" / f"slurmd-{n}.pid") for n in self.node_names]
        pids.append(_kill_pidfile(r / "run" / "slurmctld.pid"))
        for pid in pids:
            if not _wait_gone(pid, 10) and pid is not None:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
        # Job steps (slurmstepd and their children) outlive slurmd if it dies first.
        self._kill_leftover_steps()
        if "munged" in self.started:
            munge_sock = self.munge_socket
            try:
                run([which("munged") or "munged", f"--socket={munge_sock}", "--stop"], env=env, check=False, timeout=15)
            except (subprocess.TimeoutExpired, OSError):
                pass
            pid = _kill_pidfile(r / "run" / "munged.pid", signal.SIGKILL)
            _wait_gone(pid, 5)
        if self.munge_dir is not None:
            shutil.rmtree(self.munge_dir, ignore_errors=True)
        if "hosts" in self.started:
            _remove_hosts_lines(owner_pid=int(self.prefix[5:-1]) if self.prefix[5:-1].isdigit() else None)
        self.started.clear()

    def _kill_leftover_steps(self) -> None:
        spool = str(self.root / "spool")
        for proc_dir in Path("/proc").iterdir():
            if not proc_dir.name.isdigit():
                continue
            try:
                cmdline = (proc_dir / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (proc_dir / "environ").read_bytes()
            except OSError:
                continue
            # slurmstepd and every job process carry our SLURM_CONF in their environment.
            if f"SLURM_CONF={self.conf}".encode() in environ.split(b"\0") or (
                    "slurmstepd" in cmdline and spool in cmdline):
                try:
                    os.kill(int(proc_dir.name), signal.SIGKILL)
                except (ProcessLookupError, PermissionError):
                    pass

    def sbatch_wait(self, args: list[str], timeout: float, env: dict[str, str] | None = None,
                    cwd: Path | None = None) -> tuple[int, str, str]:
        """`sbatch --parsable ARGS`, then the job's end: (exit code, job id, sbatch output). The exit code is the one
        `sbatch --wait` returns (the batch script's status, 128 + signal if killed); it is read from scontrol's job
        record every 0.2 s instead of sbatch's own 2 s poll. Cancels the job on timeout."""
        env = env or self.env()
        deadline = time.monotonic() + timeout
        proc = run(["sbatch", "--parsable", *args], env=env, cwd=cwd, check=False, timeout=timeout)
        out = proc.stdout + proc.stderr
        first = proc.stdout.strip().splitlines()[0] if proc.stdout.strip() else ""
        job_id = first.split(";")[0]
        if proc.returncode != 0 or not job_id.isdigit():
            return proc.returncode or 1, job_id, out
        while time.monotonic() < deadline:
            shown = run(["scontrol", "-o", "show", "job", job_id], env=env, check=False)
            fields = dict(f.split("=", 1) for f in shown.stdout.split() if "=" in f)
            if "JobState" not in fields:
                raise RuntimeError(f"scontrol has no record of job {job_id}: {shown.stdout}{shown.stderr}")
            # COMPLETING: the script has ended but Slurm is still stopping the job's processes.
            if fields["JobState"] not in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
                status, _, signal_number = fields.get("ExitCode", "1:0").partition(":")
                return (128 + int(signal_number) if int(signal_number or 0) else int(status)), job_id, out
            time.sleep(0.2)
        run(["scancel", job_id], env=env, check=False, timeout=15)
        raise TimeoutError(f"job {job_id} did not finish in {timeout:.0f} s: {out}")


def assert_two_nodes_trained(log: str, log_dir: Path, save: Path, head: str, rdzv: str) -> None:
    """A 3-step job on two nodes, one torchrun with one process each, ended well and saved once."""
    assert "2 node(s)" in log and "1 process(es) per node, world size 2" in log, log
    assert f"head={head}:" in log and f"rdzv {rdzv}" in log, log
    for node in (0, 1):
        assert re.search(rf"^{node}: rlrun: node {node}/2 .*starting torchrun with 1 process", log, re.M), log
        assert (log_dir / f"node-{node}.log").exists()
    assert "saved the policy" in log and "training finished (exit 0)" in log, log
    assert len((save / "metrics.jsonl").read_text().splitlines()) == 3
    node_logs = [(log_dir / f"node-{n}.log").read_text() for n in (0, 1)]
    assert sum("saved the policy" in text for text in node_logs) == 1


@dataclass
class NetnsHosts:
    """Two hosts as network namespaces on one veth link: name[0] = 10.77.0.1, name[1] = 10.77.0.2.

    Commands run on a host through `nsenter --net` + `unshare --mount --uts`, with the host's own
    hostname and a hosts file bind-mounted over /etc/hosts (so name lookups see only that file)."""

    root: Path
    names: tuple[str, ...] = field(default_factory=lambda: (f"rlrun{os.getpid()}h0", f"rlrun{os.getpid()}h1"))
    hostnames: tuple[str, ...] = ("headpod", "workerpod")
    hosts_lines: tuple[str, ...] = ()
    created: list[str] = field(default_factory=list)

    def address(self, i: int) -> str:
        return f"10.77.0.{i + 1}"

    def start(self) -> None:
        ensure_cluster_deps()
        ip = which("ip") or "ip"
        self._sweep_stale(ip)
        for name in self.names:
            run([ip, "netns", "delete", name], check=False)
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            run([ip, "netns", "add", self.names[0]])
        except RuntimeError as exc:
            raise Unavailable(f"cannot create network namespaces (ip netns add): {exc}") from None
        self.created.append(self.names[0])
        run([ip, "netns", "add", self.names[1]])
        self.created.append(self.names[1])
        run([ip, "link", "add", "name", "eth0", "netns", self.names[0], "type", "veth",
             "peer", "name", "eth0", "netns", self.names[1]])
        base = "\n".join(["127.0.0.1 localhost", *self.hosts_lines]) + "\n"
        for i, name in enumerate(self.names):
            ns = ["nsenter", f"--net=/run/netns/{name}"]
            run([*ns, ip, "addr", "add", f"{self.address(i)}/24", "dev", "eth0"])
            run([*ns, ip, "link", "set", "lo", "up"])
            run([*ns, ip, "link", "set", "eth0", "up"])
            # A dead peer should fail fast, not after ~15 min of TCP retries.
            run([*ns, "sysctl", "-q", "-w", "net.ipv4.tcp_retries2=5"], check=False)
            hosts = self.root / f"hosts-{name}"
            hosts.write_text(base + f"{self.address(i)} {self.hostnames[i]}\n")
        # Wait until the link carries traffic both ways (veth comes up asynchronously).
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            probe = run(["nsenter", f"--net=/run/netns/{self.names[1]}", sys.executable, "-c",
                         "import socket,sys; s=socket.socket(); s.settimeout(0.5);"
                         f"r=s.connect_ex(('{self.address(0)}', 9)); sys.exit(0 if r in (0, 111) else 1)"],
                        check=False)
            if probe.returncode == 0:
                return
            time.sleep(0.2)
        raise RuntimeError("veth link between the namespaces did not come up in 10 s")

    @staticmethod
    def _sweep_stale(ip: str) -> None:
        # Namespaces of test sessions that were killed before their finalizers ran.
        listing = run([ip, "netns", "list"], check=False).stdout.split()
        for name in listing:
            if name.startswith("rlrun") and name[-2:] in ("h0", "h1") and name[5:-2].isdigit():
                if not _pid_alive(int(name[5:-2])):
                    for pid in run([ip, "netns", "pids", name], check=False).stdout.split():
                        try:
                            os.kill(int(pid), signal.SIGKILL)
                        except (ProcessLookupError, ValueError):
                            pass
                    run([ip, "netns", "delete", name], check=False)

    def command(self, i: int, argv: list[str]) -> list[str]:
        """argv wrapped to run on host i: own network, own mount + UTS namespace, hostname, hosts file."""
        name, hosts = self.names[i], self.root / f"hosts-{self.names[i]}"
        script = (f"mount --bind {hosts} /etc/hosts && hostname {self.hostnames[i]} && exec \"$@\"")
        return ["nsenter", f"--net=/run/netns/{name}", "unshare", "--mount", "--uts", "--propagation", "private",
                "bash", "-c", script, "netns-host", *argv]

    def stop(self) -> None:
        ip = which("ip") or "ip"
        for name in reversed(self.created):
            # Processes still inside keep the namespace alive; kill them first.
            pids = run([ip, "netns", "pids", name], check=False).stdout.split()
            for pid in pids:
                try:
                    os.kill(int(pid), signal.SIGKILL)
                except (ProcessLookupError, ValueError):
                    pass
            run([ip, "netns", "delete", name], check=False)
        self.created.clear()


def _main(argv: list[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("slurm-up", "slurm-down"):
        print(__doc__)
        return 2
    root = Path(argv[1]).resolve()
    cluster = SlurmCluster(root)
    if argv[0] == "slurm-up":
        cluster.start()
        (root / "prefix").write_text(cluster.prefix)
        print(f"export SLURM_CONF={cluster.conf}  # nodes {', '.join(cluster.node_names)}")
    else:
        cluster.prefix = (root / "prefix").read_text().strip()
        cluster.started = ["munged", "hosts", "slurmctld"]
        cluster.stop()
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
