"""Where the processes run: nodes, this node's rank, processes per node, master address and ports.

Each value comes from its flag when given, else from SLURM, else from this machine (GPUs found,
a single node on 127.0.0.1). Two ways to meet: a static rendezvous (every node knows its rank and
the master's address and port) or, with --rdzv-port, torchrun's c10d rendezvous, which assigns
node ranks itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from megatron_ext.errors import UserError
from megatron_ext.launch import devices, network
from megatron_ext.launch.flags import LaunchOptions
from megatron_ext.launch.slurm import SlurmJob

LOCALHOST = "127.0.0.1"


# How long torchrun waits for the other nodes to join (its default: 10 minutes). A node that failed
# at start never joins; its peers then end within a minute (a connecting node tries twice, plus a
# pause) instead of holding the allocation. Every node's run.py must start within this many seconds
# of the first (srun starts them together).
JOIN_TIMEOUT_S = 15


@dataclass(frozen=True)
class Topology:
    nnodes: int
    nproc_per_node: int
    node_rank: int | None  # unknown (None) or only informative with c10d rendezvous: torchrun assigns it
    master_addr: str
    master_port: int | None  # static rendezvous
    rdzv_port: int | None  # c10d rendezvous
    rdzv_id: str
    on_gpu: bool
    cuda_visible_devices: str | None  # from --gpu-ids
    job_id: str | None
    notes: list[str] = field(default_factory=list)

    @property
    def world_size(self) -> int:
        return self.nnodes * self.nproc_per_node

    def torchrun_args(self) -> list[str]:
        args = ["--nnodes", str(self.nnodes), "--nproc-per-node", str(self.nproc_per_node)]
        if self.rdzv_port is not None:
            args += ["--rdzv-backend", "c10d", "--rdzv-endpoint", f"{self.master_addr}:{self.rdzv_port}",
                     "--rdzv-id", self.rdzv_id]
        else:
            args += ["--node-rank", str(self.node_rank), "--master-addr", self.master_addr,
                     "--master-port", str(self.master_port)]
        if self.nnodes > 1:
            args += ["--rdzv-conf", f"{'join_timeout' if self.rdzv_port is not None else 'timeout'}={JOIN_TIMEOUT_S}"]
        return args


def _processes(gpus: int, gpu_ids: str, physical: int, visible: int, slurm: SlurmJob | None) -> tuple[int, str | None]:
    """(processes per node, CUDA_VISIBLE_DEVICES to set)."""
    if gpus == 0 or gpus < -1:
        raise UserError(f"-g/--gpus {gpus}: give -1 (all GPUs) or a number of processes >= 1")
    if gpu_ids:
        ids = devices.parse_gpu_ids(gpu_ids, physical)
        if gpus not in (-1, len(ids)):
            raise UserError(f"-g/--gpus {gpus} does not match --gpu-ids {gpu_ids} ({len(ids)} GPUs)")
        return len(ids), ",".join(ids)
    if gpus == -1:
        if not visible:
            return 1, None
        return (slurm.gpus_on_node if slurm and slurm.gpus_on_node else visible), None
    if visible and gpus > visible:
        raise UserError(f"-g/--gpus {gpus}: only {visible} GPUs are visible on this machine")
    return gpus, None


def _master_port(port: int | None, nnodes: int, notes: list[str], dry_run: bool) -> int:
    """Checked and claimed on the master node: the port must be free, except that a single node replaces a
    busy default. A dry run of several nodes may print the command for another machine: its port is that
    machine's to check."""
    if port is None and nnodes == 1 and not network.take_port(network.DEFAULT_MASTER_PORT):
        port = network.take_free_port()
        notes.append(f"port {network.DEFAULT_MASTER_PORT} is in use; using free port {port} (set one with -p/--master-port)")
        return port
    port = network.DEFAULT_MASTER_PORT if port is None else port
    if not (dry_run and nnodes > 1):
        network.check_port(port, "-p/--master-port")
    return port


def resolve_topology(options: LaunchOptions, env: Mapping[str, str], slurm: SlurmJob | None,
                     run_name: str | None) -> Topology:
    notes: list[str] = []
    physical = devices.physical_gpu_count()
    visible = devices.visible_gpu_count(physical, env)
    nproc, cuda_visible = _processes(options.gpus, options.gpu_ids, physical, visible, slurm)

    nnodes = options.node if options.node is not None else (slurm.nnodes if slurm and slurm.nnodes else 1)
    if nnodes < 1:
        raise UserError(f"--node {nnodes}: the number of nodes must be >= 1")
    rank = options.rank if options.rank is not None else (slurm.node_id if slurm else None)
    if rank is None and nnodes == 1:
        rank = 0
    if rank is not None and not 0 <= rank < nnodes:
        raise UserError(f"-r/--rank {rank} must be in 0..{nnodes - 1} (--node {nnodes})")
    master = options.master_addr or (slurm.master_host if slurm and nnodes > 1 else None)
    if master is None:
        if nnodes > 1:
            raise UserError(f"-m/--master-addr is required with --node {nnodes} (the address of the rank-0 node)")
        master = LOCALHOST

    rdzv_port, master_port = options.rdzv_port, None
    if rdzv_port is not None:
        # The rendezvous server starts here (a dry run of several nodes: on the machine it is for).
        if nnodes == 1 or (network.is_this_host(master) and not options.dry_run):
            network.check_port(rdzv_port, "--rdzv-port")
    elif rank is None:
        raise UserError(f"-r/--rank is required with --node {nnodes} (or use --rdzv-port for c10d rendezvous)")
    elif rank == 0:
        master_port = _master_port(options.master_port, nnodes, notes, options.dry_run)
    else:
        master_port = network.DEFAULT_MASTER_PORT if options.master_port is None else options.master_port

    job_id = options.slurm_job_id or (slurm.job_id if slurm else None)
    return Topology(
        nnodes=nnodes,
        nproc_per_node=nproc,
        node_rank=rank,
        master_addr=master,
        master_port=master_port,
        rdzv_port=rdzv_port,
        rdzv_id=job_id or run_name or "megatron-ext",
        on_gpu=bool(visible or cuda_visible),
        cuda_visible_devices=cuda_visible,
        job_id=job_id,
        notes=notes,
    )
