"""torchrun's exit-barrier race, recognised in its stderr so that run.py can keep it off a successful run.

At the end of a multi-node run each node's torchrun waits in an exit barrier on the first node's store.
The first node's torchrun can leave the barrier and close its store while another node's still reads
from it: that node then logs a C++ trace of the broken read and "Error waiting on exit barrier" with a
Python traceback, after every rank ended with status 0, and still ends with status 0 (torch 2.13).
"""

from __future__ import annotations

import re

MARK = b"Error waiting on exit barrier"
# The report's first lines: the store's failed read, and the agent's log record (every line of which
# torch's log format prefixes with the agent's source location).
_STORE_READ = rb"\[W\d+ \S+ TCPStore\.cpp:\d+\] \[c10d\] recvValueWithTimeout failed "
_AGENT = rb"E\d+ \S+ \d+ torch/distributed/elastic/agent/server/api\.py:\d+\] "
# Any line of the report: those, and the failed read's C++ frames.
_LINE = re.compile(rb"|".join([_STORE_READ, rb"Exception raised from recvBytes at ", rb"frame #\d+: ",
                               rb"<omitting python frames>", _AGENT]))
# Where such a report begins in a chunk of output: at a line's start.
_BEGINS = re.compile(rb"(?m)^(?:" + _STORE_READ + rb"|" + _AGENT + MARK + rb")")

NOTE = (b"run.py: torchrun logged its exit-barrier race after every rank of this node ended with status 0; "
        b"not a failure (docs/launcher.md)\n")


def begins_at(chunk: bytes) -> int | None:
    """The offset in `chunk` of the line where a report of the race may begin, else None."""
    match = _BEGINS.search(chunk)
    return match.start() if match else None


def could_be(held: bytes) -> bool:
    """Whether every complete line of `held` (a line not yet ended may still become one) is a line of the report."""
    return all(_LINE.match(line) for line in held.split(b"\n")[:-1])


def is_race(held: bytes) -> bool:
    """Whether `held`, all of a node's stderr from some line to its end, is a report of the race and nothing else."""
    return MARK in held and all(_LINE.match(line) for line in held.rstrip(b"\n").split(b"\n"))
