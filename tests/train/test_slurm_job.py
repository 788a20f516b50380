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

FAILING_RANK = Path(__file__).with_name("rank_failure")  # its sitecustomize makes rank FAIL_IN_RANK fail
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


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, megatron_clip, train_data) -> dict:
    """The metrics of the same run uninterrupted, on one node of two processes: the same world of two ranks."""
    save = tmp_path_factory.mktemp("uninterrupted") / "run"
    run(command(megatron_clip, train_data, save, gpus=2, train_iters=ITERS), timeout=300)
    return metrics(save)


def documented_job_script(run_py_args: list[str]) -> str:
    """docs/launcher.md's requeue sbatch script, with this test's run.py options and without its GPU request."""
    docs = (REPO_ROOT / "docs/launcher.md").read_text().split("**Preemption and time limits: requeue.**")[1]
    script = docs.split("```shell\n", 1)[1].split("```", 1)[0]
    script = "".join(line for line in script.splitlines(keepends=True) if not line.startswith("#SBATCH --gpus"))
    launch = re.compile(r"(srun --kill-on-bad-exit=1 python scripts/train/run\.py) .*? &\n", re.S)
    script, found = launch.subn(lambda match: f"{match.group(1)} {shlex.join(run_py_args)} &\n", script)
    assert found == 1, script
    return script


def _submit(cluster, script: Path, output: Path, **env: str) -> str:
    """The job id. Two nodes, one run.py each; `python` is this environment's; `env` added to the job's."""
    env = child_env(PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}", **env)
    return cluster.sbatch(script, "--nodes=2", f"--output={output}", env=env, cwd=REPO_ROOT)


def _ended(cluster, job_id: str, output: Path) -> tuple[int, str]:
    """(the job's exit status, its output) once it ended."""
    job = cluster.wait_ended(job_id, timeout=240)
    assert job["JobState"] == "COMPLETED", (job, output.read_text()[-3000:])
    return int(job["ExitCode"].split(":")[0]), output.read_text()


def _job_script(tmp_path: Path, checkpoint: Path, data: Path) -> Path:
    """The documented script for a CPU run of ITERS iterations saving to tmp_path/run, each node's output
    also in tmp_path/node-JOBID-nodeR.log."""
    script = tmp_path / "job.sh"
    script.write_text(documented_job_script(["--slurm-output-name", str(tmp_path / "node"), *launcher_args(
        1, checkpoint, data, tmp_path / "run", **{**RUN, "train_iters": ITERS})]))
    return script


def _stopped_mid_run(cluster, script: Path, save: Path, output: Path, *scancel: str) -> str:
    """Submits `script` and, two iterations in, sends it USR1 with `scancel --signal=USR1 *scancel`.
    Returns the job id."""
    job_id = _submit(cluster, script, output)
    deadline, ready = time.monotonic() + 240, logged_two(save)
    while not ready():
        assert cluster.job(job_id)["JobState"] in ("PENDING", "RUNNING") and time.monotonic() < deadline, \
            (output.read_text() if output.exists() else "", cluster.logs())
        time.sleep(0.2)
    cluster.command("scancel", "--signal=USR1", *scancel, job_id)
    return job_id


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_two_node_job_scancelled_mid_run_saves_and_the_same_job_resubmitted_resumes_exactly(
        tmp_path, cluster, megatron_clip, train_data, uninterrupted):
    """As docs/launcher.md says to stop a job: `scancel --signal=USR1` (its steps, every process of them)."""
    save, script = tmp_path / "run", _job_script(tmp_path, megatron_clip, train_data)

    output = tmp_path / "stopped.out"
    job_id = _stopped_mid_run(cluster, script, save, output)
    status, text = _ended(cluster, job_id, output)
    stopped_at = assert_stopped_cleanly(status, save, text, signal.SIGUSR1, ITERS)
    for node in (0, 1):
        assert_no_failure_signs((tmp_path / f"node-{job_id}-node{node}.log").read_text())

    output = tmp_path / "resumed.out"
    status, text = _ended(cluster, _submit(cluster, script, output), output)
    assert status == 0, text[-3000:]
    assert_no_failure_signs(text)
    assert_resumed_as_if_never_stopped(text, save, stopped_at, uninterrupted)


def _without_requeue_notice(output: str) -> str:
    """The job's output less SLURM's own notice of the requeue the script asked for, which slurmstepd
    writes as an error line when the requeue ends the batch step before the script has exited
    (docs/launcher.md says so); any other line stays."""
    return re.sub(r"(?m)^slurmstepd-\S+: error: \*\*\* JOB \d+ ON \S+ CANCELLED AT \S+ DUE TO JOB REQUEUE \*\*\*\n?",
                  "", output)


def _requeued(cluster, job_id: str, timeout: float = 120) -> None:
    """Once the job went back to the queue, starts it at once: SLURM holds a requeued job a while."""
    deadline = time.monotonic() + timeout
    while (job := cluster.job(job_id))["Restarts"] == "0" or job["JobState"] != "PENDING":
        assert job["JobState"] in ("RUNNING", "COMPLETING", "PENDING") and time.monotonic() < deadline, job
        time.sleep(0.2)
    # Started before its first run is cleaned up and within the second its credential was revoked,
    # slurmd refuses the launch ("Job credential revoked") and the job fails: SLURM's own hold avoids
    # that, and so does waiting for idle nodes and the next second.
    cluster.wait_idle(timeout=60)
    time.sleep(1.5)
    cluster.command("scontrol", "update", f"JobId={job_id}", "StartTime=now")


@pytest.mark.multiprocess
@pytest.mark.timeout(600)
def test_a_two_node_job_warned_of_its_time_limit_saves_requeues_itself_and_resumes_exactly(
        tmp_path, cluster, megatron_clip, train_data, uninterrupted):
    """`#SBATCH --signal=B:USR1@120`: SLURM signals the batch script alone (`scancel --batch`); the
    documented script's trap passes USR1 on through srun, and requeues the job once both nodes saved."""
    save, output = tmp_path / "run", tmp_path / "job.out"
    job_id = _stopped_mid_run(cluster, _job_script(tmp_path, megatron_clip, train_data), save, output, "--batch")
    _requeued(cluster, job_id)
    stopped_at = assert_stopped_cleanly(0, save, _without_requeue_notice(output.read_text()), signal.SIGUSR1,
                                        ITERS)  # requeued on 0 only
    status, text = _ended(cluster, job_id, output)  # --open-mode=append: both runs' output
    assert status == 0 and cluster.job(job_id)["Restarts"] == "1", text[-3000:]
    assert_no_failure_signs(_without_requeue_notice(text))
    assert_resumed_as_if_never_stopped(text, save, stopped_at, uninterrupted)


@pytest.mark.multiprocess
@pytest.mark.timeout(300)
def test_a_rank_failing_on_one_node_ends_the_job_within_a_minute_each_node_naming_the_cause_once(
        tmp_path, cluster, megatron_clip, train_data):
    output = tmp_path / "failed.out"
    job_id = _submit(cluster, _job_script(tmp_path, megatron_clip, train_data), output,
                     PYTHONPATH=str(FAILING_RANK), FAIL_IN_RANK="1", FAILURE="user")
    job = cluster.wait_ended(job_id, timeout=240)
    hours, minutes, seconds = map(int, job["RunTime"].split(":"))
    assert job["JobState"] == "FAILED" and hours * 3600 + minutes * 60 + seconds < 60, job
    text = output.read_text()
    assert "Traceback" not in text, text[-3000:]
    cause = "error: data shard /data/shard_7.tar is corrupt (unexpected end of archive); rebuild it (rank 1"
    errors = sorted(line.split("; the run's whole output")[0] for line in text.splitlines() if line.startswith("error: "))
    assert errors == [cause, f"{cause} on node1"], text[-3000:]  # node1's own, then node0's
