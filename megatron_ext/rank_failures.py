"""Failures inside a run's ranks, reported once by the process that started them.

Left to torchrun, a failed run ends with every failing rank's traceback followed by torchrun's own
ChildFailedError report, and a user error seen by a rank other than 0 is not printed at all (only
rank 0 prints): the reason scrolls away or never shows. Under run.py, and in the converters' CPU
ranks (FAILURES_ENV names a directory), a rank that fails writes what happened to DIR/rank<R>.json
instead of printing it, and the starter prints the first failure once: a user error (or running out
of memory) as one line, an unexpected exception with its traceback. Each rank also marks that it
started (DIR/rank<R>.started): torchrun got past binding its rendezvous port. Imports nothing heavy:
errors.py uses it in every process.

A rank whose peer failed fails too, with a lost connection (gloo's "Connection closed by peer",
NCCL's aborted communicator, a timeout): that is recorded as a peer loss, reported only when no rank
recorded anything else, and such a rank waits before it exits, so that the rank that failed first
says why before the starter (torchrun, torch.multiprocessing) stops every rank on the first exit.
On several nodes a rank's own failure also reaches the other nodes' ranks (shared_failure.py): one
that lost its peer records that failure, the cause, in place of its lost connection.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import socket
import sys
import time
import traceback
from dataclasses import asdict, dataclass
from pathlib import Path

FAILURES_ENV = "MEGATRON_EXT_FAILURES"
_OUT_OF_MEMORY = "OutOfMemoryError"  # torch.OutOfMemoryError, named so that torch need not be imported
# How long a rank that lost a peer, or saw a user error rank 0 may have seen too, waits before it exits:
# the starter stops every rank as soon as one has exited, and the rank that knows why would then never
# say it. Generous: on a busy machine a process with torch loaded can take seconds to exit, and the
# wait ends as soon as the starter stops the rank that waits.
OTHER_RANKS_EXIT_DELAY_S = 30.0
# torch.distributed's errors for a connection or a collective that another process broke off.
_PEER_ERRORS = ("DistBackendError", "DistNetworkError", "DistStoreError")
_PEER_LOSS = re.compile(r"Connection (closed|reset) by peer|Broken pipe|remote process exited|communicator was "
                        r"aborted|Timed out waiting|collective operation timeout")


@dataclass(frozen=True)
class Failure:
    rank: int
    time: float
    message: str
    traceback: str | None  # None for a user error: the message says it all
    peer_loss: bool = False  # a lost connection to another rank: most likely that rank's failure
    host: str = ""  # where the rank ran: another node's failure is named with its node


class RankFailed(Exception):
    """An unexpected exception in a worker rank, raised where the ranks were started; the rank's own
    traceback is `failure.traceback` (and a note, for a caller that lets this propagate)."""

    def __init__(self, failure: Failure):
        super().__init__(f"{failure.message} (rank {failure.rank})")
        self.failure = failure
        self.add_note(f"in rank {failure.rank}:\n{failure.traceback.rstrip()}")


def is_peer_loss(exc: BaseException) -> bool:
    return type(exc).__name__ in _PEER_ERRORS or bool(_PEER_LOSS.search(str(exc)))


def _start_ticks(pid: int) -> str | None:
    """When process `pid` started (clock ticks since boot, the same in every PID namespace); None when gone."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def mark_started() -> None:
    """Tell run.py that torchrun got as far as starting this rank (its rendezvous port was bound), and
    which process it is (run.py passes stopping signals to it)."""
    directory = os.environ.get(FAILURES_ENV)
    if directory and Path(directory).is_dir():
        (Path(directory) / f"rank{os.environ.get('RANK', '0')}.started").write_text(
            f"{os.getpid()} {_start_ticks(os.getpid())}")


def started_ranks(directory: Path) -> set[int]:
    """The process ids of the ranks that marked themselves started and still run, as seen from here (a
    rank in a PID namespace of its own names a pid that means another process here, or none)."""
    pids = set()
    for path in directory.glob("rank*.started"):
        pid, _, ticks = path.read_text().partition(" ")
        if pid.isdigit() and ticks and _start_ticks(int(pid)) == ticks:
            pids.add(int(pid))
    return pids


def _write(failure: Failure) -> bool:
    """`failure` as this rank's record for the starter. False when not started by one."""
    directory = os.environ.get(FAILURES_ENV)
    if not directory or not Path(directory).is_dir():
        return False
    path = Path(directory) / f"rank{os.environ.get('RANK', '0')}.json"
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(failure)))
    os.replace(tmp, path)  # the starter never reads half a record
    return True


def record(message: str, traceback_text: str | None = None, peer_loss: bool = False) -> bool:
    """Leave this rank's failure for the starter (and, its own, for the other nodes' ranks). False when
    not started by one (then print it yourself)."""
    from megatron_ext import shared_failure

    failure = Failure(int(os.environ.get("RANK", "0")), time.time(), message, traceback_text, peer_loss,
                      socket.gethostname())
    if not _write(failure):
        return False
    if not peer_loss:
        shared_failure.publish(json.dumps(asdict(failure)))
    return True


def _record_shared_cause() -> bool:
    """Record, in place of this rank's lost connection, the failure another rank shared (its cause).
    False when none came."""
    from megatron_ext import shared_failure

    cause = shared_failure.cause()
    return cause is not None and _write(Failure(**json.loads(cause)))


@contextlib.contextmanager
def recorded():
    """An unexpected exception in this block is left for the starter and ends the process with
    status 1; without one it propagates as usual. Either way a rank that lost a peer waits first."""
    try:
        yield
    except Exception as exc:
        peer_loss = is_peer_loss(exc)
        if type(exc).__name__ == _OUT_OF_MEMORY:
            reason = str(exc).splitlines()[0] if str(exc) else "out of memory"
            done = record(f"{reason}; use a smaller --micro-batch-size, more --tp/--pp, --dist-optim or "
                          "activation recomputation")
        else:
            # From the block's code on: the first frame is this generator's yield.
            trace = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__.tb_next))
            done = record(f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__, trace, peer_loss)
        # Recorded first (the starter then keeps the peers' reactions off the terminal), replaced by the
        # cause when another rank shares it: then there is nothing left to wait for.
        if peer_loss and int(os.environ.get("WORLD_SIZE", "1")) > 1 and not (done and _record_shared_cause()):
            time.sleep(OTHER_RANKS_EXIT_DELAY_S)
        if not done:
            raise
        sys.exit(1)


def has_started(directory: Path) -> bool:
    return any(directory.glob("rank*.started"))


def has_failed(directory: Path) -> bool:
    return any(directory.glob("rank*.json"))


def first_failure(directory: Path) -> Failure | None:
    """The failure recorded first, a rank's own before any peer loss: later failures are usually its
    consequences, and a peer can record its loss before the failing rank, which closes its connections
    (destroys its process group on the way out) before its exception reaches `recorded`."""
    failures = [Failure(**json.loads(path.read_text())) for path in directory.glob("rank*.json")]
    return min(failures, key=lambda f: (f.peer_loss, f.time), default=None)


def show(failure: Failure, more: str = "") -> None:
    """A failure, once, on stderr: a bug's traceback, then `error: <message> (rank R<more>)`. A lost
    connection is one line that says so: the rank that ended first (on several nodes, usually another
    node's) has the cause, and its traceback here would only mislead."""
    rank = f"rank {failure.rank}"
    if failure.host and failure.host != socket.gethostname():
        rank += f" on {failure.host}"
    if failure.peer_loss:
        print(f"error: {rank} lost its connection to a rank that ended first, whose own output says why "
              f"(on several nodes: its node's run.py): {failure.message.splitlines()[0]} ({rank}{more})",
              file=sys.stderr, flush=True)
        return
    if failure.traceback:
        sys.stderr.write(failure.traceback)
    print(f"error: {failure.message} ({rank}{more})", file=sys.stderr, flush=True)
