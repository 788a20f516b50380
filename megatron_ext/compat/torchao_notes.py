"""torchao logs at its import, in every process, each of its C++ extensions it cannot load for this torch
(mx formats, CUTLASS kernels), and torch logs that torchao's way of registering its enums is deprecated.
transformers imports torchao whenever it is installed (the `fp8` extra), so every command would print
these on every rank, and the word "error" in torch's note reads as a failure in a job's log. Float8
training uses no extension; neither note concerns a run. `install()` (at megatron_ext's import) drops
exactly these records."""

from __future__ import annotations

import logging

_NOTES = {
    "torchao": ("Failed to load ", "Skipping import of cpp extensions"),
    "torch.utils._pytree": ("Calling register_constant() on Enum subclasses is deprecated",),
}


class _DropNotes(logging.Filter):
    def __init__(self, parts: tuple[str, ...]):
        super().__init__()
        self.parts = parts

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(part in message for part in self.parts)


def install() -> None:
    for name, parts in _NOTES.items():
        logging.getLogger(name).addFilter(_DropNotes(parts))
