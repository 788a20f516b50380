"""run.py's flags: one table saying what becomes of each.

Every flag of the original README keeps its name and short form. A row either names the trainer
option (a `TrainConfig` field) the value is passed to, taking type, default and help from that
field, or declares a flag the launcher consumes itself. Trainer options without a run.py flag are
given after `--` and checked by the trainer's own parser (`passthrough_options`).
"""

from __future__ import annotations

import sys
import typing
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any, Mapping

import click
from click.core import ParameterSource

from megatron_ext.config.options import TrainConfig, fields, is_switch, option_name
from megatron_ext.errors import UserError, report, run_command
from megatron_ext.train.cli import click_kwargs, trainer_options


@dataclass(frozen=True)
class Flag:
    name: str
    short: str | None = None
    to: str | None = None  # TrainConfig field the value becomes; None: consumed by the launcher
    type: Any = str
    default: Any = None
    is_flag: bool = False
    help: str = ""  # launcher flags: the help; trainer flags: appended to the field's help

    @property
    def dest(self) -> str:
        return self.to or self.name.lstrip("-").replace("-", "_")


FLAGS: tuple[Flag, ...] = (
    # GPUs
    Flag("--gpus", "-g", type=int, default=-1,
         help="Processes (GPUs) per node. -1: all visible GPUs (SLURM_GPUS_ON_NODE under SLURM); "
              "without CUDA, -1 means 1 process and N means N CPU processes over gloo."),
    Flag("--gpu-ids", default="",
         help="Comma-separated GPU ids (sets CUDA_VISIBLE_DEVICES). With -g -1 the process count is their number."),
    # logging
    Flag("--save", to="save"),
    Flag("--name", to="name"),
    Flag("--wandb", to="wandb"),
    Flag("--log-interval", to="log_interval"),
    # save / load
    Flag("--megatron-load-dir", to="megatron_load_dir"),
    Flag("--tokenizer-load-dir", to="tokenizer_load_dir", help="Image and pad token ids are read from it."),
    Flag("--save-dir", to="save_dir"),
    Flag("--sif-path",
         help="Singularity/Apptainer image: run torchrun inside it (`singularity exec --nv`), with this checkout "
              "and the data, checkpoint, tokenizer and save directories bound."),
    Flag("--save-optim", to="save_optim"),
    Flag("--load-optim", to="load_optim"),
    Flag("--init", to="init"),
    Flag("--save-interval", to="save_interval"),
    Flag("--skip-train-iteration-range", to="skip_train_iteration_range",
         help="Several ranges may follow one flag: --skip-train-iteration-range 100-110 300-400."),
    # model parallel
    Flag("--tp", to="tp"),
    Flag("--pp", to="pp"),
    Flag("--cp", to="cp"),
    Flag("--micro-batch-size", to="micro_batch_size"),
    Flag("--global-batch-size", to="global_batch_size"),
    # distributed
    Flag("--num-workers", to="num_workers"),
    Flag("--node", type=int, help="Number of nodes (default: SLURM_NNODES, else 1)."),
    Flag("--rank", "-r", type=int, help="Rank of this node (default: SLURM_NODEID; 0 on a single node)."),
    Flag("--master-addr", "-m",
         help="Address of the master node (default: the first host of SLURM_JOB_NODELIST; 127.0.0.1 on a single node)."),
    Flag("--master-port", "-p", type=int,
         help="Port of the master node (default: 29500; on a single node a free port when 29500 is taken)."),
    Flag("--backend", to="distributed_backend"),
    Flag("--interface", help="Network interface for NCCL and Gloo (sets NCCL_SOCKET_IFNAME and GLOO_SOCKET_IFNAME), e.g. eth0, ibp75s0."),
    Flag("--rdzv-port", type=int,
         help="Use c10d rendezvous on MASTER-ADDR:PORT instead of fixed node ranks; "
              "several jobs on one node need different ports."),
    Flag("--dist-optim", to="dist_optim"),
    # tokenizer
    Flag("--image-token-id", to="image_token_id"),
    Flag("--pad-token-id", to="pad_token_id"),
    # training
    Flag("--freeze-lm", to="freeze_lm"),
    Flag("--stage", to="stage"),
    Flag("--lang", to="lang"),
    Flag("--image-aspect", to="image_aspect"),
    Flag("--data-path", to="data_path", help="Training length defaults to one epoch of its train split."),
    # SLURM
    Flag("--slurm-job-id", help="SLURM job id (default: SLURM_JOB_ID); names the log file and the rendezvous."),
    Flag("--slurm-output-name", help="Also write the output to NAME-JOBID.log (NAME-JOBID-nodeR.log on several nodes)."),
    # other
    Flag("--fp8", to="fp8"),
    Flag("--fp8-backend", to="fp8_backend"),
    Flag("--no-add-class-token", to="no_add_class_token"),
    # debug
    Flag("--debug", to="debug", help="Also sets TORCH_DISTRIBUTED_DEBUG=INFO and NCCL_DEBUG=INFO."),
    Flag("--deterministic", to="deterministic",
         help="Also sets CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Tree, NVTE_ALLOW_NONDETERMINISTIC_ALGO=0."),
    # launcher
    Flag("--dry-run", is_flag=True, help="Print the command and environment, then exit without launching."),
    Flag("--gpu-memory", type=float,
         help="GiB of memory per GPU the memory plan is checked against (default: the visible GPU's, else 80)."),
    Flag("--no-memory-check", is_flag=True,
         help="Launch without the memory plan, even where it would not fit --gpu-memory (run.py then imports no torch)."),
)

TRAINER_FLAGS = {flag.to: flag for flag in FLAGS if flag.to}


@dataclass(frozen=True)
class LaunchOptions:
    """run.py's parsed flags: one field per row the launcher consumes itself (a test keeps them in step
    with FLAGS), and the values of the rows it passes on (`trainer`, by TrainConfig field)."""

    gpus: int
    gpu_ids: str
    sif_path: str | None
    node: int | None
    rank: int | None
    master_addr: str | None
    master_port: int | None
    interface: str | None
    rdzv_port: int | None
    slurm_job_id: str | None
    slurm_output_name: str | None
    dry_run: bool
    gpu_memory: float | None
    no_memory_check: bool
    trainer: Mapping[str, Any]

    @classmethod
    def of(cls, values: dict) -> LaunchOptions:
        """From click's values (trainer rows under their field names; repeated values become lists)."""
        trainer = {name: list(v) if isinstance(v, tuple) else v for name, v in values.items() if name in TRAINER_FLAGS}
        own = {name: v for name, v in values.items() if name not in TRAINER_FLAGS}
        return cls(**own, trainer=MappingProxyType(trainer))
SKIP_RANGE_FLAG = "--skip-train-iteration-range"


def _click_option(flag: Flag):
    decls = [d for d in (flag.short, flag.name) if d] + [flag.dest]
    if flag.to:
        field = next(f for f in fields() if f.name == flag.to)
        if is_switch(field):  # --x/--no-x, as the trainer takes it
            decls = [f"{flag.name}/--no-{flag.name[2:]}", flag.dest]
        kwargs = click_kwargs(field, typing.get_type_hints(TrainConfig)[flag.to])
        kwargs["help"] = " ".join(filter(None, [kwargs["help"], flag.help]))
        if flag.name != option_name(flag.to):
            kwargs["help"] += f" (trainer {option_name(flag.to)})"
        return click.option(*decls, **kwargs)
    if flag.is_flag:
        return click.option(*decls, is_flag=True, default=False, help=flag.help)
    return click.option(*decls, type=flag.type, default=flag.default, help=flag.help,
                        show_default=flag.default not in (None, ""))


def launcher_options(func):
    """Decorate a click command with every row of FLAGS (trainer rows arrive under their field names)."""
    for flag in reversed(FLAGS):
        func = _click_option(flag)(func)
    return func


def split_argv(argv: list[str]) -> tuple[list[str], list[str]]:
    """(run.py arguments, trainer arguments after `--`), with `FLAG R1 R2 ...` made `FLAG R1 FLAG R2`.

    The original accepted several space-separated ranges after one --skip-train-iteration-range;
    click options take one value each, so the extra values are given their own flag.
    """
    if "--" in argv:
        cut = argv.index("--")
        argv, passthrough = argv[:cut], argv[cut + 1:]
    else:
        passthrough = []
    out: list[str] = []
    state = ""  # "flag": the next word is the flag's value; "values": more values may follow
    for arg in argv:
        if state == "values" and not arg.startswith("-"):
            out += [SKIP_RANGE_FLAG, arg]
            continue
        out.append(arg)
        if arg == SKIP_RANGE_FLAG:
            state = "flag"
        elif arg.startswith(SKIP_RANGE_FLAG + "="):
            state = "values"
        else:
            state = "values" if state == "flag" else ""
    return out, passthrough


@click.command(name="pretrain_llava.py", add_help_option=False)
@trainer_options
def _trainer_command(config):
    """The trainer's own parser, used only to check and read the options given after `--`."""


def passthrough_options(argv: list[str]) -> dict[str, Any]:
    """{TrainConfig field: value} of the trainer options given after `--`, parsed as the trainer would."""
    if not argv:
        return {}
    try:
        ctx = _trainer_command.make_context(_trainer_command.name, list(argv))
    except click.ClickException as exc:
        raise UserError(f"trainer options after --: {exc.format_message()}") from None
    given = {name: value for name, value in ctx.params.items()
             if ctx.get_parameter_source(name) is ParameterSource.COMMANDLINE}
    for name in given:
        if name in TRAINER_FLAGS:
            flag = TRAINER_FLAGS[name].name
            raise UserError(f"{option_name(name)} after --: give it as run.py's {flag} (before --)")
    return {name: list(value) if isinstance(value, tuple) else value for name, value in given.items()}


def _options(command: click.Command) -> set[str]:
    return {name for param in command.params for name in (*param.opts, *param.secondary_opts)}


def misplaced_trainer_option(command: click.Command, argv: list[str]) -> str | None:
    """The first trainer option in run.py's own arguments (`argv`, before `--`), which click would
    only call unknown."""
    own, trainer = _options(command), _options(_trainer_command)
    return next((name for name in (arg.split("=", 1)[0] for arg in argv if arg.startswith("--"))
                 if name not in own and name in trainer), None)


def invoke(command: click.Command, argv: list[str]) -> None:
    """Run run.py's click `command` on `argv`: ranges spread, `--` split off, errors on one line.

    The command receives the trainer arguments after `--` as `ctx.obj`; its return value is the exit status.
    """
    argv, passthrough = split_argv(argv)
    misplaced = misplaced_trainer_option(command, argv)
    if misplaced:
        report(f"{misplaced} is the trainer's option: give it after -- (run.py [run.py's flags] -- {misplaced} ...)")
        sys.exit(2)
    run_command(command, argv, obj=passthrough)
