"""A rank's own failure, shared with every rank of the run through torch.distributed's store (under
torchrun, its agent's on the first node), so that on several nodes each node's run.py reports the
cause: nodes share no failures directory (rank_failures.py), and a rank on another node sees only
its connection to the failed rank break.

The first failure left stays. A rank that lost a peer waits a few seconds for it: the failed rank
closes its connections (destroys its process group) before it gets to say why. The failed rank then
stays until every rank on the other nodes has read it (or CAUSE_WAIT_S passed): on the first node
its exit ends torchrun's agent, and the store with it, which had other nodes report their lost
connection instead (seen when the first node failed). Nothing is shared where the store cannot be
reached (the node that held it is gone), or no rank left a reason (a node killed): the rank then
reports its lost connection. Imports nothing; the store is the one `keep` was given.
"""

from __future__ import annotations

import datetime
import os

KEY = "megatron_ext/failure"
READ = "megatron_ext/failure_read"  # how many ranks on other nodes than the failed rank's have read it
ALL_READ = "megatron_ext/failure_read_by_all"
# How long a rank that lost a peer waits for the peer's reason. The failed rank records it as soon as
# its exception has unwound (a second at most on a busy machine); a node that died never does.
CAUSE_WAIT_S = 10.0

_store = None


def keep(store) -> None:
    """The run's store (torch.distributed's default one), kept past the process group's end: a rank
    that fails destroys its group before its failure is recorded."""
    global _store
    _store = store


def publish(failure_json: str) -> None:
    """Leave this rank's failure for the other ranks, unless one was left first; then, when it is the
    one shared, wait until the ranks on other nodes have read it (CAUSE_WAIT_S at most)."""
    if _store is None:
        return
    mine = f"{_node()}\n{failure_json}"
    try:
        shared = _store.compare_set(KEY, "", mine)
        if shared.decode() == mine and _ranks_elsewhere() > 0:
            _store.wait([ALL_READ], datetime.timedelta(seconds=CAUSE_WAIT_S))
    except Exception:  # noqa: BLE001 a timeout, or the store's node is gone: no rank can read it anyway
        pass


def _node() -> str:
    """This rank's node (torchrun's GROUP_RANK: distinct even for two nodes on one machine)."""
    return os.environ.get("GROUP_RANK", "0")


def _ranks_elsewhere() -> int:
    """How many ranks of the run are on other nodes than this one (torchrun's environment)."""
    return int(os.environ.get("WORLD_SIZE", "1")) - int(os.environ.get("LOCAL_WORLD_SIZE", "1"))


def cause() -> str | None:
    """The failure another rank left (its JSON), waiting up to CAUSE_WAIT_S; None when none came. Only
    ranks on other nodes than the failed rank's count as its readers: its own node's ranks lost their
    connection to it too, but the failed rank's own record already reached their run.py."""
    if _store is None:
        return None
    try:
        _store.wait([KEY], datetime.timedelta(seconds=CAUSE_WAIT_S))
        node, _, failure = _store.get(KEY).decode().partition("\n")
        if node != _node() and _store.add(READ, 1) >= _ranks_elsewhere():
            _store.set(ALL_READ, "1")
        return failure
    except Exception:  # noqa: BLE001 a timeout, or the store's node is gone
        return None
