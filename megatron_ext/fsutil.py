"""Output directories and files that appear complete or not at all."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from megatron_ext.errors import UserError


def check_output_dir(path: str | os.PathLike, force: bool, flag: str) -> Path:
    """Refuse an existing non-empty directory unless `force`; return the resolved path."""
    path = Path(path).expanduser().resolve()
    if path.exists() and not path.is_dir():
        raise UserError(f"{flag} {path} exists and is not a directory")
    if path.is_dir() and any(path.iterdir()) and not force:
        raise UserError(f"{flag} {path} is not empty; choose a new directory or pass --force to replace it")
    return path


@contextlib.contextmanager
def atomic_output_dir(path: str | os.PathLike):
    """Yield a temporary sibling directory; on success it replaces `path`, on failure it is removed.

    The temporary directory lives next to `path` so the final rename stays on one filesystem.
    """
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{path.name}.tmp-", dir=path.parent))
    # mkdtemp makes it private (0700); the result should get the permissions any new directory gets.
    umask = os.umask(0)
    os.umask(umask)
    os.chmod(tmp, 0o777 & ~umask)
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    replace_dir(tmp, path)


def replace_dir(src: Path, dst: Path) -> None:
    """Move the complete directory `src` to `dst`, replacing whatever `dst` held."""
    old = None
    if dst.exists():
        old = dst.with_name(f".{dst.name}.old-{os.getpid()}")
        os.rename(dst, old)
    os.rename(src, dst)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def atomic_write_text(path: str | os.PathLike, text: str) -> None:
    """Write a small text file through a temporary name so readers never see half of it."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_jsonl(path: str | os.PathLike, records: list[dict]) -> None:
    """One JSON object a line (UTF-8 kept readable), written atomically; parent folders created."""
    path = Path(path).expanduser()
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, "".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records))
