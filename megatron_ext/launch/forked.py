"""Commands run as forks of a process that has imported their libraries once.

A fresh `python -m megatron_ext.commands...` first imports torch, megatron-core, transformers and
energon, 5-10 s of CPU before it does anything, and a pipeline of such commands (the demo's) pays
it at every step. A process that has imported them (`megatron_ext/preloaded.py`) can fork each
command instead: the child runs it as `__main__` (`run_main`) and exits as the interpreter would,
with sys.exit's status or 1 after an uncaught exception, non-daemon threads joined, atexit handlers
run, streams flushed. The tests' prestarted server (tests/support/prestarted.py) preloads and runs
its jobs with the same functions.
"""

from __future__ import annotations

import os
import sys
from typing import IO, NoReturn


def call(args: list[str], env: dict[str, str], output: IO) -> int:
    """`python ARGS` in a fork of this process, in `env`, its stdout and stderr into `output`; its
    exit status (negative: the signal that ended it), as subprocess.call returns it."""
    for stream in (sys.stdout, sys.stderr, output):
        stream.flush()  # else what they buffer would be written twice, by the child too
    pid = os.fork()
    if pid == 0:
        run_as_child(args, env, output.fileno(), output.fileno())
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def run_as_child(args: list[str], env: dict[str, str], stdout: int, stderr: int) -> NoReturn:
    """In a forked child: stdin from /dev/null, stdout and stderr onto the descriptors given (closed
    then), `env` as the environment, then `python ARGS` (`run_main`); exits with its status."""
    code = 1
    try:
        stdin = os.open(os.devnull, os.O_RDONLY)
        for target, source in ((0, stdin), (1, stdout), (2, stderr)):
            os.dup2(source, target)
        for descriptor in {stdin, stdout, stderr} - {0, 1, 2}:
            os.close(descriptor)
        os.environ.clear()
        os.environ.update(env)
        code = run_main(args)
    finally:
        os._exit(code)


def run_main(args: list[str]) -> int:
    """`python ARGS` in this process: the script (or `-m` module) as __main__, then Python's exit."""
    import atexit
    import runpy
    import tempfile
    import threading
    import traceback

    import numpy
    import torch

    # What a fresh interpreter would start with, where the preloaded imports could have moved it.
    tempfile.tempdir = None
    numpy.random.seed()
    torch.manual_seed(torch.initial_seed())
    try:
        if args[0] == "-m":
            sys.path[0] = os.getcwd()
            sys.argv = [args[1], *args[2:]]
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            sys.argv = list(args)
            runpy.run_path(args[0], run_name="__main__")
        code = 0
    except SystemExit as exit:
        code = _exit_status(exit.code)
    except BaseException:  # noqa: BLE001 - printed and turned into status 1, as the interpreter does
        traceback.print_exc()
        code = 1
    threading._shutdown()
    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    return code


def _exit_status(code) -> int:
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF
    print(code, file=sys.stderr)
    return 1
