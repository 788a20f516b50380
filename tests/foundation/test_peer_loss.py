"""A rank whose peer failed fails too, with a lost connection: that is never the failure reported
when a rank recorded its own, and the rank that lost its peer waits before exiting, so the one that
failed first gets to say why; on another node, it reports the failure that rank shared through the
run's store instead. A bug in a worker rank reaches the terminal as its traceback and one line."""

from __future__ import annotations

import json
import time

import click
import pytest
import torch.distributed

from megatron_ext import errors, rank_failures, shared_failure
from megatron_ext.errors import report, run_command

# What gloo raises in a rank waiting in a collective when a peer closes its connections.
GLOO_LOSS = ("[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:6836: Connection "
             "reset by peer. This is typically caused by a remote worker hanging or bugs in the application.")


@pytest.fixture
def rank_1_of_2(tmp_path, monkeypatch):
    """This process as rank 1 of 2 under a starter that collects failures in tmp_path; sleeps are noted."""
    monkeypatch.setenv(rank_failures.FAILURES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    slept = []
    monkeypatch.setattr(rank_failures.time, "sleep", slept.append)
    return tmp_path, slept


def test_a_lost_connection_is_recorded_as_such_and_the_rank_waits_before_exiting(rank_1_of_2):
    directory, slept = rank_1_of_2
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise RuntimeError(GLOO_LOSS)
    recorded = json.loads((directory / "rank1.json").read_text())
    assert recorded["peer_loss"] is True and recorded["message"] == f"RuntimeError: {GLOO_LOSS}"
    assert slept == [rank_failures.OTHER_RANKS_EXIT_DELAY_S]


def test_a_rank_own_failure_is_reported_even_when_its_peer_recorded_the_loss_first(rank_1_of_2, monkeypatch):
    directory, _ = rank_1_of_2
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise RuntimeError(GLOO_LOSS)
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise AssertionError
    first = rank_failures.first_failure(directory)
    assert (first.rank, first.message, first.peer_loss) == (0, "AssertionError", False)
    assert first.traceback.endswith("    raise AssertionError\nAssertionError\n")


def test_without_a_rank_own_failure_the_lost_connection_is_reported(rank_1_of_2):
    directory, _ = rank_1_of_2
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise RuntimeError(GLOO_LOSS)
    assert rank_failures.first_failure(directory).message == f"RuntimeError: {GLOO_LOSS}"


@pytest.fixture
def run_store(monkeypatch):
    """The run's store, as torch.distributed's default one (shared_failure.keep), in this process."""
    store = torch.distributed.HashStore()
    monkeypatch.setattr(shared_failure, "_store", store)
    monkeypatch.setattr(shared_failure, "CAUSE_WAIT_S", 0.1)
    return store


def test_a_rank_that_lost_its_peer_on_another_node_reports_the_failure_that_peer_shared(rank_1_of_2, run_store,
                                                                                         monkeypatch, capsys):
    directory, slept = rank_1_of_2
    other_node = directory / "node0"
    other_node.mkdir()
    monkeypatch.setenv(rank_failures.FAILURES_ENV, str(other_node))
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setattr(rank_failures.socket, "gethostname", lambda: "node0")
    report("data shard /data/shard_7.tar is corrupt; rebuild it")
    report("a later failure")  # the first shared stays
    monkeypatch.setenv(rank_failures.FAILURES_ENV, str(directory))
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setattr(rank_failures.socket, "gethostname", lambda: "node1")
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise RuntimeError(GLOO_LOSS)
    assert slept == []  # the cause is known: nothing to wait for
    rank_failures.show(rank_failures.first_failure(directory), "; ...")
    assert capsys.readouterr().err == "error: data shard /data/shard_7.tar is corrupt; rebuild it (rank 0 on node0; ...)\n"


def test_a_failed_rank_stays_until_the_ranks_on_other_nodes_have_read_its_failure(run_store, monkeypatch):
    """On the first node the failed rank's exit ends torchrun's agent and the store it holds: it must
    outlive the other nodes' reading of its failure, and no longer (or CAUSE_WAIT_S without readers).
    Its own node's ranks, which lost their connection to it too, are not those readers."""
    import threading

    monkeypatch.setattr(shared_failure, "CAUSE_WAIT_S", 5.0)
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")  # two ranks on each of two nodes
    monkeypatch.setenv("GROUP_RANK", "0")
    failed = threading.Thread(target=shared_failure.publish, args=('{"message": "shard corrupt"}',))
    failed.start()
    time.sleep(0.3)
    assert shared_failure.cause() == '{"message": "shard corrupt"}'  # the other rank of node 0
    monkeypatch.setenv("GROUP_RANK", "1")
    for _reader in range(2):  # node 1's ranks
        time.sleep(0.3)
        assert failed.is_alive()
        assert shared_failure.cause() == '{"message": "shard corrupt"}'
    failed.join(timeout=1.0)
    assert not failed.is_alive()
    monkeypatch.setattr(shared_failure, "_store", torch.distributed.HashStore())  # another run
    monkeypatch.setattr(shared_failure, "CAUSE_WAIT_S", 0.2)
    start = time.monotonic()
    shared_failure.publish('{"message": "shard corrupt"}')  # nobody reads it: it waits out CAUSE_WAIT_S
    assert 0.2 <= time.monotonic() - start < 1.0
    start = time.monotonic()
    shared_failure.publish('{"message": "a later failure"}')  # not the one shared: nothing to wait for
    assert time.monotonic() - start < 0.2


def test_a_lost_connection_stays_the_report_when_no_rank_shares_a_cause(rank_1_of_2, run_store):
    directory, slept = rank_1_of_2
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise RuntimeError(GLOO_LOSS)
    assert rank_failures.first_failure(directory).peer_loss and slept == [rank_failures.OTHER_RANKS_EXIT_DELAY_S]
    assert not run_store.check([shared_failure.KEY])  # a lost connection is never shared as a cause


def test_under_torchrun_alone_a_user_error_only_rank_1_saw_is_still_said(monkeypatch, capsys):
    """Rank 0, waiting for rank 1 in a collective, never saw it; had it, torchrun would have stopped rank 1 by now."""
    monkeypatch.delenv(rank_failures.FAILURES_ENV, raising=False)
    monkeypatch.setenv("RANK", "1")
    slept = []
    monkeypatch.setattr(errors.time, "sleep", slept.append)
    report("data shard /data/shard_7.tar is corrupt; rebuild it")
    assert slept == [rank_failures.OTHER_RANKS_EXIT_DELAY_S]
    assert capsys.readouterr().err == "error: data shard /data/shard_7.tar is corrupt; rebuild it\n"


def test_a_bug_in_a_worker_rank_is_its_traceback_then_one_line(capsys):
    trace = 'Traceback (most recent call last):\n  File "stage.py", line 3, in build\n    raise AssertionError\nAssertionError\n'

    @click.command()
    def convert():
        raise rank_failures.RankFailed(rank_failures.Failure(2, 0.0, "AssertionError", trace))

    with pytest.raises(SystemExit) as status:
        run_command(convert, [])
    assert status.value.code == 1
    assert capsys.readouterr().err == trace + "error: AssertionError (rank 2)\n"
