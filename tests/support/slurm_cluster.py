"""A two-node SLURM cluster on this machine, for tests: Debian's slurmctld and one slurmd per node,
each node a network namespace with its own host name and address (a veth pair on a bridge), and a
munged with a key of its own. Everything lives under one directory and ends with the block.

Network namespaces, not SLURM's multiple-slurmd mode: each node then resolves its own name to its
own address, as a real node does, which is what run.py's node-name and loopback checks read.
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from megatron_ext.launch.network import CLAIMS_DIR, free_port

NODES = ("node0", "node1")
TOOLS = ("munged", "mungekey", "slurmctld", "slurmd", "sbatch", "scancel", "scontrol", "sinfo", "ip", "nsenter",
         "unshare")
INSTALL = "apt-get install -y slurmctld slurmd slurm-client munge"


def unavailable() -> str | None:
    """Why this machine cannot start the cluster, in one line (None: it can)."""
    missing = [name for name in TOOLS if not shutil.which(name)]
    if missing:
        return f"{', '.join(missing)} not found; install SLURM and munge as root: {INSTALL}"
    if os.geteuid() != 0:
        return "a SLURM cluster in network namespaces needs root"
    return None


def _sh(*args: str) -> str:
    return subprocess.run(args, check=True, capture_output=True, text=True, timeout=60).stdout


@dataclass
class Cluster:
    root: Path
    tag: str = field(default_factory=lambda: f"mx{os.getpid() % 100000}")
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def subnet(self) -> str:
        return f"10.213.{os.getpid() % 250}"

    def address(self, index: int) -> str:
        return f"{self.subnet}.{index + 2}"  # .1 is the bridge: the controller's side

    def namespace(self, index: int) -> str:
        return f"{self.tag}n{index}"

    @property
    def env(self) -> dict[str, str]:
        """What SLURM's commands need to find this cluster."""
        return {"SLURM_CONF": str(self.root / "slurm.conf")}

    def command(self, *args: str, env: dict | None = None, cwd: Path | None = None) -> str:
        result = subprocess.run(args, capture_output=True, text=True, timeout=60, cwd=cwd,
                                env={**(env or os.environ), **self.env})
        assert result.returncode == 0, (args, result.stdout, result.stderr)
        return result.stdout

    def sbatch(self, script: Path, *options: str, env: dict, cwd: Path) -> str:
        """Submits `script`; returns the job id."""
        return self.command("sbatch", "--parsable", *options, str(script), env=env, cwd=cwd).strip()

    def job(self, job_id: str) -> dict[str, str]:
        """`scontrol show job`'s fields (JobState, ExitCode, ...)."""
        text = self.command("scontrol", "-o", "show", "job", job_id)
        return dict(re.findall(r"(\w+)=(\S*)", text))

    def wait_ended(self, job_id: str, timeout: float) -> dict[str, str]:
        deadline = time.monotonic() + timeout
        while (job := self.job(job_id))["JobState"] in ("PENDING", "CONFIGURING", "RUNNING", "COMPLETING"):
            assert time.monotonic() < deadline, (job, self.logs())
            time.sleep(0.5)
        return job

    def logs(self) -> str:
        """The daemons' logs and output, for a failed assertion."""
        logs = sorted([*self.root.glob("*.log"), *self.root.glob("*.out")])
        return "\n".join(f"== {log.name}\n{log.read_text()[-3000:]}" for log in logs)

    # -- starting and stopping

    def start(self) -> None:
        self._network()
        self._munge()
        self._write_conf()
        (self.root / "state").mkdir()
        self._daemon(["slurmctld", "-D", "-i", "-f", self.env["SLURM_CONF"]])
        for index, node in enumerate(NODES):
            self._slurmd(index, node)
        self.wait_idle(60)

    def stop(self) -> None:
        with contextlib.suppress(Exception):
            self.command("scancel", "--full", "--signal=KILL", "--partition=test")
        for index in range(len(NODES)):  # slurmstepd and the jobs' processes are children of no daemon
            for pid in subprocess.run(["ip", "netns", "pids", self.namespace(index)], capture_output=True,
                                      text=True).stdout.split():
                with contextlib.suppress(ProcessLookupError):
                    os.kill(int(pid), signal.SIGKILL)
        for proc in reversed(self.procs):
            proc.kill()
            proc.wait()
        for index in range(len(NODES)):
            subprocess.run(["ip", "netns", "del", self.namespace(index)], capture_output=True)
        subprocess.run(["ip", "link", "del", f"{self.tag}br"], capture_output=True)

    def _slurmd(self, index: int, node: str) -> None:
        """Node `node`'s slurmd, in its network namespace and mount and host-name namespaces of its own:
        there /etc/hosts names every node, and run.py's port claims (flocks in /tmp, which real nodes
        share with no other machine) are the node's own. Not `ip netns exec`: it mounts a fresh /sys,
        without the cgroup file systems slurmd needs."""
        spool, claims = self.root / f"spool-{node}", self.root / f"port-claims-{node}"
        spool.mkdir()
        claims.mkdir()
        claims.chmod(0o1777)
        with contextlib.suppress(FileExistsError):  # the mount point, as run.py makes it
            CLAIMS_DIR.mkdir()
            CLAIMS_DIR.chmod(0o1777)
        mounts = f'mount --bind "$1" /etc/hosts && mount --bind "$2" {CLAIMS_DIR}'
        self._daemon(["nsenter", f"--net=/run/netns/{self.namespace(index)}", "unshare", "--mount", "--uts", "sh", "-c",
                      f'{mounts} && hostname {node} && exec slurmd -D -f "$0" -N {node}',
                      self.env["SLURM_CONF"], str(self.root / "hosts"), str(claims)])

    def _network(self) -> None:
        bridge = f"{self.tag}br"
        _sh("ip", "link", "add", bridge, "type", "bridge")
        _sh("ip", "addr", "add", f"{self.subnet}.1/24", "dev", bridge)
        _sh("ip", "link", "set", bridge, "up")
        # Each node's /etc/hosts (mounted over it in the node's own mount namespace): every node's name.
        (self.root / "hosts").write_text("127.0.0.1 localhost\n" + "".join(
            f"{self.address(i)} {node}\n" for i, node in enumerate(NODES)))
        for index in range(len(NODES)):
            ns, outside, inside = self.namespace(index), f"{self.tag}v{index}", f"{self.tag}i{index}"
            _sh("ip", "netns", "add", ns)
            _sh("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            _sh("ip", "link", "set", outside, "master", bridge, "up")
            _sh("ip", "link", "set", inside, "netns", ns)
            _sh("ip", "-n", ns, "addr", "add", f"{self.address(index)}/24", "dev", inside)
            _sh("ip", "-n", ns, "link", "set", inside, "up")
            _sh("ip", "-n", ns, "link", "set", "lo", "up")

    def _munge(self) -> None:
        munge = self.root / "munge"
        munge.mkdir(mode=0o700)
        _sh("mungekey", "--create", "--keyfile", str(munge / "munge.key"))
        self._daemon(["munged", "--foreground", "--force", f"--socket={munge / 'socket'}",
                      f"--key-file={munge / 'munge.key'}", f"--pid-file={munge / 'munged.pid'}",
                      f"--seed-file={munge / 'seed'}", f"--log-file={self.root / 'munged.log'}"])
        deadline = time.monotonic() + 30
        while not (munge / "socket").exists():
            assert time.monotonic() < deadline, self.logs()
            time.sleep(0.1)

    def _write_conf(self) -> None:
        root, controller = self.root, socket.gethostname().split(".")[0]
        nodes = "".join(f"NodeName={node} NodeAddr={self.address(i)} CPUs=1 State=UNKNOWN\n"
                        for i, node in enumerate(NODES))
        (root / "slurm.conf").write_text(f"""\
ClusterName={self.tag}
SlurmctldHost={controller}({self.subnet}.1)
SlurmctldPort={free_port()}
SlurmdPort={free_port()}
SlurmUser=root
SlurmdUser=root
AuthType=auth/munge
AuthInfo=socket={root / 'munge' / 'socket'}
StateSaveLocation={root / 'state'}
SlurmdSpoolDir={root / 'spool-%n'}
SlurmctldPidFile={root / 'slurmctld.pid'}
SlurmdPidFile={root / 'slurmd-%n.pid'}
SlurmctldLogFile={root / 'slurmctld.log'}
SlurmdLogFile={root / 'slurmd-%n.log'}
ProctrackType=proctrack/linuxproc
TaskPlugin=task/none
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
SelectType=select/cons_tres
SlurmdParameters=config_overrides
SchedulerType=sched/builtin
ReturnToService=2
KillWait=30
{nodes}PartitionName=test Nodes=ALL Default=YES MaxTime=INFINITE State=UP
""")

    def _daemon(self, args: list[str]) -> None:
        log = open(self.root / f"{Path(args[0]).name}-{len(self.procs)}.out", "w")
        self.procs.append(subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT, start_new_session=True))

    def wait_idle(self, timeout: float) -> None:
        """Until every node is idle (a job that ended is fully cleaned up)."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(AssertionError, subprocess.TimeoutExpired):
                states = self.command("sinfo", "-h", "-N", "-o", "%N %T").split()
                if states.count("idle") == len(NODES):
                    return
            assert time.monotonic() < deadline and all(p.poll() is None for p in self.procs), self.logs()
            time.sleep(0.5)


@contextlib.contextmanager
def two_node_cluster(root: Path):
    """A started Cluster under `root`, stopped (every job killed, namespaces removed) when the block ends."""
    cluster = Cluster(root)
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
