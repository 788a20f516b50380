"""What a SLURM job tells the launcher through its environment.

Run one run.py per node (`srun --ntasks-per-node=1 python scripts/train/run.py ...`); each reads
its node count, node rank, master host (the first host of the node list) and job id from SLURM.
Flags given on the command line win over these values.
"""

from __future__ import annotations

import re
import shutil
import subprocess
from dataclasses import dataclass
from typing import Mapping

from megatron_ext.errors import UserError

_BRACKET = re.compile(r"\[([^\]]*)\]")


@dataclass(frozen=True)
class SlurmJob:
    job_id: str
    nnodes: int | None
    node_id: int | None
    nodelist: str | None
    gpus_on_node: int | None

    @property
    def master_host(self) -> str | None:
        return hostnames(self.nodelist)[0] if self.nodelist else None


def _int(env: Mapping[str, str], name: str) -> int | None:
    value = env.get(name)
    if not value:
        return None
    try:
        return int(value)
    except ValueError:
        raise UserError(f"{name}={value!r} is not a number") from None


def slurm_job(env: Mapping[str, str]) -> SlurmJob | None:
    """The SLURM job this process runs in (None outside SLURM)."""
    if not env.get("SLURM_JOB_ID"):
        return None
    return SlurmJob(
        job_id=env["SLURM_JOB_ID"],
        nnodes=_int(env, "SLURM_NNODES"),
        node_id=_int(env, "SLURM_NODEID"),
        nodelist=env.get("SLURM_JOB_NODELIST") or None,
        gpus_on_node=_int(env, "SLURM_GPUS_ON_NODE"),
    )


def _split_top_level(nodelist: str) -> list[str]:
    """`a[1-2,4],b` -> [`a[1-2,4]`, `b`]: commas inside brackets separate ranges, not hosts."""
    items, depth, start = [], 0, 0
    for i, char in enumerate(nodelist):
        depth += {"[": 1, "]": -1}.get(char, 0)
        if depth not in (0, 1):
            raise ValueError(nodelist)
        if char == "," and depth == 0:
            items.append(nodelist[start:i])
            start = i + 1
    if depth:
        raise ValueError(nodelist)
    return [item for item in items + [nodelist[start:]] if item]


def _expand(item: str) -> list[str]:
    """`node[01-02]-ib[1,3]` -> node01-ib1, node01-ib3, node02-ib1, node02-ib3 (zero padding kept)."""
    match = _BRACKET.search(item)
    if not match:
        return [item]
    prefix, tails = item[:match.start()], _expand(item[match.end():])
    hosts = []
    for part in match.group(1).split(","):
        low, _, high = part.partition("-")
        for number in range(int(low), int(high or low) + 1):
            hosts += [f"{prefix}{number:0{len(low)}d}{tail}" for tail in tails]
    return hosts


def hostnames(nodelist: str) -> list[str]:
    """Expand a SLURM node list (`node[01-04],gpu7`); `scontrol show hostnames` for forms not handled here."""
    try:
        return [host for item in _split_top_level(nodelist) for host in _expand(item)]
    except ValueError:
        pass
    if shutil.which("scontrol"):
        out = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True, text=True, timeout=30)
        if out.returncode == 0 and out.stdout.split():
            return out.stdout.split()
    raise UserError(f"SLURM_JOB_NODELIST={nodelist!r} could not be expanded; give the master node with -m/--master-addr")
