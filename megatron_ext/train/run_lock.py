"""One run per save directory: a lock file naming its holder, kept fresh while the run lives.

Two runs writing one --save-dir prune and publish each other's snapshots (seen: a run resumed
from a snapshot the other deleted a moment later). The trainer's rank 0 holds `SAVE_DIR/.run.lock`
(host, pid, start time) and touches it every HEARTBEAT_S seconds. A lock whose holder is gone is
taken over with a warning: on the same host when its process no longer exists, from another host
when it has not been touched for STALE_AFTER_S seconds (a node that died cannot say so).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from megatron_ext.errors import UserError

log = logging.getLogger(__name__)

LOCK_FILE = ".run.lock"
HEARTBEAT_S = 10.0
STALE_AFTER_S = 60.0


@dataclass(frozen=True)
class Holder:
    host: str
    pid: int
    process_start: float  # the process's own start time: a reused pid is another process
    started: str

    @classmethod
    def this_process(cls) -> "Holder":
        import psutil

        return cls(socket.gethostname(), os.getpid(), psutil.Process().create_time(),
                   time.strftime("%Y-%m-%d %H:%M:%S"))

    def alive(self, touched: float) -> bool:
        if self.host != socket.gethostname():
            return time.time() - touched < STALE_AFTER_S
        import psutil

        try:
            return abs(psutil.Process(self.pid).create_time() - self.process_start) < 1.0
        except psutil.NoSuchProcess:
            return False

    def describe(self) -> str:
        return f"a run on {self.host} (pid {self.pid}, started {self.started})"


def _read(path: Path) -> tuple[Holder, float] | None:
    try:
        return Holder(**json.loads(path.read_text())), path.stat().st_mtime
    except FileNotFoundError:
        return None
    except (ValueError, TypeError):  # a half-written lock: its writer died while writing it
        return Holder("?", -1, 0.0, "?"), 0.0


def live_holder(save_dir: str | Path) -> Holder | None:
    """The run holding `save_dir`, if one is alive."""
    found = _read(Path(save_dir) / LOCK_FILE)
    if found is None or not found[0].alive(found[1]):
        return None
    return found[0]


def in_use_error(save_dir: str | Path, holder: Holder) -> UserError:
    return UserError(f"--save-dir {save_dir} is in use by {holder.describe()}; wait for it to end, stop it, or "
                     "choose another --save-dir")


class RunLock:
    """Held by one process; `release` (or the process's end) frees it."""

    def __init__(self, save_dir: str | Path):
        self.path = Path(save_dir) / LOCK_FILE
        self.holder = Holder.this_process()
        self._stop = threading.Event()
        self._beat = None

    def acquire(self) -> "RunLock":
        self.path.parent.mkdir(parents=True, exist_ok=True)
        content = json.dumps(asdict(self.holder))
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            self._take_over(content)
        else:
            with os.fdopen(fd, "w") as f:
                f.write(content)
        self._beat = threading.Thread(target=self._heartbeat, name="run-lock-heartbeat", daemon=True)
        self._beat.start()
        return self

    def _take_over(self, content: str) -> None:
        found = _read(self.path)
        if found is not None and found[0].alive(found[1]):
            raise in_use_error(self.path.parent, found[0])
        tmp = self.path.with_name(f"{LOCK_FILE}.{os.getpid()}")
        tmp.write_text(content)
        os.replace(tmp, self.path)
        time.sleep(0.2)  # another run taking over at the same moment: the last rename wins
        mine = _read(self.path)
        if mine is None or mine[0] != self.holder:
            raise in_use_error(self.path.parent, mine[0] if mine else found[0])
        if found is not None:
            log.warning("--save-dir %s: took over the lock of %s, which is gone", self.path.parent, found[0].describe())

    def _heartbeat(self) -> None:
        while not self._stop.wait(HEARTBEAT_S):
            try:
                os.utime(self.path)
            except FileNotFoundError:
                return

    def release(self) -> None:
        self._stop.set()
        found = _read(self.path)
        if found is not None and found[0] == self.holder:
            self.path.unlink(missing_ok=True)
