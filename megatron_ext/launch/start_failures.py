"""A node's refusal to start, told to the other nodes of the run through the rendezvous port.

When run.py refuses a flag on one node of a multi-node run, the other nodes' torchrun wait for it
until they give up (topology.JOIN_TIMEOUT_S) and can only guess why. Instead the refusing node puts
its one line into a store at the rendezvous address: the store torchrun on the first node serves
there (static rendezvous: node 0; c10d: the endpoint's host), or, when the refusing node is that
one, a store it serves itself until the others have read it. Each other node's run.py watches that
store until its ranks start, ends its torchrun when the line appears, and says it as its own error.
Nodes started long after the refusal see only that the others did not join.
"""

from __future__ import annotations

import contextlib
import datetime
import socket
import threading
import time

from megatron_ext.launch import network
from megatron_ext.launch.topology import JOIN_TIMEOUT_S, Topology

KEY = "megatron_ext/start_failure"
ENDED = "megatron_ext/start_failure_ended"  # how many other nodes ended their torchrun on it
POLL_S = 1.0


def _endpoint(t: Topology) -> tuple[str, int]:
    return t.master_addr, t.rdzv_port if t.rdzv_port is not None else t.master_port


def _serves_store(t: Topology) -> bool:
    """Whether torchrun on this node would serve the rendezvous store."""
    return t.node_rank == 0 if t.rdzv_port is None else network.is_this_host(t.master_addr)


def _listening(host: str, port: int) -> bool:
    """Whether something accepts connections there: asked first, since a store client that finds nobody
    logs C++ traces on stderr while it retries."""
    try:
        socket.create_connection((host, port), timeout=0.5).close()
        return True
    except OSError:
        return False


def _store(host: str, port: int, timeout_s: float, serve: bool = False):
    from torch.distributed import TCPStore

    return TCPStore(host, port, is_master=serve, timeout=datetime.timedelta(seconds=timeout_s),
                    wait_for_workers=False)


def _client(host: str, port: int, wait_s: float):
    """A client of the store there, once something listens within `wait_s`; else None."""
    deadline = time.monotonic() + wait_s
    while not _listening(host, port):
        if time.monotonic() > deadline:
            return None
        time.sleep(0.5)
    return _store(host, port, POLL_S)


def tell(t: Topology, message: str) -> None:
    """Leave `message` (this node's refusal) where the other nodes' run.py look, for as long as they may
    be waiting to join (at most JOIN_TIMEOUT_S plus a few seconds); nothing when no node can be reached."""
    if t.nnodes < 2 or _endpoint(t)[1] is None:
        return
    host, port = _endpoint(t)
    line = f"{socket.gethostname()}: {message}"
    try:
        if not _serves_store(t):
            if (store := _client(host, port, JOIN_TIMEOUT_S)) is not None:
                store.set(KEY, line)
            return
        store = _store(host, port, JOIN_TIMEOUT_S, serve=True)
        store.set(KEY, line)
        deadline = time.monotonic() + JOIN_TIMEOUT_S + 5
        # Served until the others ended their torchrun, which would break off at a store closed under it.
        while int(store.add(ENDED, 0)) < t.nnodes - 1 and time.monotonic() < deadline:
            time.sleep(0.2)
    except (RuntimeError, OSError):
        # Nobody listening (the others were not started) or the port already gone: they will say that they
        # were left waiting.
        return


class RefusalWatch:
    """Until `stop`, looks every second for another node's refusal at this run's rendezvous address; the
    line (`refusal`, "host: message") once found. `ended` says that this node's torchrun ended on it."""

    def __init__(self, t: Topology):
        self.endpoint = _endpoint(t)
        self.refusal: str | None = None
        self._store = None
        self._stopped = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)

    def start(self) -> "RefusalWatch":
        self._thread.start()
        return self

    def stop(self) -> None:
        self._stopped.set()

    def ended(self) -> None:
        with contextlib.suppress(RuntimeError, OSError):
            self._store.add(ENDED, 1)

    def _watch(self) -> None:
        while not self._stopped.wait(POLL_S):
            try:
                self._store = self._store or _client(*self.endpoint, 0)
                if self._store is not None and self._store.check([KEY]):
                    self.refusal = self._store.get(KEY).decode()
                    return
            except (RuntimeError, OSError):
                self._store = None  # not served yet, or served no longer: connect again
        self._store = None  # stopped: this node's ranks started, and the connection is not needed any more
