"""Logging setup shared by every command-line entry point, and the one home of the filters that keep
third-party noise (warnings, log lines) out of a command's output."""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import warnings

from megatron_ext.compat import fallback_notice
from megatron_ext.progress import quiet_library_bars

# megatron-core's advice for runs on CUDA, which it gives on a CPU too.
_CUDA_ADVICE = "CUDA_DEVICE_MAX_CONNECTIONS"


class _DropNoise(logging.Filter):
    """Messages that repeat on every run and tell the user nothing they can act on."""

    NOISE = ("requires torchvision", "LLaVA is work in progress", "Apex is not installed", "Apex are not installed",
             # megatron-core 0.19: its LLaVAModel builds the GPTModel it deprecates; and it reads the common.pt
             # we write for 0.16 (compat/releases.py) with the function it deprecates.
             "GPTModel IS DEPRECATED", "load_common is deprecated")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in self.NOISE)


def _on_gpu() -> bool:
    return sys.modules["torch"].cuda.is_available() if "torch" in sys.modules else False


def _filtered(show):
    """megatron-core's advice on CUDA settings, dropped where there is no CUDA (its fallback warnings are
    compat/fallback_notice's)."""

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if _CUDA_ADVICE in str(message) and not _on_gpu():
            return
        show(message, category, filename, lineno, file, line)

    return showwarning


@contextlib.contextmanager
def quiet_megatron_core():
    """megatron-core's notices at import and while building configs (Transformer Engine / Apex
    missing, the defaults it deprecates, "LLaVA is work in progress") kept out of a command that
    only plans a run (run.py's memory plan): none of them is about the user's run."""
    logger = logging.getLogger("megatron.core")
    level = logger.level
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", category=UserWarning, module="megatron")
        logger.setLevel(logging.ERROR)
        try:
            yield
        finally:
            logger.setLevel(level)


def setup_logging(verbose: bool = False, rank: int | None = None) -> None:
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    prefix = f"[rank{rank}] " if int(os.environ.get("WORLD_SIZE", 1)) > 1 else ""
    logging.basicConfig(
        level=logging.DEBUG if verbose else logging.INFO,
        format=f"%(asctime)s {prefix}%(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
        force=True,
    )
    for handler in logging.getLogger().handlers:
        handler.addFilter(_DropNoise())
    for name in ("transformers", "megatron"):
        logging.getLogger(name).addFilter(_DropNoise())
    warnings.showwarning = _filtered(warnings.showwarning)
    fallback_notice.tell(rank)
    # Raised by megatron-core's own defaults and energon's hard-coded pin_memory on CPU.
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true.*")
    # megatron-core 0.19's loader calls torch's with the reader positional and each rank reading alone.
    warnings.filterwarnings("ignore", message="The argument order of load has been changed")
    warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
    quiet_library_bars()
    # torch.multiprocessing announces that it stops the other ranks after one failed; the failure is
    # what matters (megatron_ext/rank_failures.py).
    logging.getLogger("torch.multiprocessing.spawn").setLevel(logging.ERROR)
    if not verbose:
        for noisy in ("megatron.core", "torch.distributed", "httpx", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
        # The libraries announce what they deprecate to the code that calls it (megatron-core calling
        # torch's, torch its own), which is theirs. By category: one raised through a wrapper of ours
        # (cpu_support) is attributed to our module.
        for category in (DeprecationWarning, PendingDeprecationWarning, FutureWarning):
            warnings.filterwarnings("ignore", category=category)
