"""Test jobs forked from a process that has imported their libraries once.

Every rank of a test job, and most scripts a test runs, first imports torch, megatron-core,
transformers and energon: about 7.5 s of CPU per process on the 2-core CI machine, more than most
of these tiny jobs then compute, and most of the suite's time. So each pytest worker keeps one
server that has imported them (`megatron_ext.preloaded.preload`, which the demo's steps are forked
after too); a job's process is a fork of it, with the job's argv, environment, working directory and
output files, in a session of its own. It runs the script as `python SCRIPT ARGS` (or `python -m
MODULE ARGS`) would, as `__main__`, and exits as Python does (`forked.run_main`). The product forks
its converter workers from a preloaded server the same way (megatron_ext/convert/worker_preload.py).

What a fork cannot give is a fresh interpreter, so `serves` sends a job to a real process where
that could matter:
- the environment the libraries saw at import is the server's: a job whose environment differs
  from it (other than the distributed variables, TEST_HOOKS and DATASETS_VARS, which are read after
  the fork) starts fresh, as does any command but `python SCRIPT|-m MODULE`;
- what the libraries print while imported, they print once, in the server: a test of what a command
  prints (no warnings, one error line) passes `fresh=True`;
- the process's command line (/proc, psutil) is the server's: tests that find processes by it run
  them through run.py and torchrun, which start real ones.

Protocol over a Unix socket pair, messages of a 4-byte length and JSON: the client sends
{"argv", "env", "cwd"} with the job's stdout and stderr descriptors attached, the server answers
{"pid"}; when a job's process exits the server sends {"exit": pid, "status": code} (negative: the
signal that killed it, as subprocess reports it). The server kills its jobs and exits when the
client's end closes.
"""

from __future__ import annotations

import json
import os
import selectors
import socket
import struct
import subprocess
import sys
import time

from megatron_ext import preloaded
from megatron_ext.launch import forked
from tests.support.helpers import DISTRIBUTED_VARS, REPO_ROOT, child_env

# Read by the test jobs at run time (tests/train/gpu_rehearsal.py, failing_save.py, the workers):
# a job that sets them can still be forked.
TEST_HOOKS = frozenset({"REHEARSAL_REPORT", "REHEARSAL_MATH_LIMIT", "FAIL_SAVE"})
# Read by `datasets` (lmms-eval's) when imported, which the server never does (`serve` checks): a job
# whose benchmark caches its tasks' data apart from others' can still be forked.
DATASETS_VARS = frozenset({"HF_DATASETS_OFFLINE", "HF_DATASETS_CACHE"})
_HEADER = struct.Struct("!I")
_MAX_FDS = 2


def _send(sock: socket.socket, message: dict, fds: list[int] = ()) -> None:
    data = json.dumps(message).encode()
    socket.send_fds(sock, [_HEADER.pack(len(data)) + data], list(fds))


def _receive(sock: socket.socket) -> tuple[dict, list[int]] | None:
    """One message and the descriptors sent with it; None when the other end has closed."""
    head, fds, _, _ = socket.recv_fds(sock, _HEADER.size, _MAX_FDS)
    if not head:
        return None
    size, = _HEADER.unpack(head)
    data = b""
    while len(data) < size:
        chunk = sock.recv(size - len(data))
        if not chunk:
            return None
        data += chunk
    return json.loads(data), fds


# ---- the server -------------------------------------------------------------------------------

def serve(fd: int) -> None:
    """Import what the jobs import (`preloaded.preload`), say {"ready"}, then start jobs until the client
    closes its end."""
    import threading

    sock = socket.socket(fileno=fd)
    preloaded.preload()
    # A fork copies one thread: one the imports left running would be missing in every job.
    assert threading.active_count() == 1, threading.enumerate()
    assert "datasets" not in sys.modules, "the preloaded imports read DATASETS_VARS: serves() must compare them"
    _send(sock, {"ready": os.getpid()})
    jobs: set[int] = set()
    events = selectors.DefaultSelector()
    events.register(sock, selectors.EVENT_READ)
    try:
        while True:
            if events.select(timeout=0.05):
                received = _receive(sock)
                if received is None:
                    return
                request, fds = received
                # The pid is answered once the job leads its own session: a kill of its group then reaches it.
                settled, leading = os.pipe()
                pid = os.fork()
                if pid == 0:
                    events.close()
                    os.close(settled)
                    _job(sock, request, fds, leading)
                for descriptor in (leading, *fds):
                    os.close(descriptor)
                os.read(settled, 1)
                os.close(settled)
                jobs.add(pid)
                _send(sock, {"pid": pid})
            for pid in list(jobs):
                done, status = os.waitpid(pid, os.WNOHANG)
                if done:
                    jobs.discard(pid)
                    _send(sock, {"exit": pid, "status": os.waitstatus_to_exitcode(status)})
    finally:
        for pid in jobs:
            try:
                os.killpg(pid, 9)
            except (ProcessLookupError, PermissionError):
                pass


def _job(sock: socket.socket, request: dict, fds: list[int], leading: int) -> None:
    """In the forked child: become the job, run it, exit with its status. Never returns."""
    try:
        sock.close()
        os.setsid()
        os.close(leading)
        os.chdir(request["cwd"])
        forked.run_as_child(request["argv"][1:], request["env"], *fds)
    finally:
        os._exit(1)  # reached only where becoming the job failed


# ---- the client -------------------------------------------------------------------------------

class Job:
    """A job's process, as much of subprocess.Popen as the test helpers use."""

    def __init__(self, server: Server, pid: int):
        self.server, self.pid, self.returncode = server, pid, None

    def poll(self) -> int | None:
        if self.returncode is None:
            self.server.collect(timeout=0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.returncode is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.pid, timeout)
            self.server.collect(timeout=0.1 if left is None else min(left, 0.1))
        return self.returncode


class Server:
    """The client's end: starts the server, then a job per `start`."""

    def __init__(self, env: dict[str, str], cwd: str):
        self.env = env
        import tempfile

        mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        self._log = tempfile.TemporaryFile("w+")  # what the imports print: read if the server fails
        self.proc = subprocess.Popen(
            [sys.executable, "-c", f"from tests.support.prestarted import serve; serve({theirs.fileno()})"],
            pass_fds=[theirs.fileno()], env=env, cwd=cwd, stdin=subprocess.DEVNULL,
            stdout=self._log, stderr=self._log, start_new_session=True)
        theirs.close()
        self.sock, self._jobs = mine, {}
        if _receive(self.sock) is None:
            self._log.seek(0)
            raise RuntimeError(f"the prestarted server did not start:\n{self._log.read()[-4000:]}")

    def serves(self, cmd: list[str], env: dict[str, str]) -> bool:
        """Whether `cmd` in `env` runs here as it would in a fresh process (the module docstring)."""
        if self.proc.poll() is not None or len(cmd) < 2 or cmd[0] != sys.executable:
            return False
        if not (cmd[1].endswith(".py") or (cmd[1] == "-m" and len(cmd) > 2)):
            return False
        ignored = TEST_HOOKS.union(DISTRIBUTED_VARS, DATASETS_VARS)
        return ({k: v for k, v in env.items() if k not in ignored}
                == {k: v for k, v in self.env.items() if k not in ignored})

    def start(self, cmd: list[str], env: dict[str, str], cwd, stdout, stderr) -> Job:
        _send(self.sock, {"argv": cmd, "env": env, "cwd": str(cwd)}, [stdout.fileno(), stderr.fileno()])
        while True:
            message = self._next(timeout=60)
            if "pid" in message:
                job = self._jobs[message["pid"]] = Job(self, message["pid"])
                return job
            self._exited(message)

    def collect(self, timeout: float) -> None:
        """Take in the exits reported within `timeout` s."""
        ready = selectors.DefaultSelector()
        ready.register(self.sock, selectors.EVENT_READ)
        deadline = time.monotonic() + timeout
        while ready.select(timeout=max(0.0, deadline - time.monotonic())):
            self._exited(self._next(timeout=60))

    def _next(self, timeout: float) -> dict:
        self.sock.settimeout(timeout)
        try:
            received = _receive(self.sock)
        finally:
            self.sock.settimeout(None)
        if received is None:
            raise RuntimeError("the prestarted server exited")
        return received[0]

    def _exited(self, message: dict) -> None:
        job = self._jobs.pop(message["exit"], None)
        if job is not None:
            job.returncode = message["status"]

    def close(self) -> None:
        self.sock.close()
        self.proc.wait(timeout=30)
        self._log.close()


_server: Server | None = None


def server() -> Server:
    """This pytest worker's server, started at its first job in the environment test children get."""
    global _server
    if _server is None:
        import atexit

        _server = Server(child_env(), str(REPO_ROOT))
        atexit.register(_server.close)
    return _server
