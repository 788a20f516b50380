"""Running the launch command: its own process group, signals forwarded, output streamed (and teed)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

from megatron_ext import lifetime

FORWARDED = (signal.SIGINT, signal.SIGTERM)


def exit_status(returncode: int) -> int:
    """A child killed by signal N exits the shell way, 128 + N."""
    return 128 - returncode if returncode < 0 else returncode


def _tee(stream, log_path: Path) -> None:
    out = sys.stdout.buffer
    with open(log_path, "ab") as log:
        while chunk := os.read(stream.fileno(), 65536):
            out.write(chunk)
            out.flush()
            log.write(chunk)
            log.flush()


def run(argv: list[str], env: dict[str, str], log_file: Path | None = None) -> int:
    """Run `argv` with `env` added to this environment; returns its exit status.

    The child gets a process group of its own, so Ctrl-C reaches it only through the launcher:
    SIGINT and SIGTERM (scancel) are passed to the whole group, torchrun and every rank. If this
    process dies without forwarding anything (SIGKILL), the child dies with it (`lifetime`).
    """
    if log_file is not None:
        log_file.parent.mkdir(parents=True, exist_ok=True)
    pipe = subprocess.PIPE if log_file is not None else None
    proc = subprocess.Popen(argv, env={**os.environ, **env, **lifetime.launcher_marker()}, process_group=0,
                            preexec_fn=lifetime.die_with_parent, stdout=pipe, stderr=subprocess.STDOUT if pipe else None)

    def forward(signum, _frame):
        try:
            os.killpg(proc.pid, signum)
        except ProcessLookupError:
            pass

    previous = {sig: signal.signal(sig, forward) for sig in FORWARDED}
    try:
        if log_file is not None:
            _tee(proc.stdout, log_file)
            proc.stdout.close()
        return exit_status(proc.wait())
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
