"""run.py with the real torchrun and trainer: a failure inside one rank reaches the terminal once (a
user error as one line, a bug with one traceback), two runs started together on one node both train, and
a node that fails at start ends the other within a minute."""

from __future__ import annotations

import contextlib
import os
import socket
import subprocess
import time
from pathlib import Path

import pytest

from megatron_ext.checkpoint import layout
from megatron_ext.launch.network import free_port
from tests.support.helpers import child_env, run, started
from tests.support.training import run_py

DOUBLE = Path(__file__).with_name("rank_failure")  # its sitecustomize makes rank FAIL_IN_RANK fail


def _failing_run(failure: str, tmp_path: Path, checkpoint: Path, data: Path) -> tuple[subprocess.CompletedProcess, str]:
    """(run.py's result, its stdout + stderr) for 2 ranks, rank 1 failing with `failure`. TMPDIR: run.py
    keeps the output of a failed run in a temporary directory, here the test's."""
    path = os.pathsep.join(p for p in (str(DOUBLE), os.environ.get("PYTHONPATH")) if p)
    env = child_env(PYTHONPATH=path, FAIL_IN_RANK="1", FAILURE=failure, TMPDIR=str(tmp_path))
    result = run(run_py(checkpoint, data, tmp_path / "run", 2), env=env, timeout=180, check=False)
    assert result.returncode != 0
    return result, result.stdout + result.stderr


def _error_lines(text: str) -> list[str]:
    return [line for line in text.splitlines() if line.startswith("error: ")]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_user_error_in_rank_1_is_one_line(tmp_path, megatron_clip, train_data):
    result, output = _failing_run("user", tmp_path, megatron_clip, train_data)
    assert "Traceback" not in output and "ChildFailedError" not in output, output
    (line,) = _error_lines(result.stderr)
    message, log = line.split(" (rank 1; the run's whole output: ")
    assert message == "error: data shard /data/shard_7.tar is corrupt (unexpected end of archive); rebuild it"
    # Nothing is lost: the log keeps torchrun's own report too.
    log = Path(log.removesuffix(")"))
    assert log.parent.parent == tmp_path and "ChildFailedError" in log.read_text()


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_bug_in_rank_1_shows_its_traceback_once(tmp_path, megatron_clip, train_data):
    result, output = _failing_run("bug", tmp_path, megatron_clip, train_data)
    assert output.count("Traceback (most recent call last)") == 1, output
    assert 'in _fail\n    raise RuntimeError("injected failure while building the trainer")' in result.stderr
    (line,) = _error_lines(result.stderr)
    assert line.startswith("error: RuntimeError: injected failure while building the trainer (rank 1; ")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_two_runs_started_together_on_one_node_both_train(tmp_path, megatron_clip, train_data):
    """Both find the default port free before either torchrun binds it: the second to claim it takes another.
    One process each: torchrun binds the port whatever the number of ranks."""
    logs = [tmp_path / f"run{i}.log" for i in range(2)]
    with open(logs[0], "w") as first_log, open(logs[1], "w") as second_log, \
            started(run_py(megatron_clip, train_data, tmp_path / "run0", 2, gpus=1), stdout=first_log,
                    stderr=subprocess.STDOUT) as first, \
            started(run_py(megatron_clip, train_data, tmp_path / "run1", 2, gpus=1), stdout=second_log,
                    stderr=subprocess.STDOUT) as second:
        statuses = [first.wait(timeout=280), second.wait(timeout=280)]
    assert statuses == [0, 0], [log.read_text()[-3000:] for log in logs]
    assert [layout.find_snapshot(tmp_path / f"run{i}").iteration for i in range(2)] == [2, 2]


def _node_command(checkpoint: Path, data: Path, save: Path, rank: int, port: int, *extra: str) -> list[str]:
    """run.py for node `rank` of a two-node run whose nodes are both this machine (its name, over lo)."""
    command = run_py(checkpoint, data, save, 4, gpus=1)
    cut = command.index("--")
    return [*command[:cut], "--node", "2", "-r", str(rank), "-m", socket.gethostname(), "-p", str(port),
            "--interface", "lo", *extra, *command[cut:]]


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
@pytest.mark.parametrize("failing", [0, 1], ids=["node0-serving-the-store-fails", "node1-fails"])
def test_a_node_refusing_to_start_ends_its_peer_within_a_minute_naming_the_cause(tmp_path, megatron_clip, train_data,
                                                                                 failing):
    """Both nodes started together, as srun starts them: the refusing node says why at once, and the peer, instead
    of waiting for it to join, says the same."""
    port = free_port()
    nodes = {rank: _node_command(megatron_clip, train_data, tmp_path / "run", rank, port,
                                 *(("--tp", "3") if rank == failing else ())) for rank in (0, 1)}
    logs = {rank: tmp_path / f"node{rank}.err" for rank in (0, 1)}
    start = time.monotonic()
    with contextlib.ExitStack() as stack:
        started_nodes = {rank: stack.enter_context(started(nodes[rank], stdout=subprocess.DEVNULL,
                                                           stderr=stack.enter_context(open(logs[rank], "w"))))
                         for rank in (0, 1)}
        statuses = {rank: started_nodes[rank].wait(timeout=60) for rank in (1 - failing, failing)}
    assert time.monotonic() - start < 60  # the bound the issue asks for
    refused, peer = logs[failing].read_text(), logs[1 - failing].read_text()
    assert statuses == {0: 2, 1: 2} and "Traceback" not in refused + peer, (refused, peer)
    cause = "--tp 3 x --pp 1 = 3 does not divide"
    assert _error_lines(refused) == [line for line in refused.splitlines() if cause in line]
    (line,) = [line for line in peer.splitlines() if not line.startswith(("run.py: ", "+ "))]
    assert line.startswith(f"error: the run did not start on node {socket.gethostname()}: {cause}"), peer


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_node_whose_peer_never_started_ends_within_a_minute_in_one_line(tmp_path, megatron_clip, train_data):
    port = free_port()
    start = time.monotonic()
    alone = run(_node_command(megatron_clip, train_data, tmp_path / "run", 0, port), timeout=60, check=False)
    assert time.monotonic() - start < 60
    assert alone.returncode == 2 and "Traceback" not in alone.stderr, alone.stderr
    assert alone.stderr.splitlines()[-1] == (
        f"error: the other nodes did not join within 15 s (rendezvous {socket.gethostname()}:{port}): one failed to "
        "start (its own output says why) or was not started; start every node's run.py together")


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
@pytest.mark.parametrize("failing", [1, 0], ids=["node1-fails", "node0-holding-the-store-fails"])
def test_a_rank_failing_on_one_node_ends_the_other_within_a_minute_both_naming_the_cause_in_one_line(
        tmp_path, megatron_clip, train_data, failing):
    port = free_port()
    path = os.pathsep.join(p for p in (str(DOUBLE), os.environ.get("PYTHONPATH")) if p)
    env = child_env(PYTHONPATH=path, FAIL_IN_RANK=str(failing), FAILURE="user", TMPDIR=str(tmp_path))
    logs = {rank: tmp_path / f"node{rank}.err" for rank in (0, 1)}
    with contextlib.ExitStack() as stack:
        nodes = {rank: stack.enter_context(started(_node_command(megatron_clip, train_data, tmp_path / "run", rank, port),
                                                   env=env, stdout=subprocess.DEVNULL,
                                                   stderr=stack.enter_context(open(logs[rank], "w"))))
                 for rank in (0, 1)}
        assert nodes[failing].wait(timeout=200) != 0  # its rank fails as it builds the trainer
        assert nodes[1 - failing].wait(timeout=60) != 0  # the bound the issue asks for
    for rank in (0, 1):  # the peer names the cause, not its lost connection
        output = logs[rank].read_text()
        assert "Traceback" not in output, output[-3000:]
        (line,) = _error_lines(output)
        assert line.startswith("error: data shard /data/shard_7.tar is corrupt (unexpected end of archive); "
                               f"rebuild it (rank {failing}; "), output[-3000:]
