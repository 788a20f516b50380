"""A rank under run.py leaves its failure for the launcher instead of printing it: a user error or an
out-of-memory as its one line, a bug with its traceback; the launcher picks the first."""

from __future__ import annotations

import json

import pytest

from megatron_ext import rank_failures
from megatron_ext.errors import report


class OutOfMemoryError(RuntimeError):
    """Named as torch's, which is recognised by name (the module imports no torch)."""


@pytest.fixture
def under_run_py(tmp_path, monkeypatch):
    monkeypatch.setenv(rank_failures.FAILURES_ENV, str(tmp_path))
    monkeypatch.setenv("RANK", "3")
    return tmp_path


def test_a_user_error_is_recorded_not_printed(under_run_py, capsys):
    report("--data-path shard 7 is corrupt")
    assert capsys.readouterr().err == ""
    recorded = json.loads((under_run_py / "rank3.json").read_text())
    assert (recorded["rank"], recorded["message"], recorded["traceback"]) == (3, "--data-path shard 7 is corrupt", None)


def test_out_of_memory_is_one_line_and_a_bug_keeps_its_traceback(under_run_py):
    with pytest.raises(SystemExit) as exit_status, rank_failures.recorded():
        raise OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB\nmore detail")
    assert exit_status.value.code == 1
    oom = rank_failures.first_failure(under_run_py)
    assert oom.message == ("CUDA out of memory. Tried to allocate 2.00 GiB; use a smaller --micro-batch-size, "
                           "more --tp/--pp, --dist-optim or activation recomputation")
    assert oom.traceback is None

    (under_run_py / "rank3.json").rename(under_run_py / "rank0.json")
    with pytest.raises(SystemExit), rank_failures.recorded():
        raise KeyError("loss")
    assert rank_failures.first_failure(under_run_py) == oom  # recorded first
    later = rank_failures.Failure(**json.loads((under_run_py / "rank3.json").read_text()))
    assert later.message == "KeyError: 'loss'"
    assert later.traceback.startswith("Traceback (most recent call last)") and 'raise KeyError("loss")' in later.traceback


def test_a_lost_connection_is_shown_as_one_line_pointing_at_the_rank_that_ended_first(capsys):
    lost = rank_failures.Failure(rank=2, time=0.0, message="RuntimeError: Connection closed by peer [10.0.0.1]:27282",
                                 traceback="Traceback (most recent call last):\n  ...\n", peer_loss=True)
    rank_failures.show(lost, "; the run's whole output: LOG")
    assert capsys.readouterr().err.splitlines() == [
        "error: rank 2 lost its connection to a rank that ended first, whose own output says why (on several nodes: "
        "its node's run.py): RuntimeError: Connection closed by peer [10.0.0.1]:27282 (rank 2; the run's whole output: "
        "LOG)"]


def test_without_run_py_everything_is_as_before(monkeypatch, capsys):
    monkeypatch.delenv(rank_failures.FAILURES_ENV, raising=False)
    monkeypatch.setenv("RANK", "0")
    report("bad flag")
    assert capsys.readouterr().err == "error: bad flag\n"
    with pytest.raises(KeyError), rank_failures.recorded():
        raise KeyError("loss")
