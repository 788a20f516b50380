"""Running the launch command: its own process group, stopping signals passed to the ranks
(stop_forwarding.py), output streamed (and logged), the first failure inside the ranks reported once."""

from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

from megatron_ext import lifetime, rank_failures, stop_signals
from megatron_ext.launch import exit_barrier_race, run_dirs
from megatron_ext.launch.stop_forwarding import StopForwarding

# How torchrun says that its rendezvous port was taken between run.py's check and its own bind.
PORT_TAKEN = b"EADDRINUSE"
# How it says that the other nodes did not join in time (topology.JOIN_TIMEOUT_S): as the node that
# waited for them, as a node that could not reach the first, and through the c10d rendezvous.
PEERS_MISSING = re.compile(rb"waiting for clients|timed out after \d+ms while trying to connect|RendezvousTimeoutError")
# torchrun binds its port, or gives up waiting for the other nodes, within this; stderr is never held
# longer (should the ranks be unable to say that they started: a container that does not see the
# launcher's temporary directory).
HOLD_S = 90.0


class _Output:
    """The child's stdout and stderr passed through as they come, and all of it into one log file.

    stderr is held back until a rank has started: torchrun fails before that mostly when it cannot
    bind its rendezvous port or the other nodes do not join, and run.py then says so itself
    (`port_taken`, `peers_missing`) instead of showing torchrun's traceback. Once a rank has recorded
    a failure, stderr stops reaching the terminal (the log keeps it): what follows is torchrun's
    report of that failure and the other ranks' reactions to it. torchrun's exit-barrier race
    (`exit_barrier_race`) is held back too, and ends up as one line in the log when the run succeeded."""

    def __init__(self, log_path: Path, failures_dir: Path):
        self.log = open(log_path, "ab")
        self.failures_dir = failures_dir
        self.lock = threading.Lock()
        self.port_taken = self.peers_missing = self.peer_refused = False
        self.race, self.race_terminal = b"", None  # stderr held since the race may have begun, and where it goes

    def _write(self, chunk: bytes, terminal) -> None:
        with self.lock:
            if terminal is not None:
                terminal.write(chunk)
                terminal.flush()
            self.log.write(chunk)
            self.log.flush()

    def pump(self, stream, terminal) -> None:
        while chunk := os.read(stream.fileno(), 65536):
            self._write(chunk, terminal)

    def pump_stderr(self, stream, terminal) -> None:
        held, muted, until = [], False, time.monotonic() + HOLD_S
        while chunk := os.read(stream.fileno(), 65536):
            if held is not None and not rank_failures.has_started(self.failures_dir) and time.monotonic() < until:
                held.append(chunk)
                continue
            if held:
                self._write(b"".join(held), terminal)
            held = None
            muted = muted or rank_failures.has_failed(self.failures_dir)
            self._stream(chunk, None if muted else terminal)
        if held:
            text = b"".join(held)
            self.port_taken, self.peers_missing = PORT_TAKEN in text, bool(PEERS_MISSING.search(text))
            self._write(text, None if self.port_taken or self.peers_missing or self.peer_refused else terminal)

    def _stream(self, chunk: bytes, terminal) -> None:
        """Writes `chunk`, holding it from where the race may begin until it turns out something else."""
        if not self.race:
            start = exit_barrier_race.begins_at(chunk)
            if start is None:
                return self._write(chunk, terminal)
            self._write(chunk[:start], terminal)
            chunk = chunk[start:]
        self.race, self.race_terminal = self.race + chunk, terminal
        if not exit_barrier_race.could_be(self.race):
            self._write(self.race, terminal)
            self.race = b""

    def close(self, status: int | None) -> None:
        """What is held written out, unless it is the race at the end of a run that succeeded."""
        if status == 0 and exit_barrier_race.is_race(self.race):
            self._write(exit_barrier_race.NOTE, None)
        else:
            self._write(self.race, self.race_terminal)
        self.log.close()


def _report(failures_dir: Path, log_path: Path) -> None:
    """The first rank's failure, once: one line, after its traceback when it was not a user error."""
    first = rank_failures.first_failure(failures_dir)
    if first is not None:
        rank_failures.show(first, f"; the run's whole output: {log_path}")


@dataclass(frozen=True)
class Outcome:
    status: int
    port_taken: bool  # torchrun could not bind its rendezvous port: no rank started
    peers_missing: bool  # the other nodes did not join: no rank started
    peer_refusal: str | None = None  # another node refused to start ("host: message"): no rank started


def _start_child() -> None:
    """In the child before it execs torchrun: it dies with run.py, and it and its descendants ignore
    stopping signals until a rank installs its own handlers."""
    lifetime.die_with_parent()
    stop_signals.ignore()


def _end_on_refusal(watch, proc: subprocess.Popen, output: _Output, failures_dir: Path) -> None:
    """Once another node refused to start (`watch`: start_failures.RefusalWatch), torchrun waits for it in
    vain: ended here, as long as no rank started (then the watch is done)."""
    if rank_failures.has_started(failures_dir):
        watch.stop()
    elif watch.refusal is not None and not output.peer_refused:
        output.peer_refused = True  # what torchrun says from here on is its reaction: the log's only
        watch.ended()  # before the kill: the store may be this node's torchrun's
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def run(argv: list[str], env: dict[str, str], log_file: Path | None = None, key: str = "", watch=None) -> Outcome:
    """Run `argv` with `env` added to this environment; `key` names the run (run_dirs.run_key); `watch`
    (start_failures.RefusalWatch): another node's refusal to start ends the launch.

    The child gets a process group of its own, so Ctrl-C reaches it only through the launcher, which
    passes stopping signals to the ranks (`StopForwarding`). If this process dies without passing
    anything on (SIGKILL), the child dies with it (`lifetime`). A rank that fails leaves its reason in
    the launch's temporary folder (`run_dirs`, `rank_failures`), printed here once; the run's whole
    output is in `log_file` or, when none is given, kept in that folder when a rank failed.
    """
    failures_dir = run_dirs.create(key)
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    log_path = log_file or failures_dir / "output.log"
    # Unbuffered: the ranks write into a pipe now, and their output should still appear as it comes.
    child_env = {"PYTHONUNBUFFERED": "1", **os.environ, **env, **lifetime.launcher_marker(),
                 **stop_signals.TORCHRUN_SIGNALS, rank_failures.FAILURES_ENV: str(failures_dir)}
    proc = subprocess.Popen(argv, env=child_env, process_group=0, preexec_fn=_start_child,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    stopping = StopForwarding(proc, failures_dir)
    output, status = _Output(log_path, failures_dir), None
    pumps = [threading.Thread(target=output.pump, args=(proc.stdout, sys.stdout.buffer), daemon=True),
             threading.Thread(target=output.pump_stderr, args=(proc.stderr, sys.stderr.buffer), daemon=True)]
    try:
        for pump in pumps:
            pump.start()
        # Joined with a timeout: a thread blocked in join would keep the signal handlers from running.
        while any(pump.is_alive() for pump in pumps):
            for pump in pumps:
                pump.join(0.2)
            stopping.pass_on()
            if watch is not None:
                _end_on_refusal(watch, proc, output, failures_dir)
        status = stopping.status(proc.wait())
    finally:
        stopping.restore()
        output.close(status)
    if status != 0:
        _report(failures_dir, log_path)
    run_dirs.finish(failures_dir, keep=log_file is None and status != 0 and rank_failures.has_failed(failures_dir))
    return Outcome(status, output.port_taken and status != 0, output.peers_missing and status != 0,
                   watch.refusal if output.peer_refused else None)
