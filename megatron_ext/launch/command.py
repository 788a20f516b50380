"""The command run.py executes: torchrun (inside the image with --sif-path) and its environment."""

from __future__ import annotations

import shlex
import shutil
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from megatron_ext.config.options import TrainConfig
from megatron_ext.container import (
    RUNTIMES,
    check_sif,
    container_command,
    container_env,
    container_runtime,
    installed_runtime,
)
from megatron_ext.errors import UserError
from megatron_ext.launch.topology import Topology

# Started as a module: found in the checkout (first on PYTHONPATH in a container) or the installed package.
TRAINER_MODULE = "megatron_ext.train.pretrain_llava"
# Reproducible reductions: cuBLAS with a fixed workspace, NCCL's tree algorithm, no
# non-deterministic Transformer Engine kernels (Megatron-LM's --deterministic-mode insists on the last two).
DETERMINISTIC_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Tree", "NVTE_ALLOW_NONDETERMINISTIC_ALGO": "0"}
DEBUG_ENV = {"TORCH_DISTRIBUTED_DEBUG": "INFO", "NCCL_DEBUG": "INFO"}


@dataclass(frozen=True)
class LaunchCommand:
    argv: list[str]
    env: dict[str, str]  # set on top of the inherited environment
    log_file: Path | None  # output is also written here (--slurm-output-name)
    notes: tuple[str, ...] = ()

    def shell(self) -> str:
        """The command as one line a POSIX shell runs as is."""
        return " ".join([*(f"{key}={shlex.quote(value)}" for key, value in self.env.items()), shlex.join(self.argv)])


def trainer_env(topology: Topology, config: TrainConfig, interface: str | None) -> dict[str, str]:
    env = {}
    if topology.cuda_visible_devices:
        env["CUDA_VISIBLE_DEVICES"] = topology.cuda_visible_devices
    if topology.on_gpu:
        env["CUDA_DEVICE_MAX_CONNECTIONS"] = "1"  # megatron-core orders TP communication by it
    if interface:
        env.update(NCCL_SOCKET_IFNAME=interface, GLOO_SOCKET_IFNAME=interface)
    if config.deterministic:
        env.update(DETERMINISTIC_ENV)
    if config.debug:
        env.update(DEBUG_ENV)
    return env


def torchrun_executable() -> str:
    """`torchrun` from PATH, else the one beside this Python (a virtual environment that is not activated)."""
    if shutil.which("torchrun"):
        return "torchrun"
    sibling = Path(sys.executable).with_name("torchrun")
    if sibling.is_file():
        return str(sibling)
    raise UserError("torchrun not found on PATH; activate the Python environment with torch, or run in the image with --sif-path")


def log_file(output_name: str | None, topology: Topology) -> Path | None:
    """--slurm-output-name NAME -> NAME-JOBID.log, with -nodeR (or the host name) on several nodes."""
    if not output_name:
        return None
    parts = [output_name]
    if topology.job_id:
        parts.append(topology.job_id)
    if topology.nnodes > 1:
        parts.append(f"node{topology.node_rank}" if topology.node_rank is not None else socket.gethostname())
    return Path("-".join(parts) + ".log").resolve()


def _bindable(path: Path) -> Path:
    """`path`, or its nearest existing parent when it is still to be created (a new --save-dir)."""
    while not path.exists() and path.parent != path:
        path = path.parent
    return path


def build_command(topology: Topology, config: TrainConfig, trainer_argv: list[str], paths: list[Path],
                  sif_path: str | None, interface: str | None, output_name: str | None,
                  dry_run: bool = False) -> LaunchCommand:
    """The command and its environment. A dry run prints the container command even where no
    container runtime is installed (written for singularity, which apptainer also answers to)."""
    env = trainer_env(topology, config, interface)
    torchrun = [*topology.torchrun_args(), "-m", TRAINER_MODULE, *trainer_argv]
    notes = ()
    if sif_path:
        sif = check_sif(sif_path)
        runtime = installed_runtime() if dry_run else container_runtime()
        if runtime is None:
            runtime = RUNTIMES[0]
            notes = ("neither singularity nor apptainer is installed here: the command is for a machine that has it",)
        argv = container_command(sif, ["torchrun", *torchrun], binds=[_bindable(p) for p in paths], runtime=runtime)
        env = container_env(env, runtime)
    else:
        argv = [torchrun_executable(), *torchrun]
    return LaunchCommand(argv=argv, env=env, log_file=log_file(output_name, topology), notes=notes)
