"""A two-node job under a real SLURM (tests/support/slurm_cluster.py), submitted as docs/launcher.md's
requeue pattern says: `scancel --signal=USR1` mid-run leaves a snapshot and no error or traceback on
either node, and the same script submitted again resumes from it exactly."""

from __future__ import annotations

import os
import re
import shlex
import signal
import sys
import time
from pathlib import Path

import pytest

from tests.support import slurm_cluster
from tests.support.helpers import REPO_ROOT, child_env, run
from tests.support.stopping import (
    RUN,
    assert_no_failure_signs,
    assert_resumed_as_if_never_stopped,
    assert_stopped_cleanly,
    command,
    logged_two,
)
from tests.support.training import launcher_args, metrics

# CI sets it (.ci/run): there the test must run, never skip.
REQUIRED = "MEGATRON_EXT_REQUIRE_SLURM"
# After the first iterations one takes some 40 ms here, while scancel's signal passes through slurmctld,
# slurmd and slurmstepd: enough of them that it arrives before the run ends.
ITERS = 50


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    reason = slurm_cluster.unavailable()
    if reason and os.environ.get(REQUIRED):
        pytest.fail(f"{REQUIRED} is set, but {reason}")
    if reason:
        pytest.skip(reason)
    with slurm_cluster.two_node_cluster(tmp_path_factory.mktemp("slurm")) as started:
        yield started


def documented_job_script(run_py_args: list[str]) -> str:
    """docs/launcher.md's requeue sbatch script, with this test's run.py options and without its GPU request."""
    docs = (REPO_ROOT / "docs/launcher.md").read_text().split("**Preemption and time limits: requeue.**")[1]
    script = docs.split("```shell\n", 1)[1].split("```", 1)[0]
    script = "".join(line for line in script.splitlines(keepends=True) if not line.startswith("#SBATCH --gpus"))
    launch = re.compile(r"(srun --kill-on-bad-exit=1 python scripts/train/run\.py) .*? &\n", re.S)
    script, found = launch.subn(lambda match: f"{match.group(1)} {shlex.join(run_py_args)} &\n", script)
    assert found == 1, script
    return script


def _submit(cluster, script: Path, output: Path) -> str:
    """The job id. Two nodes, one run.py each; `python` is this environment's."""
    env = child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    return cluster.sbatch(script, "--nodes=2", f"--output={output}", env=env, cwd=REPO_ROOT)


def _ended(cluster, job_id: str, output: Path) -> tuple[int, str]:
    """(the job's exit status, its output) once it ended."""
    job = cluster.wait_ended(job_id, timeout=240)
    assert job["JobState"] == "COMPLETED", (job, output.read_text()[-3000:])
    return int(job["ExitCode"].split(":")[0]), output.read_text()


def _stopped_mid_run(cluster, script: Path, save: Path, output: Path) -> str:
    """Submits `script` and, two iterations in, stops it as docs/launcher.md says: `scancel --signal=USR1`
    (the job's steps, every process of them). Returns the job id."""
    job_id = _submit(cluster, script, output)
    deadline, ready = time.monotonic() + 240, logged_two(save)
    while not ready():
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING") and time.monotonic() < deadline, \
            (output.read_text() if output.exists() else "", cluster.logs())
        time.sleep(0.2)
    cluster.command("scancel", "--signal=USR1", job_id)
    return job_id


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_two_node_job_scancelled_mid_run_saves_and_the_same_job_resubmitted_resumes_exactly(
        tmp_path, cluster, megatron_clip, train_data):
    save, node_logs, script = tmp_path / "run", tmp_path / "node", tmp_path / "job.sh"
    options = {**RUN, "train_iters": ITERS}
    script.write_text(documented_job_script(["--slurm-output-name", str(node_logs),
                                             *launcher_args(1, megatron_clip, train_data, save, **options)]))

    output = tmp_path / "stopped.out"
    job_id = _stopped_mid_run(cluster, script, save, output)
    status, text = _ended(cluster, job_id, output)
    stopped_at = assert_stopped_cleanly(status, save, text, signal.SIGUSR1, ITERS)
    for node in (0, 1):
        assert_no_failure_signs(Path(f"{node_logs}-{job_id}-node{node}.log").read_text())

    reference = tmp_path / "uninterrupted"  # one node, two processes: the same world of two ranks
    run(command(megatron_clip, train_data, reference, gpus=2, **options), timeout=300)
    output = tmp_path / "resumed.out"
    status, text = _ended(cluster, _submit(cluster, script, output), output)
    assert status == 0, text[-3000:]
    assert_no_failure_signs(text)
    assert_resumed_as_if_never_stopped(text, save, stopped_at, metrics(reference))
