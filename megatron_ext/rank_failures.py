"""Failures inside a run's ranks, reported once by run.py.

Left to torchrun, a failed run ends with every failing rank's traceback followed by torchrun's own
ChildFailedError report, and a user error seen by a rank other than 0 is not printed at all (only
rank 0 prints): the reason scrolls away or never shows. Under run.py (FAILURES_ENV names a
directory) a rank that fails writes what happened to DIR/rank<R>.json instead of printing it, and
run.py prints the first failure once: a user error (or running out of memory) as one line, an
unexpected exception with its traceback. Each rank also marks that it started (DIR/rank<R>.started):
torchrun got past binding its rendezvous port. Imports nothing heavy: errors.py uses it in every process.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURES_ENV = "MEGATRON_EXT_FAILURES"
_OUT_OF_MEMORY = "OutOfMemoryError"  # torch.OutOfMemoryError, named so that torch need not be imported


@dataclass(frozen=True)
class Failure:
    rank: int
    time: float
    message: str
    traceback: str | None  # None for a user error: the message says it all


def mark_started() -> None:
    """Tell run.py that torchrun got as far as starting this rank (its rendezvous port was bound)."""
    directory = os.environ.get(FAILURES_ENV)
    if directory and Path(directory).is_dir():
        (Path(directory) / f"rank{os.environ.get('RANK', '0')}.started").touch()


def record(message: str, traceback_text: str | None = None) -> bool:
    """Leave this rank's failure for run.py. False when not started by run.py (then print it yourself)."""
    directory = os.environ.get(FAILURES_ENV)
    if not directory or not Path(directory).is_dir():
        return False
    rank = int(os.environ.get("RANK", "0"))
    path = Path(directory) / f"rank{rank}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(Failure(rank, time.time(), message, traceback_text))))
    os.replace(tmp, path)  # run.py never reads half a record
    return True


@contextlib.contextmanager
def recorded():
    """An unexpected exception in this block is left for run.py and ends the process with status 1;
    not under run.py it propagates as usual."""
    try:
        yield
    except Exception as exc:
        if type(exc).__name__ == _OUT_OF_MEMORY:
            reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
            done = record(f"{reason}; use a smaller --micro-batch-size, more --tp/--pp, --dist-optim or "
                          "activation recomputation")
        else:
            done = record(f"{type(exc).__name__}: {exc}", traceback.format_exc())
        if not done:
            raise
        sys.exit(1)


def has_started(directory: Path) -> bool:
    return any(directory.glob("rank*.started"))


def has_failed(directory: Path) -> bool:
    return any(directory.glob("rank*.json"))


def first_failure(directory: Path) -> Failure | None:
    """The failure recorded first: later ones are usually its consequences (peers that lost a rank)."""
    failures = [Failure(**json.loads(path.read_text())) for path in directory.glob("rank*.json")]
    return min(failures, key=lambda f: f.time, default=None)
