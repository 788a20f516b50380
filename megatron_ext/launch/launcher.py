"""run.py's work: flags -> where to run (topology) -> trainer options -> command, then print or run it."""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import os
import sys
from dataclasses import dataclass
from typing import Mapping

from megatron_ext.errors import UserError
from megatron_ext.launch import network, run_dirs, runner, start_failures
from megatron_ext.launch.command import LaunchCommand, build_command
from megatron_ext.launch.devices import budget
from megatron_ext.launch.flags import LaunchOptions, passthrough_options
from megatron_ext.launch.slurm import slurm_job
from megatron_ext.launch.topology import JOIN_TIMEOUT_S, Topology, resolve_topology
from megatron_ext.launch.trainer_args import TrainerSetup, trainer_setup
from megatron_ext.memory.check import check_memory
from megatron_ext.train import run_lock


@dataclass(frozen=True)
class Launch:
    topology: Topology
    trainer: TrainerSetup
    command: LaunchCommand

    def summary(self) -> list[str]:
        t, plan = self.topology, self.trainer.plan
        c, dp = plan.config, plan.execution.data_parallel_size
        device = "GPU" if t.on_gpu else "CPU (gloo)"
        cp = f" x cp {c.cp}" if c.cp > 1 else ""
        lines = [f"{t.nnodes} node(s) x {t.nproc_per_node} {device} process(es): tp {c.tp} x pp {c.pp}{cp} x dp {dp}; "
                 f"global batch {c.global_batch_size} = micro batch {c.micro_batch_size} x dp {dp} x "
                 f"{plan.num_microbatches} micro-batches; stage {c.stage}"]
        lines += t.notes + list(plan.notes) + list(self.command.notes)
        if self.command.log_file:
            lines.append(f"output also written to {self.command.log_file}")
        return lines


def _check_devices(topology: Topology, options: LaunchOptions) -> None:
    if not topology.on_gpu and options.trainer["distributed_backend"] == "nccl":
        raise UserError("--backend nccl needs CUDA GPUs and none were found; use --backend gloo (the CPU default)")


def _check_save_dir_free(config, topology: Topology) -> None:
    """A live run on --save-dir: refused here already on one node (the trainer's lock decides on several,
    where this node's run.py may start after rank 0 took the lock)."""
    if config.save and config.save_dir and topology.nnodes == 1:
        holder = run_lock.live_holder(config.save_dir)
        if holder is not None:
            raise run_lock.in_use_error(config.save_dir, holder)


def _transformer_engine(topology: Topology, sif_path: str | None) -> bool:
    """Whether the trainer will find Transformer Engine: the image has it (environments/recipe_latest.def
    installs it; the trainer checks again inside), else it must be importable here, with GPUs."""
    if sif_path:
        return True
    return topology.on_gpu and importlib.util.find_spec("transformer_engine") is not None


def prepare(options: LaunchOptions, passthrough_argv: list[str], env: Mapping[str, str]) -> Launch:
    """Everything decided and checked; nothing started."""
    topology = resolve_topology(options, env, slurm_job(env), options.trainer["name"])
    _check_network(topology, options)
    return _prepare_on(topology, options, passthrough_argv)


def _check_network(topology: Topology, options: LaunchOptions) -> None:
    # A dry run may print the command for another machine (a cluster's node), as it does for singularity:
    # this machine's interfaces and name are checked only where the run starts.
    if options.interface and not options.dry_run:
        network.check_interface(options.interface)
    if topology.nnodes > 1:
        network.check_reachable(topology.master_addr, options.interface, topology.nnodes, this_node=not options.dry_run)


def _prepare_on(topology: Topology, options: LaunchOptions, passthrough_argv: list[str]) -> Launch:
    """What `prepare` decides once the nodes can reach each other."""
    passthrough = passthrough_options(passthrough_argv)
    _check_devices(topology, options)
    setup = trainer_setup(dict(options.trainer), passthrough, topology.world_size,
                          _transformer_engine(topology, options.sif_path), topology.on_gpu)
    _check_save_dir_free(setup.plan.config, topology)
    return Launch(topology=topology, trainer=setup, command=_command(topology, setup, options))


def _command(topology: Topology, setup: TrainerSetup, options: LaunchOptions) -> LaunchCommand:
    return build_command(topology, setup.plan.config, setup.argv, setup.plan.paths(), options.sif_path,
                         options.interface, options.slurm_output_name, dry_run=options.dry_run)


# A default port taken again and again at bind time is not a race any more: something is wrong.
PORT_RETRIES = 3


def _port_taken(launch: Launch, options: LaunchOptions, retries_left: int) -> Launch:
    """The launch again on a free port, when run.py chose the port that torchrun found taken; else one line."""
    t = launch.topology
    port, flag = (t.rdzv_port, "--rdzv-port") if t.rdzv_port is not None else (t.master_port, "-p/--master-port")
    chosen_here = t.rdzv_port is None and options.master_port is None and t.nnodes == 1
    if not chosen_here or not retries_left:
        raise UserError(f"{flag} {port} was taken by another process while the run started; choose another, "
                        f"e.g. {flag} {network.free_port()}")
    topology = dataclasses.replace(t, master_port=network.take_free_port())
    print(f"run.py: port {port} was taken by another process while the run started; starting again on free port "
          f"{topology.master_port}", file=sys.stderr, flush=True)
    return Launch(topology=topology, trainer=launch.trainer, command=_command(topology, launch.trainer, options))


def _peer_refused(refusal: str) -> UserError:
    host, _, message = refusal.partition(": ")
    return UserError(f"the run did not start on node {host}: {message}")


@contextlib.contextmanager
def _told_to_other_nodes(topology: Topology, dry_run: bool):
    """A refusal on one node of several: said here at once, then left for the other nodes' run.py
    (start_failures), which would otherwise wait for this one in vain."""
    try:
        yield
    except UserError as refusal:
        if topology.nnodes == 1 or dry_run:
            raise
        print(f"error: {refusal}", file=sys.stderr, flush=True)
        start_failures.tell(topology, str(refusal))
        sys.exit(2)


def _peers_missing(t: Topology) -> UserError:
    where = f"{t.master_addr}:{t.rdzv_port if t.rdzv_port is not None else t.master_port}"
    return UserError(f"the other nodes did not join within {JOIN_TIMEOUT_S} s (rendezvous {where}): one failed to "
                     "start (its own output says why) or was not started; start every node's run.py together")


def _plans_memory(launch: Launch, options: LaunchOptions) -> bool:
    """Dry runs and GPU launches get a memory plan (a launch of CPU processes has no GPU to fit),
    unless --no-memory-check: the launcher then imports no torch, as before the plan existed."""
    return not options.no_memory_check and (options.dry_run or launch.topology.on_gpu)


def main(options: LaunchOptions, passthrough_argv: list[str]) -> int:
    topology = resolve_topology(options, os.environ, slurm_job(os.environ), options.trainer["name"])
    _check_network(topology, options)  # a node that cannot reach the others cannot tell them either
    with _told_to_other_nodes(topology, options.dry_run):
        launch = _prepare_on(topology, options, passthrough_argv)
        lines = launch.summary()
        if _plans_memory(launch, options):
            lines += check_memory(launch.trainer.plan, budget(options.gpu_memory, os.environ))
    for line in lines:
        print(f"run.py: {line}", file=sys.stderr)
    if options.dry_run:
        print(launch.command.shell(), flush=True)
        return 0
    for retries_left in reversed(range(PORT_RETRIES + 1)):
        print(f"+ {launch.command.shell()}", file=sys.stderr, flush=True)
        outcome = _run(launch)
        if outcome.peer_refusal is not None:
            raise _peer_refused(outcome.peer_refusal)
        if outcome.peers_missing:
            raise _peers_missing(launch.topology)
        if not outcome.port_taken:
            return outcome.status
        launch = _port_taken(launch, options, retries_left)


def _run(launch: Launch) -> runner.Outcome:
    """The launch run; on several nodes, watched for another node's refusal to start until its ranks start."""
    watch = start_failures.RefusalWatch(launch.topology).start() if launch.topology.nnodes > 1 else None
    try:
        return runner.run(launch.command.argv, launch.command.env, launch.command.log_file,
                          run_dirs.run_key(launch.trainer.argv), watch)
    finally:
        if watch is not None:
            watch.stop()


def print_layout_plans(options: LaunchOptions, passthrough_argv: list[str], layouts: str | None) -> int:
    """`megatron-ext-train plan`: the run's memory plan at each layout, side by side."""
    from megatron_ext.logs import quiet_megatron_core

    with quiet_megatron_core():
        from megatron_ext.memory.plan import layout_plans, parse_layouts, side_by_side

        launch = prepare(dataclasses.replace(options, dry_run=True), passthrough_argv, os.environ)
        plan = launch.trainer.plan
        chosen = parse_layouts(layouts) if layouts else [(plan.config.tp, plan.config.pp)]
        plans = layout_plans(plan, budget(options.gpu_memory, os.environ), chosen)
    for line in side_by_side(plans):
        print(line)
    return 0
