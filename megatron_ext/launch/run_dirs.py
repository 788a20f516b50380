"""The temporary folder of one launch (`megatron-ext-run-<run>-XXXX` in the temporary directory): the
ranks' failure records and, without --slurm-output-name, a copy of the run's output.

run.py removes it when it ends, unless a rank failed (the error line names the output kept there).
run.py killed outright (kill -9, an OOM kill) removes nothing, so each start of a run first removes
what earlier starts of the same run (the same trainer options) on this host left behind: folders
whose run.py is gone and that were not kept on purpose.
"""

from __future__ import annotations

import hashlib
import shutil
import socket
import tempfile
from pathlib import Path

from megatron_ext import lifetime

PREFIX = "megatron-ext-run-"
# Inside a folder while its run.py lives: "host pid:start time" (lifetime.launcher_marker's value).
OWNER_FILE = "launcher"


def run_key(trainer_argv: list[str]) -> str:
    """Names one run: a re-run of the same command has the same key (its port may differ)."""
    return hashlib.sha1("\0".join(trainer_argv).encode()).hexdigest()[:10]


def _owner() -> str:
    return f"{socket.gethostname()} {lifetime.launcher_marker()[lifetime.LAUNCHER_ENV]}"


def _abandoned(folder: Path) -> bool:
    """Left by a run.py of this host that is gone without removing it (a folder kept on purpose has no owner)."""
    try:
        host, marker = (folder / OWNER_FILE).read_text().split(" ", 1)
    except (OSError, ValueError):
        return False
    pid, start = marker.split(":")
    return host == socket.gethostname() and not lifetime.running(int(pid), float(start))


def create(key: str) -> Path:
    """A new folder for this launch of run `key`, after removing the ones its killed starts left."""
    for folder in Path(tempfile.gettempdir()).glob(f"{PREFIX}{key}-*"):
        if _abandoned(folder):
            shutil.rmtree(folder, ignore_errors=True)
    folder = Path(tempfile.mkdtemp(prefix=f"{PREFIX}{key}-"))
    (folder / OWNER_FILE).write_text(_owner())
    return folder


def finish(folder: Path, keep: bool) -> None:
    """Remove the folder, or keep it (for the output it holds) as no longer owned by a live run."""
    if keep:
        (folder / OWNER_FILE).unlink(missing_ok=True)
    else:
        shutil.rmtree(folder, ignore_errors=True)
