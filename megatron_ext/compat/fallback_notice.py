"""megatron-core warns at import, from four of its modules and in every process, that Transformer
Engine and Apex are missing and it falls back to torch. We say that once per process, in our words:
on rank 0 of a GPU machine (where installing them matters: TE layers, FP8), elsewhere only with
--debug, since a CPU can use neither."""

from __future__ import annotations

import logging
import os
import sys
import warnings

_MISSING = ("Transformer Engine and Apex are not installed", "Apex is not installed")
_NOTE = "Transformer Engine / Apex not installed here: megatron-core uses its torch implementations"
_state = {"seen": False, "told": False, "rank": None}


def _on_gpu() -> bool:
    return sys.modules["torch"].cuda.is_available() if "torch" in sys.modules else False


def tell(rank: int | None = None) -> None:
    """Our one line, if megatron-core fell back and logging is set up (setup_logging calls this with
    its rank, for warnings raised by imports before it)."""
    if rank is not None:
        _state["rank"] = rank
    if not _state["seen"] or _state["told"] or not logging.getLogger().handlers:
        return
    _state["told"] = True
    if (_state["rank"] if _state["rank"] is not None else int(os.environ.get("RANK", 0))) == 0:
        logging.getLogger("megatron_ext").log(logging.INFO if _on_gpu() else logging.DEBUG, _NOTE)


def install() -> None:
    """Catch megatron-core's fallback warnings in this process from now on (megatron_ext's import does)."""
    show = warnings.showwarning

    def showwarning(message, category, filename, lineno, file=None, line=None):
        if not any(missing in str(message) for missing in _MISSING):
            return show(message, category, filename, lineno, file, line)
        _state["seen"] = True
        tell()

    warnings.showwarning = showwarning
