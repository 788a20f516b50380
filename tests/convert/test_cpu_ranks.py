"""run_on_cpu_ranks: the converters' way of starting their CPU workers (no megatron involved here)."""

from __future__ import annotations

import os
import sys

import pytest

from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks
from megatron_ext.errors import UserError


def _rank_env(tag):
    keys = ("RANK", "WORLD_SIZE", "CUDA_VISIBLE_DEVICES", "OMP_NUM_THREADS")
    return tag, {key: os.environ.get(key) for key in keys}


def _refuse_on_rank_1():
    if os.environ["RANK"] == "1":
        raise UserError("--hf-dir x: rank 1 found a problem")


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_ranks_see_their_rank_and_no_gpu_and_rank_0_result_comes_back(monkeypatch):
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    tag, env = run_on_cpu_ranks(_rank_env, 2, "hello")
    assert tag == "hello"
    assert env["RANK"] == "0" and env["WORLD_SIZE"] == "2" and env["CUDA_VISIBLE_DEVICES"] == ""
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "0,1"  # the caller's own environment is left as it was


@pytest.mark.multiprocess
@pytest.mark.timeout(120)
def test_a_user_error_on_any_rank_is_raised_in_the_caller_with_its_message():
    with pytest.raises(UserError, match="^--hf-dir x: rank 1 found a problem$"):
        run_on_cpu_ranks(_refuse_on_rank_1, 2)


_FORKED_COMMAND = """
import sys
from multiprocessing import forkserver
from megatron_ext import preloaded
preloaded.preload()  # as the demo's server and the tests' prestarted one do before forking their commands
from megatron_ext.convert.cpu_ranks import run_on_cpu_ranks
from tests.convert.test_cpu_ranks import _rank_env, _refuse_on_rank_1
tag, env = run_on_cpu_ranks(_rank_env, 2, "hello")
try:
    run_on_cpu_ranks(_refuse_on_rank_1, 2)
except Exception as error:
    refused = str(error)
print(tag, env["RANK"], env["WORLD_SIZE"], repr(env["CUDA_VISIBLE_DEVICES"]), refused, forkserver._forkserver._forkserver_pid)
"""


@pytest.mark.multiprocess
@pytest.mark.timeout(180)
def test_a_command_forked_from_a_preloaded_process_forks_its_ranks_without_a_fork_server():
    """The server's fresh interpreter would import again what the command holds (about 6 s of CPU per
    converting command of the demo and the tests)."""
    from tests.support.helpers import run

    out = run([sys.executable, "-c", _FORKED_COMMAND], timeout=150).stdout.strip().splitlines()[-1]
    assert out == "hello 0 2 '' --hf-dir x: rank 1 found a problem None"
