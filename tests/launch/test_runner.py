"""A real (non-dry) run: output streamed, exit status passed on, stopping signals (Ctrl-C, SIGTERM, SIGUSR1) passed
to the ranks alone."""

from __future__ import annotations

import os
import signal
import subprocess
import time

import pytest

from megatron_ext.launch.network import free_port
from tests.support.launcher import EXIT_BARRIER_RACE

pytestmark = [pytest.mark.multiprocess, pytest.mark.timeout(120)]


def _args(inputs):
    return ["--megatron-load-dir", inputs.checkpoint, "--data-path", inputs.data]


@pytest.mark.parametrize("standin_exit,status", [(0, 0), (3, 3), (-signal.SIGKILL, 128 + signal.SIGKILL)])
def test_exit_status_and_streamed_output(launcher, inputs, standin_exit, status):
    result = launcher.run(*_args(inputs), env=launcher.env(STANDIN_EXIT=str(standin_exit)))
    assert result.returncode == status, result.stderr
    assert [line for line in result.stderr.splitlines() if line.startswith("+ torchrun ")]
    assert "torchrun says hello on stdout" in result.stdout
    assert "torchrun says hello on stderr" in result.stderr


def test_a_port_taken_at_bind_time_starts_again_on_a_free_port(launcher, inputs):
    """Another process bound the port between run.py's check and torchrun's bind: torchrun's traceback
    stays off the terminal, and the run starts again on a free port."""
    result = launcher.run(*_args(inputs), env=launcher.env(STANDIN_PORT_TAKEN="1"))
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr and "EADDRINUSE" not in result.stderr
    first, second = [r["argv"] for r in launcher.records() if "argv" in r]
    taken, free = (argv[argv.index("--master-port") + 1] for argv in (first, second))
    assert taken != free
    assert f"run.py: port {taken} was taken by another process while the run started; starting again on free port " \
           f"{free}" in result.stderr.splitlines()
    assert "torchrun says hello on stderr" in result.stderr


def test_an_explicit_port_taken_at_bind_time_is_one_line(launcher, inputs):
    port = free_port()
    result = launcher.run(*_args(inputs), "-p", port, env=launcher.env(STANDIN_PORT_TAKEN="1"))
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1].startswith(f"error: -p/--master-port {port} was taken by another process "
                                                     "while the run started; choose another, e.g. -p/--master-port ")
    assert "Traceback" not in result.stderr and len([r for r in launcher.records() if "argv" in r]) == 1


def _wait_ready(launcher, proc, count, timeout=30.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [r for r in launcher.records() if r.get("ready")]
        if len(ready) == count:
            return ready
        assert proc.poll() is None, proc.communicate()
        time.sleep(0.05)
    raise AssertionError(f"stand-ins not ready: {launcher.records()}")


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGUSR1])
@pytest.mark.parametrize("tee", [False, True])
def test_a_stopping_signal_reaches_the_ranks_once_and_not_torchrun(launcher, inputs, sig, tee):
    """To run.py alone, as a terminal's Ctrl-C reaches only the foreground group; then, while the rank
    saves, to run.py again and to torchrun, as slurmstepd signals every process: the rank hears it once,
    from run.py, and torchrun ends with the rank's status."""
    extra = ["--slurm-output-name", "logs/run"] if tee else []
    proc = launcher.popen(*_args(inputs), *extra, env=launcher.env(STANDIN_WAIT="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        torchrun, rank = _wait_ready(launcher, proc, 2)
        assert torchrun["pgid"] == rank["pgid"] != proc.pid  # torchrun's group, not run.py's
        proc.send_signal(sig)
        _wait_signalled(launcher, proc)
        proc.send_signal(sig)
        os.kill(torchrun["pgid"], sig)  # torchrun leads its group
        _, err = proc.communicate(timeout=30)
    finally:
        launcher.stop(proc)
    assert proc.returncode == 0, err
    assert [(r["name"], r["signal"]) for r in launcher.records() if "signal" in r] == [("child", sig)]
    if tee:
        assert "torchrun says hello on stdout" in (launcher.cwd / "logs" / "run.log").read_text()


def test_a_stopping_signal_before_any_rank_started_ends_the_launch(launcher, inputs):
    proc = launcher.popen(*_args(inputs), env=launcher.env(STANDIN_WAIT="1", STANDIN_NO_RANK="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_ready(launcher, proc, 2)
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=30)
    finally:
        launcher.stop(proc)
    assert proc.returncode == 128 + signal.SIGTERM, err
    assert not [r for r in launcher.records() if "signal" in r]


def _wait_signalled(launcher, proc, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not [r for r in launcher.records() if "signal" in r]:
        assert proc.poll() is None and time.monotonic() < deadline, launcher.records()
        time.sleep(0.05)


def test_a_killed_launch_leaves_its_temporary_folder_to_the_next_start_of_the_same_run(launcher, inputs, tmp_path):
    temp = tmp_path / "temp"
    temp.mkdir()
    proc = launcher.popen(*_args(inputs), env=launcher.env(TMPDIR=str(temp), STANDIN_WAIT="1"),
                          stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        _wait_ready(launcher, proc, 2)
        os.kill(proc.pid, signal.SIGKILL)  # run.py alone: nothing cleans up
        proc.wait()
    finally:
        launcher.stop(proc)
    left = list(temp.glob("megatron-ext-run-*"))
    assert len(left) == 1 and (left[0] / "output.log").is_file()

    other = launcher.run(*_args(inputs), "--name", "another-run", env=launcher.env(TMPDIR=str(temp)))
    assert other.returncode == 0 and list(temp.glob("megatron-ext-run-*")) == left  # not its own: left alone
    same = launcher.run(*_args(inputs), env=launcher.env(TMPDIR=str(temp)))
    assert same.returncode == 0 and not list(temp.glob("megatron-ext-run-*"))


@pytest.mark.parametrize("race,standin_exit,hidden", [("end", 0, True), ("end", 3, False), ("after", 0, False)])
def test_torchruns_exit_barrier_race_is_one_log_line_when_the_run_succeeded(launcher, inputs, race, standin_exit,
                                                                           hidden):
    """Shown as torchrun wrote it when the run failed or when other output follows it (then it is not the race)."""
    result = launcher.run(*_args(inputs), "--slurm-output-name", "logs/run",
                          env=launcher.env(STANDIN_EXIT_RACE=race, STANDIN_EXIT=str(standin_exit)))
    log = (launcher.cwd / "logs" / "run.log").read_text()
    assert result.returncode == standin_exit, result.stderr
    assert "torchrun says hello on stderr" in result.stderr
    for output in (result.stderr, log):
        assert (EXIT_BARRIER_RACE not in output) == hidden
    note = "run.py: torchrun logged its exit-barrier race after every rank of this node ended with status 0"
    assert (note in log) == hidden and note not in result.stderr
    assert ("Traceback" in result.stderr) != hidden
    if race == "after":
        assert EXIT_BARRIER_RACE + "torchrun says more after it\n" in result.stderr
