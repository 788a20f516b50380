"""The converters' ranks: the first rank's own failure is what the caller gets, never a peer's lost
connection to it (a user error as its one line, a bug as that rank's traceback and one line)."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest

from megatron_ext import rank_failures
from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks
from megatron_ext.errors import UserError
from tests.support.helpers import child_env, run_script

DOUBLE = Path(__file__).with_name("rank_failure")  # its sitecustomize makes rank FAIL_IN_RANK's stage fail


def _fail_after_rank_1_lost_rank_0(failure: str):
    """Rank 0 closes its connections, as a rank's `finally: shutdown()` does on the way out of a failure,
    and fails only once rank 1, waiting for it in a collective, has recorded the lost connection."""
    import torch.distributed as dist

    dist.init_process_group("gloo")
    if dist.get_rank() == 1:
        dist.all_gather_object([None, None], "waiting for rank 0")
        return
    dist.destroy_process_group()
    while not Path(os.environ.get(rank_failures.FAILURES_ENV, "/nonexistent"), "rank1.json").exists():
        time.sleep(0.05)
    if failure == "user":
        raise UserError("--hf-dir x: rank 0 found a problem")
    raise AssertionError


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_bug_in_rank_0_is_raised_with_its_traceback_not_rank_1s_lost_connection():
    with pytest.raises(rank_failures.RankFailed) as info:
        run_on_cpu_ranks(_fail_after_rank_1_lost_rank_0, 2, "bug")
    failure = info.value.failure
    assert (str(info.value), failure.rank) == ("AssertionError (rank 0)", 0)
    assert failure.traceback.endswith("in _fail_after_rank_1_lost_rank_0\n    raise AssertionError\nAssertionError\n")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_user_error_in_rank_0_is_raised_with_its_message_not_rank_1s_lost_connection():
    with pytest.raises(UserError, match="^--hf-dir x: rank 0 found a problem$"):
        run_on_cpu_ranks(_fail_after_rank_1_lost_rank_0, 2, "user")


@pytest.mark.multiprocess
@pytest.mark.timeout(200)
def test_a_bare_assertion_in_the_first_rank_of_a_conversion_is_its_traceback_once_then_one_line(llava_clip, tmp_path):
    path = os.pathsep.join(p for p in (str(DOUBLE), os.environ.get("PYTHONPATH")) if p)
    out = tmp_path / "megatron"
    proc = run_script("convert/convert_hf_to_megatron.py", "--tp", 2, "--hf-dir", llava_clip, "--megatron-dir", out,
                      env=child_env(PYTHONPATH=path, FAIL_IN_RANK="0"), check=False, timeout=180)
    assert proc.returncode == 1
    assert proc.stderr.count("Traceback (most recent call last)") == 1, proc.stderr
    assert "in _fail\n    raise AssertionError\nAssertionError\n" in proc.stderr
    assert "Connection" not in proc.stderr and "SIGTERM" not in proc.stderr, proc.stderr
    assert proc.stderr.splitlines()[-1] == "error: AssertionError (rank 0)"
    assert not out.exists()
