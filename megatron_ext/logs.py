"""Logging setup shared by every command-line entry point."""

from __future__ import annotations

import logging
import os
import warnings


class _DropNoise(logging.Filter):
    """Messages that repeat on every run and tell the user nothing they can act on."""

    NOISE = ("requires torchvision", "LLaVA is work in progress", "Apex is not installed", "Apex are not installed")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(noise in message for noise in self.NOISE)


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
    warnings.filterwarnings("ignore", message=".*Apex (is|are) not installed.*")
    # Raised by megatron-core's own defaults and energon's hard-coded pin_memory on CPU.
    warnings.filterwarnings("ignore", message=".*full scope is deprecated.*")
    warnings.filterwarnings("ignore", message=".*'pin_memory' argument is set as true.*")
    if not verbose:
        for noisy in ("megatron.core", "torch.distributed", "httpx", "urllib3"):
            logging.getLogger(noisy).setLevel(logging.WARNING)
